"""What `ft serve` says while it starts: the context warning for --max-seq-len-override, the
warmup-skipped reason, loading progress (a bar on a terminal, log lines otherwise), no raw
dicts; and that the test harness leaves no server logs behind."""

from __future__ import annotations

import glob
import io
import re

from freetoken.models.config import ModelConfig
from freetoken.scheduler.core import context_warning
from freetoken.server.progress import LoadProgress
from serving import ServerProcess
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture


def _config(**over):
    import dataclasses
    fields = {f.name: None for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{**fields, "max_position_embeddings": 4096, "rope": {"rope_type": "default"}, **over})


def test_context_warning_names_both_numbers():
    assert context_warning(_config(), 4096) is None
    w = context_warning(_config(), 1_000_000)
    assert "1000000" in w and "4096" in w and "no RoPE scaling" in w
    yarn = _config(rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                   max_position_embeddings=40960)
    assert context_warning(yarn, 131072) is None
    w = context_warning(yarn, 200000)
    assert "40960" in w and "131072" in w and "yarn" in w


def test_progress_bar_on_a_terminal(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    p = LoadProgress(tty=True)
    for done in range(0, 2**20 + 1, 2**18):
        p.bytes(done, 2**20)
    p.phase("warmup: extend length 16 (1/3)")
    p.close()
    out = err.getvalue()
    assert "loading weights" in out and "1.00M" in out and "warmup: extend length 16 (1/3)" in out


def test_startup_log(tiny_model_dir):  # noqa: F811
    model = tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=256)
    with ServerProcess(model, "--max-seq-len-override", "4096") as s:
        path = s.log_path
        _, models = s.request("GET", "/v1/models")
        assert models["data"][0]["max_model_len"] == 4096
    logs = s.logs()
    assert re.search(r"WARNING .*max_model_len 4096 exceeds .*max_position_embeddings is 256", logs), logs
    assert "warmup skipped: the cpu device" in logs
    assert re.search(r"loading weights: [\d.]+ of [\d.]+ MiB \(100%\)", logs)
    assert not re.search(r"\{'", logs), "a raw dict in the log"
    assert path not in glob.glob("/tmp/ft-serve-*.log")
