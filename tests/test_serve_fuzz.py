"""Fuzzed bodies over every POST route (tools/fuzz_bodies.py, seeded so a failure reproduces):
no 5xx, no dropped connection, and the server still serves and has freed every KV block.
CI runs a few hundred; `python tools/fuzz_bodies.py --count 10000` runs the full count."""

from __future__ import annotations

import sys
from pathlib import Path

from serving import ServerProcess
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fuzz_bodies  # noqa: E402


def test_fuzzed_bodies_get_no_5xx_and_leave_the_server_whole(tiny_model_dir):  # noqa: F811
    with ServerProcess(tiny_model_dir(), "--cpu-threads", "1") as server:
        failures = fuzz_bodies.run(server.base, seed=7, count=300)
        assert not failures, failures[:5]
        status, health = server.health()    # (one call: uptime_s moves between two)
        assert status == 200 and health["status"] == "ok"
        status, stats = server.request("GET", "/v1/stats")
        assert status == 200 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        status, body = server.request("POST", "/v1/completions", {
            "prompt": "still here", "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
