"""QuantScheme: a checkpoint's quantization method and the format of each of its weights.

Read from config.json's `quantization_config` (quant_method fp8, compressed-tensors, modelopt,
awq, mxfp4) or from ModelOpt's hf_quant_config.json. Which modules are quantized is decided by
the checkpoint itself (a module whose quantized tensors are there); the scheme says in which
format, and which modules it must leave alone (`ignore`, `modules_to_not_convert`,
`exclude_modules`), matched against the checkpoint's own module names.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
from pathlib import Path

from triton_kernels.dequant import QuantFormat

METHODS = ("fp8", "compressed-tensors", "modelopt", "awq", "mxfp4")
CT_FORMATS = ("float-quantized", "naive-quantized", "pack-quantized", "nvfp4-pack-quantized")
# The tensor whose presence beside a module's `weight` says the module is stored quantized.
MARKERS = {"fp8": ("weight_scale_inv",), "compressed-tensors": ("weight_scale", "weight_packed"),
           "modelopt": ("weight_scale",), "awq": ("qweight",),
           "mxfp4": ("gate_up_proj_blocks", "down_proj_blocks")}   # gpt-oss: fused experts


class QuantConfigError(ValueError):
    """quantization_config names a method, scheme or option FreeToken does not load."""


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    method: str                                           # one of METHODS
    groups: tuple[tuple[tuple[str, ...], QuantFormat], ...]   # (targets, format), first match wins
    ignore: tuple[str, ...] = ()
    ct_format: str | None = None                          # compressed-tensors' `format`

    def format_for(self, module: str) -> QuantFormat | None:
        """The format of checkpoint module `module` (its key prefix), None if left unquantized."""
        if any(_matches(module, p) for p in self.ignore):
            return None
        for targets, fmt in self.groups:
            if any(t == "Linear" or _matches(module, t) for t in targets):
                return fmt
        return None

    def describe(self) -> str:
        fmts = sorted({describe_format(f) for _, f in self.groups})
        return f"{self.method}{'/' + self.ct_format if self.ct_format else ''} ({', '.join(fmts)})"


def describe_format(fmt: QuantFormat) -> str:
    if fmt.kind == "fp8_block":
        return f"fp8_block {fmt.block[0]}x{fmt.block[1]}"
    if fmt.kind == "int4":
        return f"int4 g{fmt.group} {'symmetric' if fmt.symmetric else 'asymmetric'}"
    return fmt.kind


def _matches(module: str, pattern: str) -> bool:
    """compressed-tensors' `re:` regexes, ModelOpt/gpt-oss globs, or plain module names, a
    pattern naming a module's parent covering its children (`model.layers.*.self_attn`)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return (module == pattern or module.endswith("." + pattern) or fnmatch.fnmatchcase(module, pattern)
            or fnmatch.fnmatchcase(module, pattern + ".*") or module.startswith(pattern + "."))


def read_quant_scheme(raw: dict, model_dir) -> QuantScheme | None:
    """The checkpoint's scheme, None for an unquantized one; unknown methods are refused."""
    qc = raw.get("quantization_config")
    hf_quant = Path(model_dir) / "hf_quant_config.json" if model_dir is not None else None
    if qc is None and hf_quant is not None and hf_quant.is_file():
        qc = {"quant_method": "modelopt", **json.loads(hf_quant.read_text()).get("quantization", {})}
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8(qc)
    if method == "modelopt":
        return _modelopt(qc)
    if method == "awq":
        return _awq(qc)
    if method == "mxfp4":
        return QuantScheme("mxfp4", ((("Linear",), QuantFormat("mxfp4")),),
                           tuple(qc.get("modules_to_not_convert") or ()))
    raise QuantConfigError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not "
                           f"supported; FreeToken loads {', '.join(METHODS)}")


def _fp8(qc: dict) -> QuantScheme:
    block = qc.get("weight_block_size")
    if not block or len(block) != 2:
        raise QuantConfigError(f"quant_method fp8 needs weight_block_size [bn, bk], got {block!r} "
                               f"(per-tensor FP8 loads as compressed-tensors float-quantized)")
    fmt = QuantFormat("fp8_block", block=(int(block[0]), int(block[1])))
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    return QuantScheme("fp8", ((("Linear",), fmt),), ignore)


def _ct_weights_format(w: dict, fmt_name: str) -> QuantFormat:
    kind, bits, strategy = w.get("type"), int(w.get("num_bits", 0)), w.get("strategy")
    if kind == "float" and bits == 8 and strategy in ("tensor", "channel", "block"):
        if strategy == "block":
            b = w.get("block_structure") or [128, 128]
            return QuantFormat("fp8_block", block=(int(b[0]), int(b[1])))
        return QuantFormat(f"fp8_{strategy}")
    if kind == "float" and bits == 4 and int(w.get("group_size") or 0) == 16:
        return QuantFormat("nvfp4")
    if kind == "int" and bits == 4 and strategy in ("group", "channel") and fmt_name == "pack-quantized":
        group = int(w.get("group_size") or 0)
        if group not in (32, 64, 128):
            raise QuantConfigError(f"compressed-tensors int4 group_size {group} is not supported "
                                   f"(32, 64 or 128)")
        return QuantFormat("int4", group=group, symmetric=bool(w.get("symmetric", True)))
    raise QuantConfigError(
        f"compressed-tensors weights scheme {w!r} (format {fmt_name!r}) is not supported; FreeToken "
        f"loads float 8-bit per tensor/channel/block (float-quantized), float 4-bit group 16 "
        f"(nvfp4-pack-quantized) and int 4-bit group 32/64/128 (pack-quantized W4A16)")


def _compressed_tensors(qc: dict) -> QuantScheme:
    fmt_name = qc.get("format")
    if fmt_name not in CT_FORMATS:
        raise QuantConfigError(f"compressed-tensors format {fmt_name!r} is not supported; FreeToken "
                               f"loads {', '.join(CT_FORMATS)}")
    groups = []
    for name, g in (qc.get("config_groups") or {}).items():
        w = g.get("weights")
        if not w:
            raise QuantConfigError(f"compressed-tensors config group {name!r} quantizes no weights")
        groups.append((tuple(g.get("targets") or ("Linear",)), _ct_weights_format(w, g.get("format") or fmt_name)))
    if not groups:
        raise QuantConfigError("compressed-tensors quantization_config has no config_groups")
    return QuantScheme("compressed-tensors", tuple(groups), tuple(qc.get("ignore") or ()), fmt_name)


def _modelopt(qc: dict) -> QuantScheme:
    algo = str(qc.get("quant_algo", "")).upper()
    ignore = tuple(qc.get("exclude_modules") or qc.get("ignore") or ())
    if algo == "NVFP4":
        if int(qc.get("group_size", 16)) != 16:
            raise QuantConfigError(f"ModelOpt NVFP4 group_size {qc.get('group_size')} (must be 16)")
        return QuantScheme("modelopt", ((("Linear",), QuantFormat("nvfp4")),), ignore)
    if algo == "FP8":
        return QuantScheme("modelopt", ((("Linear",), QuantFormat("fp8_tensor")),), ignore)
    raise QuantConfigError(f"ModelOpt quant_algo {qc.get('quant_algo')!r} is not supported; "
                           f"FreeToken loads NVFP4 and FP8")


def _awq(qc: dict) -> QuantScheme:
    bits, group = int(qc.get("bits", qc.get("w_bit", 4))), int(qc.get("group_size", qc.get("q_group_size", 128)))
    version = str(qc.get("version", "gemm")).lower()
    if bits != 4 or group not in (32, 64, 128) or version != "gemm":
        raise QuantConfigError(f"AWQ bits={bits} group_size={group} version={version!r} is not "
                               f"supported; FreeToken loads 4-bit GEMM-packed AWQ, group 32/64/128")
    fmt = QuantFormat("int4", group=group, symmetric=not qc.get("zero_point", True))
    return QuantScheme("awq", ((("Linear",), fmt),), tuple(qc.get("modules_to_not_convert") or ()))
