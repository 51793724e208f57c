"""The benchmark harness (`ft bench serve`, bench/harness) against real `ft serve` processes on a
tiny checkpoint: a smoke run writes all three artifacts and its JSONL reassembles to the
summary; each invalidating condition, injected, turns the verdict INVALID with its code; an
interrupted run is INCOMPLETE.

Faults a healthy FreeToken never shows (a server that caps output length, one without
/v1/instrumentation, one restarted with other flags mid-run) are injected by FaultProxy, a
real HTTP proxy between the harness and the server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from freetoken import bench_cli
from serving import ServerProcess
from tiny_fixtures import tiny_model_dir  # noqa: F401 - a fixture

SMOKE = ["--warmups", "1", "--repetitions", "2"]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):  # noqa: F811 - the imported fixture
    return tiny_model_dir("qwen3_moe", seed=0, name="tiny-qwen3", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def server_b(model_dir):
    """The same model served with another prefill chunk: a different resolved configuration."""
    with ServerProcess(model_dir, "--max-prefill-length", "64") as s:
        yield s


def bench(tmp_path, *argv) -> tuple[int, dict | None, Path]:
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    code = bench_cli.main(["serve", *argv, "--out", str(out)])
    run = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else None
    return code, run, out


def codes(run: dict, overridden: bool | None = None) -> set[str]:
    return {r["code"] for r in run["verdict"]["reasons"] if overridden is None or r["overridden"] == overridden}


def read_jsonl(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]


class FaultProxy:
    """An HTTP/1.1 proxy on a free port (one request per connection) that can cap max_tokens,
    answer 404 on chosen paths, and send every request after the first N POSTs elsewhere."""

    def __init__(self, upstream: int, cap_max_tokens: int | None = None, not_found: tuple = (),
                 switch_to: int | None = None, switch_after_posts: int = 0):
        self.upstream, self.cap, self.not_found = upstream, cap_max_tokens, not_found
        self.switch_to, self.switch_after, self.posts = switch_to, switch_after_posts, 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self, ready):
        asyncio.set_event_loop(self.loop)
        srv = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = srv.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _handle(self, reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = [ln for ln in lines[1:] if ln and not ln.lower().startswith(("content-length", "connection"))]
        length = next((int(ln.split(":")[1]) for ln in lines[1:] if ln.lower().startswith("content-length")), 0)
        body = await reader.readexactly(length)
        if path in self.not_found:
            msg = b'{"error": "not found"}'
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (len(msg), msg))
            await writer.drain()
            writer.close()
            return
        if self.switch_to is not None and self.posts >= self.switch_after:
            self.upstream = self.switch_to
        port = self.upstream
        if method == "POST":
            self.posts += 1
            if self.cap is not None:
                obj = json.loads(body)
                obj["max_tokens"] = min(obj["max_tokens"], self.cap)
                body = json.dumps(obj).encode()
        up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
        up_w.write(f"{method} {path} HTTP/1.1\r\n".encode() + "\r\n".join(headers).encode()
                   + b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        while chunk := await up_r.read(65536):
            writer.write(chunk)
            await writer.drain()
        up_w.close()
        writer.close()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_smoke_run_writes_artifacts_that_reassemble(tmp_path, server, model_dir):
    code, run, out = bench(tmp_path, "--url", server.base, "--workload", "smoke_chat", "--workload",
                           "smoke_agent", "--workload", "smoke_sweep", "--sessions", "2", *SMOKE)
    v = run["verdict"]
    assert list(run)[0] == "verdict"
    assert (v["status"], v["validity"]) == ("COMPLETE", "NON_CANONICAL"), v["reasons"]
    assert code == 0
    assert "PROTOCOL_OVERRIDDEN" in codes(run) and all(r["severity"] == "NON_CANONICAL" for r in v["reasons"])
    title = (out / "SUMMARY.md").read_text().splitlines()[0]
    assert title == f"# FreeToken benchmark {run['run_id']}: COMPLETE, NON_CANONICAL"

    # Provenance: the checkout, the host, the server's resolved configuration, the model's hash.
    assert len(run["harness"]["git"]["commit"]) == 40 and run["harness"]["host"]["ram_bytes"] > 0
    prov = run["arms"]["ft"]["provenance"]
    assert prov["instrumentation"]["status"] == 200 and prov["missing"] == []
    assert prov["model"]["config_sha256"] == hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
    assert run["arms"]["ft"]["config"]["changes"] == []

    records = read_jsonl(out)
    gens = [r for r in records if r["phase"] != "probe"]
    assert v["observed_generations"] == v["expected_generations"] == len(gens) == 2 * (3 + 9 + 3 + 12)
    # Warmups are kept, tagged; every generation passed its checks; stamps are the ITLs' source.
    assert sum(r["phase"] == "warmup" for r in gens) == 2 * (1 + 3 + 1 + 4)
    for r in gens:
        assert all(r["checks"].values()), r
        assert r["completion_tokens"] == r["max_tokens"] and r["finish_reason"] == "length"
        assert r["ttft_s"] == r["event_times_s"][0] and r["event_times_s"] == sorted(r["event_times_s"])
    # The recorded order: blocks in plan order, session 2 the reverse of session 1.
    blocks = [r["block"] for r in sorted(gens, key=lambda r: r["seq"])]
    assert blocks == sorted(blocks)
    plan = [(b["arm"], b["workload"], b["concurrency"]) for b in run["plan"]]
    assert plan[len(plan) // 2:] == plan[:len(plan) // 2][::-1]

    # The JSONL alone gives the summary's medians, and SUMMARY.md prints them.
    summary_md = (out / "SUMMARY.md").read_text()
    measured = [r for r in gens if r["phase"] == "measured"]
    for key, g in run["summary"].items():
        mine = [r for r in measured if (r["arm"], r["workload"], r["concurrency"], r["turn"])
                == (g["arm"], g["workload"], g["concurrency"], g["turn"])]
        assert g["n"] == len(mine) == 4 * g["concurrency"]
        ttft = statistics.median(r["ttft_s"] for r in mine)
        decode = statistics.median((r["completion_tokens"] - 1) / (r["event_times_s"][-1] - r["event_times_s"][0])
                                   for r in mine)
        itl = statistics.median(b - a for r in mine for a, b in zip(r["event_times_s"], r["event_times_s"][1:]))
        assert (g["ttft_s"]["median"], g["decode_tok_s"]["median"], g["itl_s"]["median"]) == (ttft, decode, itl)
        assert f"{1e3 * ttft:.2f} [" in summary_md and f"{decode:.1f} [" in summary_md


def test_prompt_out_of_class_is_invalid_unless_overridden(tmp_path, server):
    # short_chat's fixture is sized for real tokenizers; the demo tokenizer needs far more tokens.
    code, run, out = bench(tmp_path, "--url", server.base, "--workload", "short_chat", *SMOKE)
    v = run["verdict"]
    assert code == 3 and v["refused"] and (v["status"], v["validity"]) == ("INCOMPLETE", "INVALID")
    assert v["observed_generations"] == 0 and "PROMPT_OUT_OF_CLASS" in codes(run, overridden=False)
    assert (out / "SUMMARY.md").read_text().splitlines()[0].endswith("INCOMPLETE, INVALID")
    assert "Do not compare or publish" in (out / "SUMMARY.md").read_text()
    assert [r["phase"] for r in read_jsonl(out)] == ["probe"]

    code, run, _ = bench(tmp_path, "--url", server.base, "--workload", "short_chat", "--allow",
                         "PROMPT_OUT_OF_CLASS", "--warmups", "0", "--repetitions", "1")
    assert (run["verdict"]["status"], run["verdict"]["validity"]) == ("COMPLETE", "NON_CANONICAL")
    assert "PROMPT_OUT_OF_CLASS" in codes(run, overridden=True) and code == 0


def test_output_length_not_requested_is_invalid(tmp_path, server):
    proxy = FaultProxy(server.port, cap_max_tokens=12)       # a server that caps output length
    try:
        code, run, out = bench(tmp_path, "--url", proxy.url, "--workload", "smoke_chat", "--warmups", "0",
                               "--repetitions", "2")
    finally:
        proxy.close()
    assert run["verdict"]["validity"] == "INVALID" and code == 1
    assert "OUTPUT_LENGTH_MISMATCH" in codes(run, overridden=False)
    reason = next(r for r in run["verdict"]["reasons"] if r["code"] == "OUTPUT_LENGTH_MISMATCH")
    assert "2 of 2" in reason["detail"] and "16/12/length" in reason["detail"]
    with pytest.raises(SystemExit, match="--allow takes"):      # not a reason --allow can excuse
        bench_cli.main(["serve", "--url", server.base, "--workload", "smoke_chat", "--allow",
                        "OUTPUT_LENGTH_MISMATCH", "--dry-run"])


def test_missing_instrumentation_is_a_provenance_failure(tmp_path, server, model_dir):
    proxy = FaultProxy(server.port, not_found=("/v1/instrumentation",))
    try:
        code, run, out = bench(tmp_path, "--url", proxy.url, "--workload", "smoke_chat", *SMOKE)
        prov = run["arms"]["ft"]["provenance"]
        assert code == 3 and run["verdict"]["validity"] == "INVALID"
        assert "PROVENANCE_MISSING" in codes(run, overridden=False)
        assert prov["instrumentation"]["status"] == 404
        # The model's identity falls back to /v1/models (its root is the checkpoint folder).
        assert prov["model"]["source"] == "/v1/models" and prov["model"]["id"] == "tiny-qwen3"
        assert prov["model"]["config_sha256"] == hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()
        code, run, out = bench(tmp_path, "--url", proxy.url, "--workload", "smoke_chat", "--allow",
                               "PROVENANCE_MISSING", *SMOKE)
    finally:
        proxy.close()
    assert (run["verdict"]["status"], run["verdict"]["validity"]) == ("COMPLETE", "NON_CANONICAL")
    assert "PROVENANCE_MISSING" in codes(run, overridden=True)


def test_arms_differing_in_undeclared_config_are_invalid(tmp_path, server, server_b):
    argv = ["--url", f"a={server.base}", "--url", f"b={server_b.base}", "--workload", "smoke_chat",
            "--warmups", "0", "--repetitions", "1"]
    code, run, _ = bench(tmp_path, *argv)
    assert code == 3 and "ARMS_CONFIG_DIFFER" in codes(run)
    reason = next(r for r in run["verdict"]["reasons"] if r["code"] == "ARMS_CONFIG_DIFFER")
    assert "scheduler.max_prefill_length: 2048 vs 64" in reason["detail"]
    code, run, _ = bench(tmp_path, *argv, "--varies", "scheduler.max_prefill_length")
    assert "ARMS_CONFIG_DIFFER" not in codes(run)
    assert run["verdict"]["status"] == "COMPLETE" and run["verdict"]["validity"] == "NON_CANONICAL"
    assert {g["arm"] for g in run["summary"].values()} == {"a", "b"}


def test_config_changed_during_run_is_invalid(tmp_path, server, server_b):
    # The probe and block 0's two generations reach server A; then "the server was restarted"
    # with another --max-prefill-length, which block 0's closing snapshot sees.
    proxy = FaultProxy(server.port, switch_to=server_b.port, switch_after_posts=3)
    try:
        code, run, _ = bench(tmp_path, "--url", proxy.url, "--workload", "smoke_chat", "--warmups", "0",
                             "--repetitions", "2", "--sessions", "2")
    finally:
        proxy.close()
    assert run["verdict"]["validity"] == "INVALID" and code == 1
    assert "ARM_CONFIG_CHANGED" in codes(run, overridden=False)
    change = run["arms"]["ft"]["config"]["changes"][0]
    assert (change["block"], change["when"]) == (0, "after")
    assert change["diff"]["scheduler.max_prefill_length"] == [2048, 64]


def _start_bench(server, out: Path, repetitions: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "freetoken.cli", "bench", "serve", "--url", server.base,
                             "--workload", "smoke_chat", "--warmups", "0", "--repetitions", str(repetitions),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            # SIGINT back to its default in the child: a suite started as a
                            # background job (`cmd &` in a script) passes it on ignored, and
                            # Python then never raises KeyboardInterrupt (the run went on to its
                            # 500 generations in CI rehearsals started that way)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_lines(out: Path, n: int, proc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    path = out / "generations.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.02)
    raise TimeoutError("the bench run wrote no generations")


def test_interrupted_run_is_incomplete(tmp_path, server):
    out = tmp_path / "interrupted"
    proc = _start_bench(server, out, 500)
    _wait_lines(out, 4, proc)           # the probe and three measured generations
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130, proc.stdout.read().decode()
    run = json.loads((out / "run.json").read_text())
    v = run["verdict"]
    assert v["status"] == "INCOMPLETE" and v["interrupted"] and v["finalized"]
    assert 3 <= v["observed_generations"] < v["expected_generations"] == 500
    assert (out / "SUMMARY.md").read_text().splitlines()[0].endswith("INCOMPLETE, NON_CANONICAL")

    # Killed outright, the record written before the first warmup still stands: never valid.
    out = tmp_path / "killed"
    proc = _start_bench(server, out, 500)
    _wait_lines(out, 3, proc)
    proc.kill()
    proc.wait(30)
    v = json.loads((out / "run.json").read_text())["verdict"]
    assert (v["status"], v["validity"], v["finalized"]) == ("INCOMPLETE", "INVALID", False)
    assert "RUN_NOT_FINALIZED" in {r["code"] for r in v["reasons"]}


def test_transformers_arm_on_cpu(tmp_path, server, model_dir):
    code, run, out = bench(tmp_path, "--url", f"ft={server.base}", "--transformers", f"hf={model_dir}",
                           "--workload", "smoke_chat", "--warmups", "0", "--repetitions", "2")
    assert (run["verdict"]["status"], run["verdict"]["validity"]) == ("COMPLETE", "NON_CANONICAL")
    prov = run["arms"]["hf"]["provenance"]
    assert prov["versions"]["transformers"]
    assert prov["accelerate_available"] == (prov["versions"]["accelerate"] is not None)
    hf = [r for r in read_jsonl(out) if r["arm"] == "hf" and r["phase"] == "measured"]
    ft = [r for r in read_jsonl(out) if r["arm"] == "ft" and r["phase"] == "measured"]
    # The same chat template: the baseline's prompt is the server's, token for token.
    assert {r["prompt_tokens"] for r in hf} == {r["prompt_tokens"] for r in ft}
    assert all(r["completion_tokens"] == 16 and len(r["event_times_s"]) == 16 for r in hf)
    if prov["versions"]["accelerate"] is None:
        assert bench_cli.main(["serve", "--transformers", str(model_dir), "--transformers-offload",
                               "--workload", "smoke_chat", "--dry-run"]) == 3


def test_dry_run_lists_every_refusal_and_writes_nothing(tmp_path, server, capsys):
    # A copied manifest whose fixture was edited after its hash was pinned.
    src = Path(bench_cli.REPO) / "bench" / "workloads"
    mine = tmp_path / "workloads"
    shutil.copytree(src, mine)
    (mine / "smoke_chat.txt").write_text("Edited after pinning.\n")
    out = tmp_path / "never"
    code = bench_cli.main(["serve", "--url", server.base, "--manifest", str(mine / "manifest.json"),
                           "--workload", "smoke_chat", "--workload", "short_chat", "--dry-run", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 3 and not out.exists()
    assert "#0   session 1 (forward): arm ft, workload smoke_chat" in text
    for reason in ("FIXTURE_HASH_MISMATCH", "CUSTOM_MANIFEST", "PROMPT_OUT_OF_CLASS", "REFUSED"):
        assert reason in text, text


def test_verdict_rules():
    v = bench_cli.load_harness()["validity"]
    Reason, apply_overrides, validity = v.Reason, v.apply_overrides, v.validity
    assert validity([]) == "VALID"
    assert validity([Reason("DIRTY_TREE", "x")]) == "NON_CANONICAL"
    rs = apply_overrides([Reason("PROMPT_OUT_OF_CLASS", "x")], {"PROMPT_OUT_OF_CLASS"})
    assert rs[0].overridden and validity(rs) == "NON_CANONICAL"
    rs = apply_overrides([Reason("OUTPUT_LENGTH_MISMATCH", "x")], {"OUTPUT_LENGTH_MISMATCH"})
    assert not rs[0].overridden and validity(rs) == "INVALID"


def test_launched_configurations_compared(tmp_path, model_dir):
    """Two FreeToken configurations that `ft bench` starts and stops itself; the KV cache size
    (and the MoE plan's KV reserve, which follows from it) is the declared difference."""
    code, run, out = bench(tmp_path, "--serve", f"small={model_dir} --device cpu --kv-cache-tokens 4096",
                           "--serve", f"large={model_dir} --device cpu --kv-cache-tokens 8192",
                           "--varies", "kv_cache", "--varies", "moe.kv_reserve_tokens", "--workload", "smoke_chat",
                           "--warmups", "0", "--repetitions", "1")
    assert (run["verdict"]["status"], run["verdict"]["validity"]) == ("COMPLETE", "NON_CANONICAL"), run["verdict"]
    tokens = {name: arm["config"]["initial"]["kv_cache"]["tokens"] for name, arm in run["arms"].items()}
    assert tokens == {"small": 4096, "large": 8192}
    for arm in run["arms"].values():        # both servers were stopped
        port = int(arm["describe"]["url"].rsplit(":", 1)[1])
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_client_stream_times_out_and_a_cancel_stops_it():
    # A server that accepts and never answers: the stream gives up at its timeout with the
    # reason; cancelled as it waits (a Ctrl-C), it raises CancelledError rather than going on.
    bench_cli.load_harness()
    from bench.harness import client

    async def main():
        async def silent(reader, writer):
            await asyncio.sleep(30)
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        ep = client.Endpoint("http", "127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            res = await client.stream(ep, "chat", {"messages": []}, None, 0.2)
            assert res.error == "timed out after 0.2s" and res.t_end >= res.t_start
            task = asyncio.create_task(client.stream(ep, "chat", {"messages": []}, None, 30))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            server.close()
    asyncio.run(main())
