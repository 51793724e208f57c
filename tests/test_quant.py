"""Quantized checkpoints (issue #19), kept quantized from disk to the kernel.

Each format's tiny checkpoint is written in its real on-disk layout (freetoken.models.quant:
tools/make_tiny_model.py --quant) with scales skewed between neighbouring blocks; the oracle
is transformers in float32 on the same weights dequantized by our torch reference and written
as a plain float checkpoint. On every MoE backend: max relative logit error < 1e-3, greedy
tokens identical, and the bytes the cache fetched are the quantized bytes. Also: the on-disk
packings against hand-built words, transformers' own MXFP4 dequantizer as a cross-check, and
the refusals (unknown methods and schemes, scales of the wrong shape).
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from freetoken import LLM, SamplingParams
from freetoken.demo.tiny_model import make_tiny_model
from freetoken.models.loader import CheckpointError
from freetoken.models.quant.convert import SKIP, convert
from freetoken.models.quant.dequantize import dequantize_checkpoint
from freetoken.models.quant.encode import encode, pack_int32, quant_format, quantize_checkpoint
from freetoken.models.quant.quantize import quantize_weight, skew_blocks
from freetoken.models.quant.scheme import read_quant_scheme
from triton_kernels.dequant import dequantize_reference

BLOCK = (16, 32)                      # fp8 block: ragged against I = 24 and the 40-row weights
PROMPT = [5, 17, 99, 3, 200, 7, 8, 45, 11, 250, 31, 64, 2]
PARAMS = SamplingParams(max_tokens=12, min_tokens=12, temperature=0)
METHOD = {"fp8": "fp8", "fp8-tensor": "compressed-tensors", "fp8-channel": "compressed-tensors",
          "fp8-block-ct": "compressed-tensors", "fp8-modelopt": "modelopt",
          "nvfp4": "compressed-tensors", "nvfp4-modelopt": "modelopt", "int4": "compressed-tensors",
          "int4-asym": "compressed-tensors", "int4-awq": "awq"}
# (quant, family): every on-disk layout FreeToken reads, gpt-oss' MXFP4 on gpt_oss.
CASES = [("fp8", "qwen3_moe"), ("fp8-tensor", "qwen3_moe"), ("fp8-block-ct", "qwen3_moe"),
         ("fp8-modelopt", "qwen3_moe"), ("nvfp4", "qwen3_moe"),
         ("nvfp4-modelopt", "qwen3_moe"), ("int4", "qwen3_moe"), ("int4-awq", "qwen3_moe"),
         ("mxfp4", "gpt_oss")]
BACKENDS = [("offload-min", dict(moe_backend="offload", moe_cache_size="min")),
            ("cpu", dict(moe_backend="cpu")),
            ("hybrid-k1", dict(moe_backend="hybrid", moe_cache_size="min", moe_hybrid_k=1)),
            ("hybrid-measured-k", dict(moe_backend="hybrid", moe_cache_size="min")),
            ("offload-cpu-layers", dict(moe_backend="offload", moe_cache_size="min",
                                        moe_cpu_layers=1))]


pytestmark = pytest.mark.usefixtures("one_thread", "no_saved_profiles")


def tiny(out, family, quant, seed=0, **shape):
    """A quantized tiny checkpoint: qwen3 with a dense layer between two MoE layers."""
    kw = dict(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, num_experts=8, top_k=2,
              moe_intermediate_size=24 if quant == "fp8" else 32, intermediate_size=96,
              vocab_size=2048, max_position_embeddings=512)
    if family == "qwen3_moe":
        kw["mlp_only_layers"] = (1,)
    kw.update(shape)
    make_tiny_model(out, family=family, seed=seed, **kw)
    quantize_checkpoint(out, quant, block=BLOCK, seed=seed)
    return out


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def token_err(a, b):
    """rel_err of each row (token) of [T, V] logits."""
    return (a - b).abs().amax(-1) / b.abs().amax(-1)


def expected_expert_bytes(quant, d, i):
    """One expert's bytes, counted from the format (not from the layout under test)."""
    if quant in ("fp8", "fp8-block-ct"):
        ip = 32                                     # fp8: I = 24 padded to lcm(16, 32)
        bn, bk = BLOCK
        scales = 2 * ip // bn * math.ceil(d / bk) + math.ceil(d / bn) * ip // bk
        return 3 * ip * d + 4 * scales
    n = 3 * i * d                                   # weights of w13 [2I, D] and w2 [D, I]
    return {"fp8-tensor": n + 4 * (2 * i + d),      # kept per channel: a scale per row
            "fp8-modelopt": n + 4 * (2 * i + d),
            "mxfp4": n // 2 + n // 32 + 4 * (2 * i + d),   # + float32 biases
            "nvfp4": n // 2 + n // 16 + 2 * 4, "nvfp4-modelopt": n // 2 + n // 16 + 2 * 4,
            "int4": n // 2 + 4 * n // 32, "int4-awq": n // 2 + 2 * n // 32 + n // 32}[quant]


@pytest.mark.parametrize("quant,family", CASES, ids=[q for q, _ in CASES])
def test_matches_dequantized_oracle_on_every_backend(tmp_path, quant, family):
    from transformers import AutoModelForCausalLM
    path = str(tiny(tmp_path / "q", family, quant))
    oracle = dequantize_checkpoint(path, tmp_path / "deq")
    hf = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        want_logits = hf(torch.tensor([PROMPT])).logits[0]
    want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12,
                       do_sample=False)[0, len(PROMPT):].tolist()

    ref = LLM(path, skip_tokenizer_init=True, max_prefill_length=16)
    model = ref.runner.model
    blocks = model.moe_blocks()
    bank = next(iter(blocks.values())).experts
    assert {t.dtype for n, t in bank.bank().items() if n.endswith(".q")} <= {
        torch.uint8, torch.float8_e4m3fn}
    mc = ref.model_config
    expert_bytes = expected_expert_bytes(quant, mc.hidden_size, mc.moe_intermediate_size)
    assert bank.layout.expert_bytes == expert_bytes
    parts = ref.runner.quant_report()["parts"]
    assert parts["lm_head"] == "float32"
    if family == "qwen3_moe":     # attention and the dense MLP quantized too
        assert parts["model.layers.*.self_attn.q_proj"] != "float32"
        assert parts["model.layers.*.mlp.down_proj"] != "float32"
        assert type(model.model.layers[1].mlp.down_proj).__name__ == "QuantLinear"

    runs = [("resident", ref)] + [
        (name, LLM(path, skip_tokenizer_init=True, max_prefill_length=16,
                   **{k: mc.num_experts if v == "min" else v for k, v in kw.items()}))
        for name, kw in BACKENDS]
    for name, llm in runs:
        err = rel_err(llm.logits(PROMPT), want_logits)
        assert err < 1e-3, f"{quant} {name}: relative logit error {err:.2e}"
        assert llm.generate([PROMPT], PARAMS)[0].token_ids == want, f"{quant} {name}"
        counters = llm.runner.moe_report()["counters"]
        if name.startswith("offload"):
            assert counters["experts_fetched"] > 0
        if name == "offload-min":           # one layer's worth of slots for two layers
            assert counters["evictions"] > 0
        if name in ("cpu", "hybrid-k1", "offload-cpu-layers"):
            assert counters["cpu_experts"] > 0
        if counters is not None:
            assert counters["bytes_fetched"] == counters["experts_fetched"] * expert_bytes


def test_transformers_mxfp4_dequantizer_agrees_with_the_reference(tmp_path):
    """transformers' Mxfp4Config(dequantize=True) reads gpt-oss' blocks as the format says: a
    cross-check of our reference and of the oracle built from it."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    path = tiny(tmp_path / "q", "gpt_oss", "mxfp4", seed=3, num_layers=2)
    oracle = dequantize_checkpoint(path, tmp_path / "deq")
    theirs = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    with torch.no_grad():
        a, b = theirs(torch.tensor([PROMPT])).logits, ours(torch.tensor([PROMPT])).logits
    assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("quant", list(METHOD))
def test_on_disk_layouts_round_trip(quant):
    """quantize -> the method's tensors -> convert back: the canonical tensors exactly, and the
    weight they decode to close to the (skewed) float one; scales really vary by block."""
    fmt = quant_format(quant, BLOCK, 32)
    g = torch.Generator().manual_seed(7)
    w = skew_blocks(torch.randn(40, 64, generator=g), fmt, 2.0, g)
    c = quantize_weight(fmt, w)
    disk = encode(quant, fmt, c, w.shape)
    back = {}
    for suffix, t in disk.items():
        r = convert(METHOD[quant], fmt, suffix, t)
        assert r is not None, suffix
        if r != SKIP:
            back[r[0]] = r[1]
    assert sorted(back) == sorted(c)
    for name in c:
        if name == "g":              # compressed-tensors stores 1/g
            torch.testing.assert_close(back[name], c[name], rtol=1e-6, atol=0)
        else:
            assert torch.equal(back[name].view(torch.uint8) if back[name].dtype.itemsize == 1
                               else back[name], c[name].view(torch.uint8)
                               if c[name].dtype.itemsize == 1 else c[name]), name
    deq = dequantize_reference(fmt, back)
    tol = 0.04 if quant.startswith("fp8") else 0.2
    assert ((deq - w).norm() / w.norm()).item() < tol
    if quant not in ("fp8-tensor", "fp8-channel", "fp8-modelopt"):     # one scale per tensor/row
        s = c["s"].float() if c["s"].dtype != torch.uint8 else torch.exp2(c["s"].float() - 127)
        assert (s.max() / s.min()).item() > 4


def test_packings_against_hand_built_words():
    """compressed-tensors: value of column 8w+i in bits 4i of word w; AWQ: nibble i holds
    column AWQ_ORDER[i] = 0, 2, 4, 6, 1, 3, 5, 7; both back to canonical nibble pairs."""
    cols = torch.arange(8, dtype=torch.uint8)[None]             # [1, 8] values 0..7
    assert pack_int32(cols).item() == 0x76543210
    fmt = quant_format("int4-awq", group=32)
    # W [N=8, K=32]: every element 0 but output row 3, all 7.
    c = {"q": torch.zeros(8, 16, dtype=torch.uint8), "s": torch.ones(8, 1, dtype=torch.float16),
         "z": torch.zeros(8, 1, dtype=torch.uint8)}
    c["q"][3] = 0x77
    disk = encode("int4-awq", fmt, c, (8, 32))
    # qweight [K=32, N/8=1]: column 3 (output 3) sits in nibble AWQ_ORDER.index(3) = 5.
    word = disk["qweight"][0, 0].item() & 0xFFFFFFFF
    assert (word >> 20) & 0xF == 7 and all((word >> 4 * i) & 0xF == 0 for i in range(8) if i != 5)
    assert torch.equal(convert("awq", fmt, "qweight", disk["qweight"])[1], c["q"])
    packed = torch.tensor([[0x76543210]], dtype=torch.int32)
    q = convert("compressed-tensors", quant_format("int4", group=32), "weight_packed", packed)[1]
    assert q.tolist() == [[0x10, 0x32, 0x54, 0x76]]


def _config(path):
    return json.loads((path / "config.json").read_text())


def test_unknown_methods_and_schemes_are_refused_naming_the_supported(tmp_path):
    path = tmp_path / "q"
    make_tiny_model(path, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                    moe_intermediate_size=32, vocab_size=2048)
    cfg = _config(path)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'bitsandbytes' is not supported; FreeToken loads "
                                              "fp8, compressed-tensors, modelopt, awq, mxfp4"):
        LLM(str(path), skip_tokenizer_init=True)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                      "num_bits": 8, "type": "int", "strategy": "channel"}}}}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="is not supported; FreeToken loads float 8-bit"):
        LLM(str(path), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="needs weight_block_size"):
        read_quant_scheme({"quantization_config": {"quant_method": "fp8"}}, None)


@pytest.mark.parametrize("key,want", [
    ("model.layers.0.self_attn.q_proj.weight_scale_inv", r"\(4, 2\)"),
    ("model.layers.0.mlp.experts.3.up_proj.weight_scale_inv", r"\(2, 2\)")])
def test_a_scale_of_the_wrong_shape_names_the_tensor_and_both_shapes(tmp_path, key, want):
    path = tiny(tmp_path / "q", "qwen3_moe", "fp8", num_layers=1, mlp_only_layers=())
    f = path / "model.safetensors"
    tensors = load_file(f)
    tensors[key] = torch.ones(3, 5)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{key}.*\(3, 5\).*{want}"):
        LLM(str(path), skip_tokenizer_init=True)


def _tool():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "make_tiny_model_tool", Path(__file__).resolve().parents[1] / "tools" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_make_tiny_model_writes_a_sharded_quantized_checkpoint_that_serves(tmp_path, capsys):
    tool = _tool()
    out = tmp_path / "tiny"
    assert tool.main(["--out", str(out), "--quant", "int4-asym", "--num-layers", "2",
                      "--hidden-size", "64", "--max-shard-mb", "0.3"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and "model.layers.0.self_attn.q_proj.weight_zero_point" in index
    assert "model.layers.0.self_attn.q_proj.weight" not in index
    llm = LLM(str(out), skip_tokenizer_init=True, moe_backend="cpu")
    assert llm.runner.quant_report()["method"] == "compressed-tensors/pack-quantized (int4 g32 asymmetric)"
    assert len(llm.generate([PROMPT], PARAMS)[0].token_ids) == 12
    assert tool.main(["--out", str(tmp_path / "x"), "--quant", "mxfp4"]) == 2
    assert "mxfp4 is gpt-oss' layout" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_nvfp4_gate_and_up_with_different_global_scales(tmp_path, caplog):
    """w13 has one global scale per expert: a checkpoint whose gate and up differ keeps the
    larger and rescales the other half's block scales (by 1/2 here: exact in e4m3)."""
    from transformers import AutoModelForCausalLM
    path = tiny(tmp_path / "q", "qwen3_moe", "nvfp4", num_layers=1, mlp_only_layers=())
    f = path / "model.safetensors"
    tensors = load_file(f)
    key = "model.layers.0.mlp.experts.5.up_proj.weight_global_scale"
    tensors[key] = tensors[key] * 2                 # the divisor: up's multiplier halves
    save_file(tensors, f, metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(dequantize_checkpoint(path, tmp_path / "deq"),
                                              dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    with caplog.at_level("WARNING", logger="freetoken.models"):
        llm = LLM(str(path), skip_tokenizer_init=True)
    assert "1 expert halves had a gate/up global scale unlike" in caplog.text
    bank = llm.runner.model.moe_blocks()[0].experts
    gate_g = 1.0 / tensors["model.layers.0.mlp.experts.5.gate_proj.weight_global_scale"]
    assert bank.w13_g[5].item() == pytest.approx(gate_g.item(), rel=1e-6)
    assert rel_err(llm.logits(PROMPT), want) < 1e-3


def test_deepseek_v3_fp8_matches_its_dequantized_oracle(tmp_path):
    """DeepSeek-V3 ships only in FP8: every MLA projection block-quantized, kv_b_proj included,
    which both attention forms need as a matrix (decoded once); ragged blocks (576-wide latent
    projections in the real model, 40 here against 16x32 blocks)."""
    from transformers import AutoModelForCausalLM
    path = str(tiny(tmp_path / "q", "deepseek_v3", "fp8", num_kv_heads=4))
    oracle = dequantize_checkpoint(path, tmp_path / "deq")
    hf = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        want_logits = hf(torch.tensor([PROMPT])).logits[0]
    want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, min_new_tokens=12,
                       do_sample=False)[0, len(PROMPT):].tolist()
    for kw in ({}, dict(moe_backend="offload", moe_cache_size="2")):
        llm = LLM(path, skip_tokenizer_init=True, max_prefill_length=8, **kw)
        attn = llm.runner.model.model.layers[1].self_attn
        assert type(attn.kv_b_proj).__name__ == "QuantLinear"
        assert type(attn.kv_a_proj_with_mqa).__name__ == "QuantLinear"
        err = rel_err(llm.logits(PROMPT), want_logits)
        assert err < 1e-3, f"{kw}: relative logit error {err:.2e}"
        assert llm.generate([PROMPT], PARAMS)[0].token_ids == want, kw


def test_quant_linear_packs_its_decoded_weight_for_the_cpu():
    """A bf16 CPU engine's fp8 / mxfp4 / nvfp4 projection keeps its weight decoded once
    (cpu_linear: bf16 for the native GEMV and AMX's GEMM where this machine has both, else
    fp16 for the fp16-weight GEMM; no decode per call): x @ W^T + b to that rounding of W at
    one row and many; a float32 model stays unpacked, and a weight beyond fp16's range too
    where the copy is fp16."""
    import triton_kernels as tk
    from freetoken.models.layers.linear import QuantLinear
    from test_kernels_dequant import FORMATS, random_weight
    torch.manual_seed(11)
    bf16_copy = tk.native_kernels() is not None and tk.has_amx_bf16()
    for kind in ("fp8_block", "fp8_channel", "mxfp4", "nvfp4"):
        fmt = FORMATS[kind]
        w = random_weight(fmt, (), 48, 64)
        lin = QuantLinear(64, 48, fmt, bias=True, dtype=torch.bfloat16,
                          scale_dtype=w["s"].dtype)
        for name, t in w.items():
            getattr(lin, name).data = t.reshape(getattr(lin, name).shape) if t.dim() else t
        lin.bias.data = torch.randn(48).bfloat16()
        assert lin.pack_cpu() == 48 * 64 * 2 and isinstance(lin.packed, tk.CpuLinear), kind
        # bf16 keeps 8 bits of a weight, fp16 11
        weight_bits = 8 if bf16_copy else 11
        deq = dequantize_reference(fmt, w, torch.float32).double()
        for rows in (1, 7):
            x = torch.randn(2, rows, 64).bfloat16()
            got = lin(x)
            want = x.double() @ deq.T + lin.bias.double()
            # the copy's rounding of each weight and the output's (bf16, 2^-8)
            bound = ((x.double().abs() @ deq.abs().T) * 2.0 ** (1 - weight_bits)
                     + want.abs() * 2.0 ** -8)
            assert got.shape == (2, rows, 48) and got.dtype == torch.bfloat16
            assert ((got.double() - want).abs() <= bound + 1e-6).all(), f"{kind} {rows}"
    big = QuantLinear(64, 48, FORMATS["fp8_channel"], bias=False, dtype=torch.bfloat16)
    big.q.data = torch.full((48, 64), 448.0).to(torch.float8_e4m3fn)
    big.s.data = torch.full((48,), 1000.0)
    if bf16_copy:
        assert big.pack_cpu() == 48 * 64 * 2 and big.packed.weight.dtype == torch.bfloat16
    else:
        assert big.pack_cpu() == 0 and big.packed is None         # 448000 > 65504
    f32 = QuantLinear(64, 48, FORMATS["fp8_channel"], bias=False, dtype=torch.float32)
    assert f32.pack_cpu() == 0 and f32.packed is None


@pytest.mark.parametrize("quant", ["fp8", "fp8-tensor", "fp8-channel", "nvfp4"])
def test_bf16_cpu_engine_packs_quantized_projections(tmp_path, quant):
    # The runner packs every quantized projection of a bf16 CPU model (attention and the
    # dense MLP here; q, k and v decoded into one product a layer); the logits stay as near
    # the float32 engine's (the reference's exact decode) as bf16 allows.
    import triton_kernels as tk
    from freetoken.models.layers.attention import Attention
    from freetoken.models.layers.linear import QuantLinear
    from freetoken.models.layers.mlp import DenseMLP
    path = str(tiny(tmp_path / "q", "qwen3_moe", quant))
    want = LLM(path, skip_tokenizer_init=True, dtype="float32").logits(PROMPT)
    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16")
    modules = list(llm.runner.model.modules())
    attns = [m for m in modules if isinstance(m, Attention)]
    assert attns and all(isinstance(a.qkv_packed, tk.CpuLinear) for a in attns)
    mlps = [m for m in modules if isinstance(m, DenseMLP)]      # gate and up as one product
    assert mlps and all(isinstance(m.gate_up, tk.CpuLinear) for m in mlps)
    fused = {id(getattr(m, n)) for m in attns + mlps for n in m.cpu_fused}
    qlin = [m for m in modules if isinstance(m, QuantLinear) and id(m) not in fused]
    assert len(qlin) >= 4 and all(isinstance(m.packed, tk.CpuLinear) for m in qlin)
    # fp8 keeps its bytes for the decode rows' GEMV (block scales, or a tensor's or a
    # channel's as row scales, block (1, 0); q, k and v's concatenated where their row blocks
    # line up: BLOCK's 16 rows do, and row scales always)
    fp8 = quant.startswith("fp8") and tk.native_kernels() is not None
    assert all((m.packed.quant is not None) == fp8 for m in qlin)
    assert all((a.qkv_packed.quant is not None) == fp8 for a in attns)
    if fp8 and quant != "fp8":
        assert all(m.packed.quant.block == (1, 0) for m in qlin)
    # Row by row (the native GEMV, from the fp8 bytes where kept) against 8 rows at once
    # (the GEMM on the 16-bit copy): the same weight, to bf16's rounding of its copy.
    g = torch.Generator().manual_seed(0)
    for packed in [m.packed for m in qlin] + [a.qkv_packed for a in attns]:
        x = torch.randn(8, packed.in_features, generator=g).bfloat16()
        one = torch.cat([packed(x[i:i + 1]) for i in range(8)]).float()
        many = packed(x).float()
        assert ((one - many).norm() / many.norm()).item() < 1e-2
    got = llm.logits(PROMPT)
    # Per token: bf16 router logits tie now and then, and which tied expert a token takes
    # (torch.topk's order, or the native router's lower id) moves that token's logits by a
    # few percent either way, now and then more (fp8-tensor's token 11 takes experts 1, 2
    # where float32 takes 2, 4: float32's logits 2.730 and 2.698 for 4 and 1, bf16's ~0.05
    # apart from them either way, its step there 0.016; 0.23 off): all but one token within
    # 0.15, the median token as near as bf16 allows.
    errs = token_err(got.float(), want)
    assert errs.median() < 0.05 and errs.sort().values[-2] < 0.15, \
        f"{quant}: relative logit errors {errs}"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("quant,family", [("fp8", "qwen3_moe"), ("fp8-tensor", "qwen3_moe"),
                                          ("fp8-channel", "qwen3_moe"), ("nvfp4", "qwen3_moe"),
                                          ("mxfp4", "gpt_oss")])
def test_bf16_cpu_engine_decodes_quantized_experts_where_ram_allows(tmp_path, monkeypatch,
                                                                    quant, family):
    # Experts only the CPU computes, in a format torch's CPU has no GEMM for, are decoded
    # once into 16-bit banks (the native kernel's, or fp16-packed without one) when host RAM
    # holds 2 bytes a weight (resident, and the store's CPU layers); without the room they
    # keep the tile decode. Both stay as near the float32 engine as bf16 allows, the decoded
    # one (float16's 11 bits; bf16's, the tile decode's own, on an AMX CPU) no farther.
    import freetoken.engine.model_runner as mr
    import triton_kernels as tk
    path = str(tiny(tmp_path / "q", family, quant))
    want = LLM(path, skip_tokenizer_init=True, dtype="float32").logits(PROMPT)
    errs = {}
    for room, kw in ((64 << 30, {}), (64 << 30, dict(moe_backend="cpu")), (0, {})):
        monkeypatch.setattr(mr, "host_available_bytes", lambda room=room: room)
        llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", **kw)
        banks = [b.experts.bank() for b in llm.runner.model.moe_blocks().values()]
        cpu_bank = tk.NativeBank if tk.native_kernels() else tk.Fp16Bank
        # fp8 (blocks, or per tensor kept as channel scales) runs from its bytes on the
        # native kernel, room or not, with a bf16 copy for prefill chunks where there is room
        # and AMX; the others are decoded with the room, else keep the tile decode.
        from_bytes = quant.startswith("fp8") and tk.native_kernels() is not None
        copy = from_bytes and bool(room) and tk.has_amx_bf16()
        assert banks
        for b in banks:
            for w in (b.get("w13"), b.get("w2")):
                assert isinstance(w, tk.NativeFp8Bank) == from_bytes
                if from_bytes:
                    assert isinstance(w.prefill, tk.NativeBank) == copy
                else:
                    assert isinstance(w, cpu_bank) == bool(room)
        if kw:
            store = llm.runner.expert_store
            assert all(store.bank(i) is b for i, b in zip(store.layers, banks))
            host = llm.runner.moe_report()["host"]     # decoded layers at their 16-bit bytes
            packed = sum(b[w].nbytes for b in banks for w in ("w13", "w2"))
            assert host["repacked_layers"] == list(store.layers)
            assert host["resident_bytes"] == packed
            # decoded or copied: more than the checkpoint's bytes; from the bytes alone, those
            assert (packed > host["expert_bytes"]) == (copy or (bool(room) and not from_bytes))
        if room and family == "qwen3_moe" and cpu_bank is tk.Fp16Bank:
            assert banks[0]["w13"].split is llm.runner.cpu_split
        got = llm.logits(PROMPT)
        # Per token, the median: bf16 may flip a near-tie of the routing on one token (layer
        # 2's 2nd/3rd expert are 0.03 apart on token 11 here), which moves that token's
        # logits by ~20% whichever 16-bit product ran.
        per_token = token_err(got.float(), want)
        errs[(room, bool(kw))] = err = per_token.median().item()
        assert per_token.max() < 0.4, per_token        # one flipped route at most that far
        # (tiny gpt_oss is this far from float32 in bf16 anyway: transformers' own bf16 0.22)
        bound = 0.05 if family == "qwen3_moe" else 0.35
        assert err < bound, f"{quant} {kw}: relative logit error {err:.2e} against float32"
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
    assert errs[(64 << 30, False)] <= 1.5 * errs[(0, False)] + 1e-3, errs


def test_bf16_cpu_engine_leaves_mla_kv_b_proj_unpacked(tmp_path):
    # MLA reads kv_b_proj only as a matrix (decoded once); a packed copy would be dead bytes
    # (~2 GB over DeepSeek-V3's layers). The other projections are packed.
    import triton_kernels as tk
    from freetoken.models.layers.linear import QuantLinear
    path = str(tiny(tmp_path / "q", "deepseek_v3", "fp8", num_kv_heads=4))
    want = LLM(path, skip_tokenizer_init=True, dtype="float32").logits(PROMPT)
    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16")
    attn = llm.runner.model.model.layers[1].self_attn
    assert isinstance(attn.kv_b_proj, QuantLinear) and attn.kv_b_proj.packed is None
    assert isinstance(attn.kv_a_proj_with_mqa.packed, tk.CpuLinear)
    got = llm.logits(PROMPT)             # bf16 against float32: 4-6% packed or not
    assert rel_err(got.float(), want) < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
