"""Turn a meta-built float model into the checkpoint's quantized one, and feed the loader.

`plan_quant(model, scheme, key_map, files)` reads the safetensors headers (names, dtypes and
shapes, no data), finds every module the checkpoint stores quantized, swaps its nn.Linear for
a QuantLinear and its ExpertBank's tensors for a QuantExpertLayout, and returns a QuantModel:
what the loader asks, per checkpoint tensor, for its canonical name and value. This runs after
the model is cast to the compute dtype, so quantized tensors keep their own dtypes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from freetoken.models.layers.linear import QuantLinear
from freetoken.models.layers.moe import ExpertBank
from freetoken.models.quant.convert import SKIP, QuantTensorError, convert
from freetoken.models.quant.scheme import MARKERS, QuantScheme, describe_format
from freetoken.moe.quant_layout import QuantExpertLayout, expert_format, padded_width
from triton_kernels.dequant import QuantFormat

_EXPERT = re.compile(r"^(?P<bank>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")
_MX_LEAF = re.compile(r"^(?P<proj>gate_up_proj|down_proj)_(?P<kind>blocks|scales)$")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class QuantLoadError(ValueError):
    """The checkpoint's quantized tensors do not fit its config or the model."""


@dataclasses.dataclass
class QuantModel:
    scheme: QuantScheme
    linears: dict[str, QuantFormat]                  # our module name -> its format
    banks: dict[str, tuple[QuantFormat, QuantExpertLayout]]   # bank -> (checkpoint's, kept)

    def convert(self, key: str, tensor) -> list[tuple[str, torch.Tensor]] | None:
        """Checkpoint tensor `key` (renamed to our module names; `tensor()` reads it) -> the
        canonical [(key, tensor)] to load, [] to skip, None if no quantized module owns it."""
        module, _, suffix = key.rpartition(".")
        method = self.scheme.method
        fmt = self.linears.get(module)
        if fmt is None:
            m = _EXPERT.match(module)
            if m and m["bank"] in self.banks:
                fmt = self.banks[m["bank"]][0]
            elif module in self.banks and method == "mxfp4" and _MX_LEAF.match(suffix):
                return self._gpt_oss_experts(module, suffix, tensor())
            else:
                return None
        try:
            out = convert(method, fmt, suffix, tensor())
        except QuantTensorError as e:
            raise QuantLoadError(f"tensor {key}: {e}") from None
        if out is None:
            return None
        if out == SKIP:
            return []
        return [(f"{module}.{out[0]}", out[1])]

    def _gpt_oss_experts(self, bank: str, leaf: str, t: torch.Tensor):
        """gpt-oss' fused `*_blocks` [E, R, K/32, 16] / `*_scales` [E, R, K/32]; gate_up's rows
        interleave gate and up (even rows gate), the bank's w13 stacks them."""
        m = _MX_LEAF.match(leaf)
        try:
            name, t = convert("mxfp4", self.banks[bank][0], m["kind"], t)
        except QuantTensorError as e:
            raise QuantLoadError(f"tensor {bank}.{leaf}: {e}") from None
        which = "w13" if m["proj"] == "gate_up_proj" else "w2"
        if which == "w13":
            t = torch.cat([t[:, 0::2], t[:, 1::2]], 1)
        return [(f"{bank}.{ExpertBank.attr(which + '.' + name)}", t.contiguous())]


def read_headers(files: list[Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{key: (safetensors dtype name, shape)} over every shard, without reading data."""
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def plan_quant(model: nn.Module, scheme: QuantScheme, key_map, files: list[Path],
               dtype: torch.dtype) -> QuantModel:
    headers = read_headers(files)
    renamed = {key_map.rename(k): k for k in headers if not key_map.skipped(k)}
    markers = MARKERS[scheme.method]
    stored: dict[str, str] = {}             # our module -> its checkpoint name, if quantized
    for key, source in renamed.items():
        if key.rpartition(".")[2] in markers:
            stored[key.rpartition(".")[0]] = source.rpartition(".")[0]
    modules = dict(model.named_modules())
    linears, banks = {}, {}
    for module, source in sorted(stored.items()):
        fmt = scheme.format_for(source)
        if fmt is None:
            raise QuantLoadError(f"{source} is stored quantized but quantization_config leaves it "
                                 f"unquantized (ignore / modules_to_not_convert)")
        m = _EXPERT.match(module)
        if m and isinstance(modules.get(m["bank"]), ExpertBank):
            banks.setdefault(m["bank"], (fmt, _scale_dtype(headers, renamed, module, scheme)))
        elif isinstance(modules.get(module), ExpertBank):
            banks.setdefault(module, (fmt, torch.float32))
        elif isinstance(modules.get(module), nn.Linear):
            linears[module] = (fmt, _scale_dtype(headers, renamed, module, scheme))
        else:
            raise QuantLoadError(f"{source} is stored quantized, but {type(model).__name__} has "
                                 f"no linear layer or expert bank {module} to hold it")
    for name, (fmt, scale_dtype) in linears.items():
        _swap_linear(model, modules, name, fmt, scale_dtype, dtype)
    kept = {}
    for name, (fmt, scale_dtype) in banks.items():
        bank: ExpertBank = modules[name]
        base = bank.layout
        efmt = expert_format(fmt)
        layout = QuantExpertLayout(base.hidden, padded_width(efmt, base.width), dtype, base.bias,
                                   base.activation, base.alpha, base.limit, fmt=efmt,
                                   scale_dtype=scale_dtype, checkpoint_width=base.width)
        _check_k(name, efmt, layout)
        bank.set_layout(layout)
        kept[name] = (fmt, layout)
    return QuantModel(scheme, {n: f for n, (f, _) in linears.items()}, kept)


def _scale_dtype(headers, renamed, module: str, scheme: QuantScheme) -> torch.dtype:
    """int4 scales stay in the dtype the checkpoint has them in (f16, bf16 or f32)."""
    suffix = "scales" if scheme.method == "awq" else "weight_scale"
    source = renamed.get(f"{module}.{suffix}")
    if source is None:
        return torch.float32
    return _DTYPES.get(headers[source][0], torch.float32)


def _check_k(name: str, fmt: QuantFormat, layout: QuantExpertLayout) -> None:
    step = fmt.group_k if fmt.packed else 1
    for k in (layout.hidden, layout.width):
        if k % step:
            raise QuantLoadError(f"{name}: {fmt.kind} needs input sizes divisible by {step}, "
                                 f"got {k}")


def _swap_linear(model, modules, name, fmt, scale_dtype, dtype) -> None:
    old: nn.Linear = modules[name]
    if fmt.packed and old.in_features % fmt.group_k:
        raise QuantLoadError(f"{name}: {fmt.kind} needs in_features divisible by {fmt.group_k}, "
                             f"got {old.in_features}")
    parent, _, child = name.rpartition(".")
    with torch.device("meta"):
        new = QuantLinear(old.in_features, old.out_features, fmt, old.bias is not None, dtype,
                          scale_dtype)
    setattr(modules[parent] if parent else model, child, new)


def describe_parts(model: nn.Module) -> dict:
    """{"method": .., "parts": {module pattern: format}} over every projection and expert bank
    (layer indices folded into `*`), quantized or not: what /v1/instrumentation reports."""
    parts: dict[str, set[str]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            what = describe_format(mod.fmt)
        elif isinstance(mod, ExpertBank):
            layout = mod.layout
            what = layout.describe() if isinstance(layout, QuantExpertLayout) else str(layout.dtype)[6:]
        elif isinstance(mod, nn.Linear):
            what = str(mod.weight.dtype)[6:]
        else:
            continue
        parts.setdefault(re.sub(r"\.\d+\.", ".*.", name), set()).add(what)
    quant = getattr(model, "quant", None)
    return {"method": quant.scheme.describe() if quant else None,
            "parts": {k: " | ".join(sorted(v)) for k, v in sorted(parts.items())}}
