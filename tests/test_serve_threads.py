"""`ft serve` loads the model on the thread that runs every forward afterwards: torch's CPU
thread teams (OpenMP) are per thread, and while the loader's thread lived on beside the
engine's, each parallel CPU op of the engine paid to form its own team (a CPU engine's
512-token prefill 25% slower, batch-8 decode 45%)."""

from __future__ import annotations

import threading

from serving import InProcessServer


def test_the_model_loads_on_the_engine_thread(tmp_path, monkeypatch):
    from freetoken.demo.tiny_model import make_tiny_model
    from freetoken.server.app import ServingApp
    seen = {}
    load = ServingApp._load_blocking

    def recording_load(self):
        seen["load"] = threading.current_thread()
        core = load(self)
        step = core.run_step

        def recording_step(plan):
            seen.setdefault("steps", set()).add(threading.current_thread())
            return step(plan)
        core.run_step = recording_step
        return core

    monkeypatch.setattr(ServingApp, "_load_blocking", recording_load)
    model = make_tiny_model(tmp_path / "tiny-threads", family="qwen3_moe", seed=0)
    with InProcessServer(model, name="tiny-threads") as s:
        status, body = s.request("POST", "/v1/completions", {
            "model": "tiny-threads", "prompt": "a lighthouse", "max_tokens": 3,
            "temperature": 0})
        assert status == 200, body
    assert seen["load"].name.startswith("ft-engine") and seen["steps"] == {seen["load"]}
