"""A CPU engine's decode program (freetoken/engine/cpu_graph.py over
triton_kernels/cpu_program.py): the modules' decode step recorded once as native calls and
replayed. It runs the same kernels on the same arguments in the same order, so its oracle
is the modules' own step (enforce_eager) bit for bit: the tokens and their logprobs of
every step, across batches that shrink from above the program's rows (the modules' steps)
to one sequence (the program's)."""

import shutil

import pytest
import torch

import triton_kernels as tk
from freetoken import LLM, SamplingParams
from freetoken.engine.cpu_graph import ROWS
from freetoken.llm import from_flag_text
from freetoken.models.quant.encode import quantize_checkpoint
from tiny_fixtures import tiny_model_dir  # noqa: F401

kernel = tk.native_kernels()
pytestmark = [pytest.mark.skipif(kernel is None, reason="no C compiler: no native kernels"),
              pytest.mark.usefixtures("one_thread")]

SHAPE = dict(hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, num_experts=8,
             top_k=2, moe_intermediate_size=64, max_position_embeddings=512)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 1800, (int(torch.randint(2, 30, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]


def both(path, prompt_ids, params, dtype="bfloat16", **kw):
    """(program engine's outputs, its graph, the modules' outputs)."""
    fast = LLM(path, skip_tokenizer_init=True, dtype=dtype, **kw)
    graph = fast.runner.cpu_graph
    got = fast.generate(prompt_ids, params)
    eager = LLM(path, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, **kw)
    assert eager.runner.cpu_graph is None
    return got, graph, eager.generate(prompt_ids, params)


def assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs            # floats, compared exactly


@pytest.fixture(scope="module")
def quantized(tiny_model_dir, tmp_path_factory):  # noqa: F811
    def make(quant: str):
        out = tmp_path_factory.mktemp(f"graph-{quant}") / "m"
        shutil.copytree(tiny_model_dir("qwen3_moe", seed=4, **SHAPE), out)
        quantize_checkpoint(out, quant, seed=4)
        return str(out)
    return make


@pytest.mark.parametrize("family,dtype", [("qwen3_moe", "bfloat16"), ("mixtral", "bfloat16"),
                                          ("gpt_oss", "bfloat16"), ("qwen3_moe", "float16"),
                                          ("qwen2_moe", "bfloat16"), ("qwen3_next", "bfloat16"),
                                          ("qwen3_5_moe", "float16"), ("glm4_moe", "bfloat16"),
                                          ("ernie4_5_moe", "bfloat16"), ("olmoe", "bfloat16"),
                                          ("minimax_m2", "bfloat16"), ("deepseek_v3", "bfloat16"),
                                          ("glm4_moe_lite", "bfloat16")])
def test_program_steps_give_the_modules_bits(tiny_model_dir, family, dtype):  # noqa: F811
    # gpt-oss: sliding window and sinks on alternate layers, biased projections and
    # experts, swiglu_oai, the router's weights rounded to bf16. qwen2_moe: q/k/v biases,
    # a shared expert scaled by its sigmoid gate. qwen3_next / qwen3_5_moe: Gated DeltaNet
    # layers (their recurrent state in the slots the program copies in), gated attention,
    # shared experts. glm4_moe: a dense first layer, a float32 grouped sigmoid router with a
    # selection bias and scaling, ungated shared experts, q/k/v biases. ernie4_5_moe: a
    # softmax router with a selection bias, interleaved RoPE. olmoe / minimax_m2: q/k norms
    # across heads (olmoe: clipping; minimax_m2: a float32 sigmoid router with a selection
    # bias, partial rotary). deepseek_v3 / glm4_moe_lite: latent attention (q's LoRA pair
    # and its norm, the native decode call over the latent cache), a dense first layer, a
    # grouped router. Nine prompts of 2 to 10 new tokens: the first steps (9 sequences) are
    # the modules', from 7 down the program's.
    path = str(tiny_model_dir(family, seed=3, **SHAPE))
    ids = prompts(9)
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0, logprobs=3)
              for n in range(2, 11)]
    got, graph, want = both(path, ids, params, dtype)
    assert graph is not None
    assert graph.runs >= 8 - 1          # the steps of 7 sequences down to 1
    assert_same(got, want)


@pytest.mark.parametrize("quant", ["fp8", "fp8-channel", "int4"])
def test_quantized_program_steps_give_the_modules_bits(quantized, quant):
    # fp8: the native GEMV and experts on the checkpoint's bytes (channel scales as row
    # scales: q, k and v fuse, every step native; 128-row blocks straddle q and k here, so
    # their fused copy is FBGEMM's, a Python step, where AMX does not take it); int4: its
    # q/k/v and o projections on the native GEMV where it takes bf16 x as int16 (AVX2), else
    # on torch's int4 GEMM as the program's Python steps between native runs.
    ids = prompts(3)
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0, logprobs=2)
    got, graph, want = both(quantized(quant), ids, params)
    assert graph is not None and graph.runs >= 5
    python_steps = any(callable(item) for item in graph.program.items)
    if quant == "int4":
        assert python_steps == (tk.native_kernels().int4_activations != "int16")
    elif quant == "fp8-channel":
        assert not python_steps
    assert_same(got, want)


def test_a_program_step_dispatches_no_torch_op(tiny_model_dir):  # noqa: F811
    # The decode program streams the weights, which evicts the host's code: every torch op
    # between two steps then cost 20-170 us. A step the program takes (chunks into its
    # buffers, the embedding's gather and the logits' widening natively, a greedy argmax in
    # numpy) dispatches none; .numpy()'s view is a detach under a dispatch mode, and
    # nothing else runs.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    llm = LLM(str(tiny_model_dir("qwen3_moe", seed=3, **SHAPE)), skip_tokenizer_init=True,
              dtype="bfloat16")
    engine, graph = llm.engine, llm.runner.cpu_graph
    req = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    engine.step()                                   # the prompt: the modules
    runs = graph.runs
    with Record() as record:
        engine.step()
    assert graph.runs == runs + 1 and len(req.output_token_ids) == 2
    assert set(record.ops) <= {"aten.detach.default"}, record.ops
    # and a token it samples is the modules' (test_program_steps_give_the_modules_bits)


def test_a_program_profiles_its_ops_inside_real_steps(tiny_model_dir):  # noqa: F811
    # CpuProgram.profile: each run adds each item's wall time (the library's ft_run_timed),
    # which bench/cpu_profile.py sums by op kind against the step
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np
    path = str(tiny_model_dir("qwen3_moe", seed=3, **SHAPE))
    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16")
    prog = llm.runner.cpu_graph.program
    prog.profile = np.zeros(len(prog.items))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0))
    assert (prog.profile > 0).all() and prog.labels[0] == "the embedding"
    for wrong in (np.zeros(3), np.zeros(len(prog.items), dtype=np.float32)):
        prog.profile = wrong             # (the library adds doubles into it)
        with pytest.raises(ValueError, match="a profile of"):
            prog.run(1)
    bench = Path(__file__).resolve().parents[1] / "bench" / "cpu_profile.py"
    out = subprocess.run([sys.executable, str(bench), "--model", path, "--tokens", "6",
                          "--prompt", "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "5 decode steps" in lines[0]
    assert any(line.split()[0] == "experts" and line.split()[-1].replace(".", "").isdigit()
               for line in lines[2:])              # (its GB/s: batch 1's routed experts)
    assert any(line.strip().startswith("host") for line in lines)


def test_models_the_calls_do_not_cover_run_the_modules(tiny_model_dir):  # noqa: F811
    # A float32 model has no 16-bit native calls to record: its engine builds no program,
    # says why, and its modules decode
    path = str(tiny_model_dir("qwen3_moe", seed=1, **SHAPE))
    llm = LLM(path, skip_tokenizer_init=True)
    assert llm.runner.cpu_graph is None and "float32" in llm.runner.cpu_graph_off
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].token_ids) == 3
    from freetoken.engine.cpu_graph import CpuDecodeGraph
    graph, why = CpuDecodeGraph.build(llm.runner.model, None, 32)
    assert graph is None and "float32" in why
    # and a layer the calls do not cover names itself: a latent attention layer whose
    # native decode call is not bound
    mla = LLM(str(tiny_model_dir("deepseek_v3", seed=1, **SHAPE)), skip_tokenizer_init=True,
              dtype="bfloat16", enforce_eager=True)
    mla.runner.model.model.layers[1].self_attn.cpu_decode = None
    graph, why = CpuDecodeGraph.build(mla.runner.model, mla.runner.kv, 32)
    assert graph is None and "layer 1's latent attention has no native decode step" in why


def test_enforce_eager_is_a_flag_and_a_keyword(tiny_model_dir):  # noqa: F811
    path = str(tiny_model_dir("qwen3_moe", seed=3, **SHAPE))
    assert LLM(path, skip_tokenizer_init=True, dtype="bfloat16",
               enforce_eager="true").runner.cpu_graph is None
    assert from_flag_text("enforce_eager", "off") is False
    with pytest.raises(ValueError, match="enforce_eager must be true or false"):
        from_flag_text("enforce_eager", "sometimes")
    from freetoken.cli import build_parser
    args = build_parser().parse_args(["serve", path, "--enforce-eager"])
    assert args.enforce_eager is True


def test_int8_lm_head_at_any_row_count_and_in_the_program(tiny_model_dir):  # noqa: F811
    # lm_head_dtype="int8": the head rounded to nearest in steps of its row's max |w| / 127
    # (the scale a row), read from those bytes by the native GEMV for decode rows and from
    # their 16-bit decode by the GEMM from 8 rows: both the same weight, held to float64 on
    # it; the program replays the modules' bits; the logits stay near the 16-bit head's.
    path = str(tiny_model_dir("qwen3_moe", seed=3, **SHAPE))
    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", lm_head_dtype="int8")
    lm_head = llm.runner.model.lm_head
    head = lm_head.packed
    assert head.quant is not None and head.quant.block == (1, 0)
    q, s = head.quant.q, head.quant.s.double()[:, None]
    assert q.dtype == torch.int8 and s.shape == (q.shape[0], 1)
    assert q.abs().amax(1).eq(127).all() and q.ne(-128).all()
    w, deq = lm_head.weight.double(), q.double() * s
    assert ((deq - w).abs() <= s * (0.5 + 2.0 ** -16)).all()   # (w / s: 127 * 2^-24 off)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, q.shape[1], generator=g).bfloat16()
    want = x.double() @ deq.T
    copy_bits = 8 if tk.has_amx_bf16() else 11      # the GEMM's copy of q * s: bf16, fp16
    for rows, got in ((1, torch.cat([head(x[i:i + 1]) for i in range(9)])), (9, head(x))):
        # the output's bf16 rounding; from 8 rows, the copy's rounding of each weight
        bound = want.abs() * 2.0 ** -8 + (x.double().abs() @ deq.abs().T) * (
            2.0 ** -20 if rows == 1 else 2.0 ** (1 - copy_bits))
        assert ((got.double() - want).abs() <= bound).all(), rows
    ids = prompts(4)
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0, logprobs=2)
    got, graph, eager = both(path, ids, params, lm_head_dtype="int8")
    assert graph is not None and graph.runs >= 5
    assert_same(got, eager)
    plain = LLM(path, skip_tokenizer_init=True, dtype="bfloat16")
    a, b = plain.logits(ids[0]), llm.logits(ids[0])
    assert ((a - b).norm(dim=-1) / a.norm(dim=-1)).max() < 0.02
    # errors: another dtype, another device, a float32 model; the flag
    with pytest.raises(ValueError, match="lm_head_dtype must be one of auto, int8"):
        LLM(path, skip_tokenizer_init=True, lm_head_dtype="fp4")
    with pytest.raises(ValueError, match="lm_head_dtype int8 is for the CPU engine"):
        LLM(path, skip_tokenizer_init=True, device="cuda", lm_head_dtype="int8")
    with pytest.raises(ValueError, match="needs a 16-bit model"):
        LLM(path, skip_tokenizer_init=True, dtype="float32", lm_head_dtype="int8")
    from freetoken.cli import build_parser
    assert build_parser().parse_args(["serve", path, "--lm-head-dtype", "int8"]).lm_head_dtype \
        == "int8"


def test_ft_serve_streams_through_the_program_and_reports_it(tiny_model_dir):  # noqa: F811
    # A bf16 `ft serve` streams (openai SDK) what its --enforce-eager twin streams, and
    # /v1/instrumentation says which ran the decode steps.
    import openai

    from serving import ServerProcess
    path = tiny_model_dir("qwen3_moe", seed=5, name="tiny-graph", **SHAPE)
    texts, reports = [], []
    for extra in ((), ("--enforce-eager",), ("--lm-head-dtype", "int8")):
        with ServerProcess(path, "--dtype", "bfloat16", *extra) as server:
            client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
            stream = client.chat.completions.create(
                model="tiny-graph", messages=[{"role": "user", "content": "The sea is"}],
                max_tokens=10, temperature=0, stream=True,
                extra_body={"min_tokens": 10})
            texts.append("".join(c.choices[0].delta.content or "" for c in stream
                                 if c.choices))
            status, body = server.request("GET", "/v1/instrumentation")
            assert status == 200
            reports.append(body["kernels"]["cpu_decode_program"])
    assert texts[0] and texts[0] == texts[1]
    assert reports[0]["enabled"] and reports[0]["rows"] == ROWS and reports[0]["steps"] >= 9
    assert reports[1] == {"enabled": False, "reason": "enforce_eager"}
    assert texts[2] and reports[2]["enabled"] and reports[2]["steps"] >= 9    # an int8 head


# ---- the program itself (cpu_program.py) ----------------------------------------------------

def test_program_runs_its_ops_on_the_first_t_rows_with_the_calls_bits():
    g = torch.Generator().manual_seed(0)
    d, n, rows = 96, 40, 5
    w = (torch.randn(n, d, generator=g) * d ** -0.5).bfloat16()
    bias = torch.randn(n, generator=g)
    norm_w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    lin, norm = kernel.bind_linear(w, bias), kernel.bind_rms_norm(norm_w, 1e-6)
    x, res = torch.randn(rows, d, generator=g).bfloat16(), torch.randn(rows, d).bfloat16()
    normed, out = torch.zeros(rows, d, dtype=torch.bfloat16), torch.zeros(rows, n,
                                                                           dtype=torch.bfloat16)
    res_in = res.clone()
    prog = tk.CpuProgram(kernel, rows)
    prog.add(norm.op(x, res, normed, res), "norm")  # the sum written over the residual
    prog.add(lin.op(normed, out), "linear")
    seen = []
    prog.python(lambda t: seen.append(t), "a Python step")
    for t in (3, 1):
        res.copy_(res_in)
        prog.run(t)
        want_n, want_sum = norm(x[:t], res_in[:t])
        assert torch.equal(normed[:t], want_n) and torch.equal(res[:t], want_sum)
        assert torch.equal(out[:t], lin(want_n))
        assert torch.equal(res[t:], res_in[t:])     # rows past t untouched
    assert seen == [3, 1]
    with pytest.raises(ValueError, match="1 to 5 rows"):
        prog.run(6)
    with pytest.raises(ValueError, match="1 to 5 rows"):
        prog.run(0)
    # an op over fewer rows than the program runs is refused when it is added
    with pytest.raises(ValueError, match="small's buffers hold 4 rows, the program runs up to 5"):
        prog.add(lin.op(normed[:4], out[:4]), "small")


def test_program_ops_refuse_buffers_of_the_wrong_shape_or_dtype():
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    lin = kernel.bind_linear(w)
    with pytest.raises(ValueError, match=r"linear out must be \[4, 8\]"):
        lin.op(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="linear out"):                 # (float32 is taken)
        lin.op(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.half))
    norm = kernel.bind_rms_norm(torch.ones(64, dtype=torch.bfloat16), 1e-6)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="apart from x"):
        norm.op(x, None, x)
    with pytest.raises(ValueError, match="top-k ids"):
        kernel.topk_op(torch.zeros(4, 8), 2, True, torch.zeros(4, 2), torch.zeros(4, 2))


def test_program_attention_refuses_a_table_outside_the_cache():
    heads, bs, nb, rows = (4, 2, 32), 4, 3, 2
    call = kernel.bind_attn(heads, None, None, 1e-6, False, None, None, 32 ** -0.5)
    kc, vc = (torch.zeros(nb, bs, 2, 32, dtype=torch.bfloat16) for _ in range(2))
    qkv = torch.randn(rows, 8 * 32).bfloat16()
    cos_sin = torch.zeros(64, 32)
    pos, slots = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64)
    lens, tables = torch.ones(rows, dtype=torch.int32), torch.zeros(rows, 2, dtype=torch.int32)
    prog = tk.CpuProgram(kernel, rows)
    # (the scratch and output made inline: the op holds them)
    prog.add(call.op(qkv, cos_sin, pos, kc, vc, slots, tables, lens,
                     torch.zeros(rows, 128), torch.zeros(rows, 128, dtype=torch.bfloat16)),
             "layer 7's attention")
    prog.run(2)
    tables[1, 0] = nb                               # a block past the cache
    with pytest.raises(ValueError, match="layer 7's attention: .*outside the cache"):
        prog.run(2)
    prog.run(1)                                     # the first row alone is still in range
