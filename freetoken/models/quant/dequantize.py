"""A quantized checkpoint -> the same model as a plain float32 checkpoint (the test oracle's
weights: transformers loads the result as it loads any float checkpoint).

Each quantized weight is converted from its on-disk layout (convert.py) and decoded by
triton_kernels.dequant.dequantize_reference, in the checkpoint's own naming and layout (per
expert, gate and up apart; gpt-oss' fused experts re-fused as its float checkpoints store
them), so nothing of the loader's bank placement (stacking, padding, de-interleaving) is
shared with what it checks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from freetoken.models.quant.convert import SKIP, convert
from freetoken.models.quant.scheme import MARKERS, read_quant_scheme
from triton_kernels.dequant import dequantize_reference


def dequantize_checkpoint(src, dst) -> Path:
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    scheme = read_quant_scheme(raw, src)
    if scheme is None:
        raise ValueError(f"{src} is not a quantized checkpoint")
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    quantized = {k.rpartition(".")[0] for k in tensors if k.rpartition(".")[2] in MARKERS[scheme.method]}
    out = {}
    if scheme.method == "mxfp4":              # gpt-oss: {bank}.{proj}_blocks / _scales
        for key in [k for k in tensors if k.endswith("_blocks")]:
            base = key[:-len("_blocks")]
            w = {"q": convert("mxfp4", None, "blocks", tensors.pop(key))[1],
                 "s": tensors.pop(base + "_scales")}
            out[base] = dequantize_reference(scheme.groups[0][1], w).transpose(1, 2).contiguous()
        quantized = set()
    for module in sorted(quantized):
        fmt = scheme.format_for(module)
        w = {}
        for key in [k for k in tensors if k.rpartition(".")[0] == module]:
            r = convert(scheme.method, fmt, key.rpartition(".")[2], tensors.pop(key))
            if r is not None and r != SKIP:
                w[r[0]] = r[1]
        out[f"{module}.weight"] = dequantize_reference(fmt, w)
    out.update({k: t.float() if t.is_floating_point() else t for k, t in tensors.items()})
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "hf_quant_config.json", "model.safetensors.index.json"):
            shutil.copy(path, dst / path.name)
    save_file({k: v.contiguous() for k, v in out.items()}, dst / "model.safetensors",
              metadata={"format": "pt"})
    raw.pop("quantization_config", None)
    raw["torch_dtype"] = raw["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return dst
