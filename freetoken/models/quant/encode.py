"""The canonical quantized form -> each method's real on-disk layout, and whole checkpoints.

`quantize_checkpoint(model_dir, quant)` rewrites a float checkpoint (tools/make_tiny_model.py's)
in place as the hub's quantized releases store it: every attention and MLP projection
quantized, routers, embeddings, norms and lm_head left in the float dtype and named in the
config's ignore list. QUANTS names what it writes:
    fp8             quant_method fp8, weight + weight_scale_inv per [bn, bk] block (Qwen3-FP8, DeepSeek-V3)
    fp8-tensor      compressed-tensors float-quantized, per-tensor weight_scale
    fp8-channel     compressed-tensors float-quantized, per-channel weight_scale [N, 1]
    fp8-block-ct    compressed-tensors float-quantized, strategy block: weight_scale per [bn, bk]
    fp8-modelopt    ModelOpt FP8 (weight, scalar weight_scale and input_scale; hf_quant_config.json)
    mxfp4           gpt-oss: experts as gate_up_proj_blocks/_scales, down_proj_blocks/_scales
    nvfp4           compressed-tensors nvfp4-pack-quantized (weight_packed, weight_scale, weight_global_scale)
    nvfp4-modelopt  ModelOpt NVFP4 (weight, weight_scale, weight_scale_2; hf_quant_config.json)
    int4            compressed-tensors pack-quantized W4A16, symmetric (int32 weight_packed)
    int4-asym       the same with packed int32 weight_zero_point
    int4-awq        AWQ GEMM: qweight/qzeros int32 in AWQ's nibble order, fp16 scales
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from freetoken.models.quant.convert import AWQ_ORDER
from freetoken.models.quant.quantize import quantize_weight, skew_blocks
from triton_kernels.dequant import QuantFormat

QUANTS = ("fp8", "fp8-tensor", "fp8-channel", "fp8-block-ct", "fp8-modelopt", "mxfp4", "nvfp4", "nvfp4-modelopt", "int4",
          "int4-asym", "int4-awq")
# Linear projections that are quantized; routers (`mlp.gate`, `mlp.router`), the shared
# expert's gate, embeddings and lm_head are not.
_PROJ = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3"
                   r"|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$")   # + MLA's
_GATE_UP = re.compile(r"^(.*\.experts\.\d+)\.(gate_proj|up_proj|w1|w3)\.weight$")
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*mlp\\.router$", "re:.*shared_expert_gate$",
          "re:.*block_sparse_moe\\.gate$"]


def quant_format(quant: str, block=(128, 128), group: int = 32) -> QuantFormat:
    return {"fp8": QuantFormat("fp8_block", block=tuple(block)), "fp8-tensor": QuantFormat("fp8_tensor"),
            "fp8-channel": QuantFormat("fp8_channel"), "mxfp4": QuantFormat("mxfp4"),
            "fp8-block-ct": QuantFormat("fp8_block", block=tuple(block)),
            "fp8-modelopt": QuantFormat("fp8_tensor"),
            "nvfp4": QuantFormat("nvfp4"), "nvfp4-modelopt": QuantFormat("nvfp4"),
            "int4": QuantFormat("int4", group=group, symmetric=True),
            "int4-asym": QuantFormat("int4", group=group, symmetric=False),
            "int4-awq": QuantFormat("int4", group=group, symmetric=False)}[quant]


def pack_int32(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """uint8 values 0..15 -> int32 words of 8 along dim (value 8w+i in bits 4i)."""
    v = v.movedim(dim, -1).to(torch.int64)
    words = (v.reshape(*v.shape[:-1], -1, 8) << torch.arange(0, 32, 4)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def _unpack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return torch.stack([q & 0xF, q >> 4], -1).reshape(*q.shape[:-1], -1)


def encode(quant: str, fmt: QuantFormat, c: dict[str, torch.Tensor], shape) -> dict[str, torch.Tensor]:
    """Canonical {q, s, z, g} of one weight [N, K] -> {checkpoint suffix: tensor}."""
    n, k = shape
    if quant == "fp8":
        return {"weight": c["q"], "weight_scale_inv": c["s"]}
    if quant == "fp8-block-ct":
        return {"weight": c["q"], "weight_scale": c["s"]}
    if quant == "fp8-modelopt":
        return {"weight": c["q"], "weight_scale": c["s"].reshape(()), "input_scale": torch.ones(())}
    if quant in ("fp8-tensor", "fp8-channel"):
        return {"weight": c["q"], "weight_scale": c["s"] if quant == "fp8-tensor" else c["s"][:, None]}
    if quant == "nvfp4":
        return {"weight_packed": c["q"], "weight_scale": c["s"], "weight_global_scale": 1.0 / c["g"],
                "input_global_scale": torch.ones(1)}
    if quant == "nvfp4-modelopt":
        return {"weight": c["q"], "weight_scale": c["s"], "weight_scale_2": c["g"].reshape(()),
                "input_scale": torch.ones(())}
    if quant in ("int4", "int4-asym"):
        out = {"weight_packed": pack_int32(_unpack_nibbles(c["q"])), "weight_scale": c["s"],
               "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
        if "z" in c:
            out["weight_zero_point"] = pack_int32(c["z"], 0)
        return out
    if quant == "int4-awq":
        order = torch.tensor([8 * (j // 8) + AWQ_ORDER[j % 8] for j in range(n)])
        q = _unpack_nibbles(c["q"]).t()[:, order]                       # [K, N], AWQ-ordered
        return {"qweight": pack_int32(q), "qzeros": pack_int32(c["z"].t()[:, order]),
                "scales": c["s"].t().contiguous()}
    raise ValueError(f"no encoder for {quant!r}")


def quant_config(quant: str, fmt: QuantFormat) -> dict:
    """config.json's quantization_config for what encode() writes."""
    if quant == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": list(fmt.block), "modules_to_not_convert": IGNORE[:1]}
    if quant == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    if quant == "nvfp4-modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
    if quant == "fp8-modelopt":
        return {"quant_method": "modelopt", "quant_algo": "FP8",
                "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
    if quant == "int4-awq":
        return {"quant_method": "awq", "bits": 4, "group_size": fmt.group, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    weights = {"fp8-tensor": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
               "fp8-channel": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
               "fp8-block-ct": {"num_bits": 8, "type": "float", "strategy": "block",
                                "block_structure": list(fmt.block), "symmetric": True},
               "nvfp4": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                         "symmetric": True},
               "int4": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": fmt.group,
                        "symmetric": True},
               "int4-asym": {"num_bits": 4, "type": "int", "strategy": "group",
                             "group_size": fmt.group, "symmetric": False}}[quant]
    ct_format = {"nvfp4": "nvfp4-pack-quantized", "int4": "pack-quantized",
                 "int4-asym": "pack-quantized"}.get(quant, "float-quantized")
    return {"quant_method": "compressed-tensors", "format": ct_format, "ignore": IGNORE,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}


def quantize_checkpoint(model_dir, quant: str, block=(128, 128), group: int = 32,
                        skew: float = 2.0, seed: int = 0) -> None:
    """Rewrite the float checkpoint in model_dir in place as `quant` stores it (see QUANTS)."""
    if quant not in QUANTS:
        raise ValueError(f"--quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    model_dir = Path(model_dir)
    fmt = quant_format(quant, block, group)
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    gpt_oss = cfg.get("model_type") == "gpt_oss"
    if (quant == "mxfp4") != gpt_oss:
        raise ValueError("mxfp4 is gpt-oss' layout (and gpt-oss checkpoints are mxfp4): "
                         f"--quant {quant} with model_type {cfg.get('model_type')!r}")
    g = torch.Generator().manual_seed(seed)
    shards = sorted(model_dir.glob("*.safetensors"))
    tensors = {}
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            tensors[path.name] = {k: f.get_tensor(k) for k in f.keys()}
    flat = {k: t for part in tensors.values() for k, t in part.items()}
    skewed = {k: skew_blocks(t.float(), fmt, skew, g) for k, t in sorted(flat.items())
              if _PROJ.search(k) and t.dim() == 2 and not gpt_oss}   # gpt-oss: experts only
    shared_amax = _gate_up_amax(skewed) if fmt.kind == "nvfp4" else {}
    weight_map = {}
    for fname, part in tensors.items():
        out = {}
        for key, t in part.items():
            if key in skewed:
                module = key[:-len(".weight")]
                s_dtype = torch.float16 if quant == "int4-awq" else t.dtype
                c = quantize_weight(fmt, skewed[key], shared_amax.get(key), s_dtype)
                out.update({f"{module}.{sfx}": v for sfx, v in encode(quant, fmt, c, t.shape).items()})
            elif gpt_oss and key.endswith(("experts.gate_up_proj", "experts.down_proj")):
                out.update(_mxfp4_experts(key, t, fmt, skew, g))
            else:
                out[key] = t
        save_file({k: v.contiguous() for k, v in out.items()}, model_dir / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, fname))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        meta["weight_map"] = dict(sorted(weight_map.items()))
        index.write_text(json.dumps(meta, indent=2) + "\n")
    cfg["quantization_config"] = quant_config(quant, fmt)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    if quant in ("nvfp4-modelopt", "fp8-modelopt"):
        (model_dir / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": {
                k: v for k, v in cfg["quantization_config"].items() if k != "quant_method"}}, indent=2) + "\n")


def _gate_up_amax(weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """NVFP4: an expert's gate and up share one global scale (they are one w13 in the bank),
    as ModelOpt's releases do."""
    pairs: dict[str, list[str]] = {}
    for key in weights:
        m = _GATE_UP.match(key)
        if m:
            pairs.setdefault(m[1], []).append(key)
    out = {}
    for keys in pairs.values():
        amax = max(float(weights[k].abs().max()) for k in keys)
        out.update(dict.fromkeys(keys, amax))
    return out


def _mxfp4_experts(key: str, t: torch.Tensor, fmt: QuantFormat, skew: float, g) -> dict:
    """gpt-oss' fused experts [E, D, 2I] (gate/up columns interleaved) or [E, I, D] ->
    `*_blocks` uint8 [E, R, K/32, 16] and `*_scales` uint8 [E, R, K/32], rows R the outputs."""
    qs, ss = [], []
    for e in range(t.shape[0]):
        c = quantize_weight(fmt, skew_blocks(t[e].t().float(), fmt, skew, g))
        qs.append(c["q"].reshape(c["q"].shape[0], -1, 16))
        ss.append(c["s"])
    return {f"{key}_blocks": torch.stack(qs), f"{key}_scales": torch.stack(ss)}
