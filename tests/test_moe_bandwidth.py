"""`ft bench bw` and the profile it saves: measured on this CPU, read back by the runtime, and
what `auto` and hybrid's K make of a profile (synthetic profiles fix the figures so the
decision is known), of a stale one, and of none."""

import json
import socket

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.bench_cli import main as bench_main
from freetoken.moe.bandwidth import ExpertCosts
from freetoken.moe.profile import PROFILE_VERSION, load_profile, profile_path
from freetoken.utils.device import device_key, find_gpu
from hf_checkpoints import cached_checkpoint

PROMPTS = [[5, 17, 99, 3, 200, 7, 8, 45, 11, 250, 31, 64, 2], [1, 2, 3]]
PARAMS = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "ftcache"))
    old = torch.get_num_threads()
    torch.set_num_threads(1)        # the profile records the CPU threads it was measured with
    yield tmp_path / "ftcache"
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # qwen3_moe gqa_norm_topk: 2 MoE layers x 8 experts, top-2.
    return str(cached_checkpoint(str(tmp_path_factory.mktemp("hf")), "qwen3_moe", "gqa_norm_topk"))


def write_profile(fetch_gbps, cpu_gbps, threads=1, gflops=1.0, **extra):
    path = profile_path(device_key("cpu"))
    path.parent.mkdir(parents=True, exist_ok=True)
    profile = {"version": PROFILE_VERSION, "key": device_key("cpu"), "measured_at": "then",
               "cpu_threads": threads, "device": {"kind": "cpu", "name": "test"},
               "host_copy_gbps": {"1": 10.0},
               "experts": {"expert_bytes": 1, "top_k": 2, "pinned": False,
                           "fetch_gbps": fetch_gbps, "cpu_expert_gbps": cpu_gbps,
                           "cpu_expert_gflops": gflops, **extra}}
    path.write_text(json.dumps(profile))
    return path


def test_device_key_and_gpu_lookup_without_a_gpu():
    assert device_key("cpu") == f"cpu-{socket.gethostname()}"
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match="only 0 GPU"):
            find_gpu("0")
        with pytest.raises(ValueError, match="no visible GPU has that UUID"):
            find_gpu("GPU-0123abcd")
        with pytest.raises(SystemExit, match="ft bench bw: --gpu 0: no usable CUDA"):
            bench_main(["bw", "--gpu", "0"])


def test_bench_bw_measures_prints_and_saves_a_profile_the_runtime_reads(capsys, cache_dir):
    code = bench_main(["bw", "--device", "cpu", "--quick", "--hidden", "64", "--width", "32",
                       "--top-k", "2", "--dtype", "float32", "--moe-cpu-threads", "1"])
    out = capsys.readouterr().out
    assert code == 0
    for row in ("host DRAM copy, 1 thread(s)", "expert fetch, 2 x 0.02 MiB", "CPU experts, 1 token x 2",
                "overlapped: expert fetch", "overlapped: CPU experts", "saved "):
        assert row in out, out
    profile = load_profile(device_key("cpu"))
    assert profile is not None and profile["path"].startswith(str(cache_dir))
    e = profile["experts"]
    assert e["expert_bytes"] == 3 * 64 * 32 * 4 and e["top_k"] == 2 and profile["cpu_threads"] == 1
    for k in ("fetch_gbps", "cpu_expert_gbps", "cpu_expert_gflops", "overlap_fetch_gbps",
              "overlap_cpu_expert_gbps"):
        assert e[k] > 0, k
    assert all(v > 0 for v in profile["host_copy_gbps"].values())
    assert "h2d_pinned_gbps" not in profile        # no GPU: nothing to copy to


def test_bench_bw_json_and_no_save(capsys):
    assert bench_main(["bw", "--device", "cpu", "--quick", "--hidden", "32", "--width", "16",
                       "--top-k", "1", "--dtype", "float32", "--json", "--no-save"]) == 0
    profile = json.loads(capsys.readouterr().out)
    assert profile["version"] == PROFILE_VERSION and profile["experts"]["top_k"] == 1
    assert load_profile(device_key("cpu")) is None


def test_bench_bw_takes_the_expert_shape_from_a_checkpoint(capsys, ckpt):
    assert bench_main(["bw", "--device", "cpu", "--quick", "--model", ckpt, "--no-save", "--json"]) == 0
    e = json.loads(capsys.readouterr().out)["experts"]
    cfg = json.loads((__import__("pathlib").Path(ckpt) / "config.json").read_text())
    assert (e["hidden"], e["width"], e["top_k"]) == (cfg["hidden_size"], cfg["moe_intermediate_size"],
                                                     cfg["num_experts_per_tok"])
    with pytest.raises(SystemExit, match="ft bench bw: .*config.json"):
        bench_main(["bw", "--device", "cpu", "--model", str(__import__("pathlib").Path(ckpt).parent)])


def test_expert_costs_prefer_the_overlapped_rates_and_grow_with_rows():
    alone = {"fetch_gbps": 2.0, "cpu_expert_gbps": 1.0, "cpu_expert_gflops": 6.0}
    c = ExpertCosts.of(alone, 10 ** 9, hidden=1000, width=1000)
    assert (c.fetch_s, c.cpu_s, c.cpu_row_s) == (0.5, 1.0, 1e-3)   # 6 * D * I FLOPs a row
    both = {**alone, "overlap_fetch_gbps": 1.0, "overlap_cpu_expert_gbps": 0.5}
    c = ExpertCosts.of(both, 10 ** 9, hidden=1000, width=1000)
    assert (c.fetch_s, c.cpu_s) == (1.0, 2.0)
    assert c.cpu_cost(1) == c.cpu_cost(2000) == 2.0 and c.cpu_cost(4000) == 4.0


def run(ckpt, **kwargs):
    llm = LLM(ckpt, skip_tokenizer_init=True, max_prefill_length=16, **kwargs)
    return llm, [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_auto_shares_misses_with_the_cpu_when_the_profile_says_it_pays(ckpt):
    _, want = run(ckpt)
    path = write_profile(fetch_gbps=1.0, cpu_gbps=1.0)       # a CPU expert costs a fetch
    llm, got = run(ckpt, moe_cache_size=8)
    report = llm.runner.moe_report()
    assert got == want
    assert report["requested"] == "auto" and report["backend"] == "hybrid"
    assert report["hybrid_k"] == 1            # one fetched while the CPU computes the other
    assert "hybrid: fetch" in report["reason"] and str(path) in report["reason"]
    assert str(path) in report["hybrid_k_source"]
    assert {p["mode"] for p in report["counters"]["per_layer"]} == {"hybrid"}
    assert report["counters"]["cpu_experts"] > 0


def test_auto_fetches_every_miss_when_the_cpu_is_slow(ckpt):
    write_profile(fetch_gbps=50.0, cpu_gbps=0.5)
    llm, _ = run(ckpt, moe_cache_size=8)
    report = llm.runner.moe_report()
    assert report["backend"] == "offload" and report["hybrid_k"] is None
    assert "every miss is fetched" in report["reason"] and "profile" in report["reason"]
    assert report["counters"]["cpu_experts"] == 0


def test_explicit_hybrid_reads_k_from_the_profile(ckpt):
    # A CPU expert costs two fetches: fetch both misses (2 fetches, or 1 and a CPU expert).
    write_profile(fetch_gbps=1.0, cpu_gbps=0.5)
    report = run(ckpt, moe_backend="hybrid", moe_cache_size=8)[0].runner.moe_report()
    assert report["hybrid_k"] == 2 and "profile" in report["hybrid_k_source"]
    # A CPU device copies banks straight into the pool: the staging ring's rate (which a
    # CUDA profile has for banks beyond the pin budget) does not apply.
    write_profile(fetch_gbps=1.0, cpu_gbps=0.5, fetch_staged_gbps=0.1)
    report = run(ckpt, moe_backend="hybrid", moe_cache_size=8)[0].runner.moe_report()
    assert report["hybrid_k"] == 2 and "staged" not in report["hybrid_k_source"]


def test_staged_fetches_pay_their_host_copy_before_the_cpu_starts():
    from freetoken.moe.plan import hybrid_fetch_count
    rates = {"fetch_gbps": 1.0, "cpu_expert_gbps": 1.0, "cpu_expert_gflops": 1.0}
    staged = ExpertCosts.of(rates, 10 ** 9, hidden=10, width=10, host_copy_gbps=4.0)
    assert staged.stage_s == 0.5 and "staged: 500.000 ms" in staged.words()
    assert ExpertCosts.of(rates, 10 ** 9, hidden=10, width=10).stage_s == 0.0
    cpu = lambda rows: 1.0      # noqa: E731
    # Pinned: 8 one-row misses split 4/4. Staged, each fetch first costs the engine thread
    # half a CPU expert before the CPU work starts: j = 4 takes max(4, 2 + 4) = 6, j = 5
    # max(5, 2.5 + 3) = 5.5, j = 6 max(6, 3 + 2) = 6.
    assert hybrid_fetch_count([1] * 8, 1.0, cpu) == 4
    assert hybrid_fetch_count([1] * 8, 1.0, cpu, serial_s=0.5) == 5


@pytest.mark.parametrize("bad", ["threads", "corrupt", "old"])
def test_a_profile_that_does_not_apply_is_ignored_and_startup_calibrates(ckpt, bad, caplog):
    path = write_profile(fetch_gbps=1.0, cpu_gbps=1.0, threads=7 if bad == "threads" else 1)
    if bad == "corrupt":
        path.write_text("{not json")
    if bad == "old":
        path.write_text(json.dumps({"version": 0}))
    report = run(ckpt, moe_backend="hybrid", moe_cache_size=8)[0].runner.moe_report()
    source = report["hybrid_k_source"]
    assert "calibrated at startup" in source and 0 <= report["hybrid_k"] <= 2
    if bad == "threads":
        assert "measured with 7 CPU threads, not 1" in source
    else:
        assert "ignoring the bandwidth profile" in caplog.text


def test_hybrid_fetch_count_weighs_each_miss_by_its_rows():
    from freetoken.moe.plan import hybrid_fetch_count, hybrid_k
    const = lambda c: (lambda rows: c)      # noqa: E731 - a CPU cost independent of rows
    assert hybrid_fetch_count([1] * 8, 1.0, const(1.0)) == hybrid_k(8, 1.0, 1.0) == 4
    assert hybrid_fetch_count([1, 1], 1.0, const(3.0)) == 2       # the CPU is slower: fetch both
    assert hybrid_fetch_count([1, 1], 3.0, const(1.0)) == 0       # the CPU takes both, in 2
    assert hybrid_fetch_count([], 1.0, const(1.0)) == 0
    # A prefill chunk: the two busy experts would cost the CPU 10 and 5, so they are fetched.
    assert hybrid_fetch_count([100, 50, 1, 1], 1.0, lambda n: max(0.5, n * 0.1)) == 2


def test_hybrid_leaves_a_prefill_chunks_busy_experts_to_the_fetch(ckpt):
    """Equal fetch and one-token CPU costs split a step's misses in half; when each row costs
    the CPU twice a one-token expert, a prefill chunk's experts (about 4 rows each) are fetched."""
    prompt = [[(7 * i + 3) % 300 for i in range(32)]]
    greedy = SamplingParams(max_tokens=1, temperature=0)
    want = LLM(ckpt, skip_tokenizer_init=True, max_prefill_length=16).generate(prompt, greedy)
    cpu_experts = {}
    for name, gflops in (("rows free", 1e6), ("rows cost", 0.25)):   # fp32: a row costs 2 cpu_s
        write_profile(fetch_gbps=1.0, cpu_gbps=1.0, gflops=gflops)
        llm = LLM(ckpt, skip_tokenizer_init=True, max_prefill_length=16, moe_backend="hybrid",
                  moe_cache_size=8)
        assert llm.generate(prompt, greedy)[0].token_ids == want[0].token_ids
        cpu_experts[name] = llm.runner.moe_report()["counters"]["cpu_experts"]
    assert cpu_experts["rows cost"] * 2 < cpu_experts["rows free"], cpu_experts


def test_bench_bw_measures_the_cpu_experts_the_runtime_runs(capsys):
    # A hybrid layer's CPU experts run from its packed bank (the native kernel's, in place);
    # the profile that sets hybrid's K must time that product, not the torch reference on the
    # raw bank.
    import triton_kernels as tk
    assert bench_main(["bw", "--device", "cpu", "--quick", "--hidden", "256", "--width", "128",
                       "--top-k", "2", "--dtype", "bfloat16", "--json", "--no-save"]) == 0
    e = json.loads(capsys.readouterr().out)["experts"]
    assert e["cpu_packed"] is (tk.native_kernels() is not None or tk.packable(torch.ones(1).bfloat16()))
    assert e["cpu_expert_gbps"] > 0


@pytest.mark.parametrize("claim", ["cpu slower than it is", "cpu faster than it is"])
def test_hybrid_takes_the_cpu_cost_it_measures_while_serving(ckpt, claim):
    # A profile read in other conditions than serving's sets K wrong; the runtime times its
    # CPU calls and, a window of them in, takes the measured cost and K from it. Measured,
    # a CPU expert of this checkpoint takes ~0.1 ms, orders of magnitude off either claim.
    from freetoken.moe.live_costs import LiveCpuCost
    _, want = run(ckpt)
    if claim == "cpu slower than it is":
        write_profile(fetch_gbps=0.001, cpu_gbps=0.0002)    # fetch 25 ms, CPU 123: fetch both
        k_start, k_served = 2, 0                             # CPU ~0.1 ms: compute both
    else:
        write_profile(fetch_gbps=100.0, cpu_gbps=1e4, gflops=1e6)   # CPU 100x cheaper than a fetch
        k_start, k_served = 0, 2                             # CPU ~0.1 ms, fetch 0.25 us
    llm = LLM(ckpt, skip_tokenizer_init=True, max_prefill_length=16, moe_backend="hybrid",
              moe_cache_size=8)
    rt = llm.runner.moe
    assert rt.hybrid_k == k_start and "profile" in rt.hybrid_k_source
    rt.live_cpu = LiveCpuCost(window=4, probe_every=2)      # injected: a short window
    got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    report = llm.runner.moe_report()
    assert got == want
    assert report["hybrid_k"] == k_served, report["hybrid_k_source"]
    assert report["counters"]["cpu_cost_revisions"] >= 1
    assert "measured while serving" in report["hybrid_k_source"]
    # the process's CPU time over the CPU's calls: some, and at most their threads' worth
    c = report["counters"]
    assert c["cpu_expert_calls"] > 0
    assert 0 < c["cpu_expert_process_s"] <= c["cpu_expert_s"] * report["cpu_threads"] * 1.5 + 0.05


def test_a_fixed_hybrid_k_is_never_revised(ckpt):
    from freetoken.moe.live_costs import LiveCpuCost
    write_profile(fetch_gbps=0.001, cpu_gbps=0.0002)
    llm = LLM(ckpt, skip_tokenizer_init=True, max_prefill_length=16, moe_backend="hybrid",
              moe_cache_size=8, moe_hybrid_k=1)
    llm.runner.moe.live_cpu = LiveCpuCost(window=2, probe_every=1)
    llm.generate(PROMPTS, PARAMS)
    report = llm.runner.moe_report()
    assert report["hybrid_k"] == 1 and report["hybrid_k_source"] == "moe_hybrid_k=1"
    assert report["counters"]["cpu_cost_revisions"] == 0


def test_live_cpu_cost_window_ratio_rows_and_probes():
    from freetoken.moe.live_costs import FEW_ROWS, LiveCpuCost
    live = LiveCpuCost(window=3, probe_every=2)
    live.observe(1.0, [FEW_ROWS + 1, 1], 0.5)   # a busy expert: a prefill's call, no sample
    assert live.fresh == 0 and live.revised() is None
    for seconds in (0.012, 0.01, 0.014):        # measured / predicted: 1.2, 1.0, 1.4
        live.observe(seconds, [1, 2], 0.01)
    assert live.revised() is None               # median 1.2: within 1.5x, kept
    for seconds in (0.02, 0.03, 0.01):          # 0.2, 0.3, 0.1 of the prediction
        live.observe(seconds, [1, 2], 0.1)
    assert live.revised() == pytest.approx(0.2) and live.revisions == 1
    assert live.revised() is None and not live.ratios      # measured afresh from here
    # Probes: only after probe_every idle steps, only a miss of a few rows, once.
    assert not live.probe([3, 1])
    live.step()
    live.step()
    assert not live.probe([9, FEW_ROWS + 1]) and not live.probe([])
    assert live.probe([9, 1]) and not live.probe([9, 1])
    live.step()
    live.step()
    live.observe(0.01, [1], 0.01)               # a sample resets the wait as well
    assert not live.probe([1])
