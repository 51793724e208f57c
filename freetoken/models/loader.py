"""Find a checkpoint, check it, and load its safetensors into a family's modules.

Checkpoints are read lazily: safetensors files are memory-mapped and each tensor is copied
straight into its parameter, so peak host memory is the model plus one tensor. Before any
weight is read, the bytes the model needs are compared with what the device has free, so a
model larger than memory fails at once with a clear error rather than by thrashing.
Models are built on the meta device first (init_model) so the engine can decide where the
experts go before anything is allocated; materialize() then puts expert banks it is handed
in host memory (the MoE expert store) and everything else on the device.
A quantized checkpoint (freetoken.models.quant) gets its quantized modules swapped in at
init_model, and each of its tensors is converted to the canonical form as it is read.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from freetoken.models.config import ModelConfig, read_config_json
from freetoken.models.key_map import DEFAULT_KEY_MAP, KeyMap
from freetoken.models.layers import ExpertBank, MoeForCausalLM
from freetoken.models.quant.apply import QuantLoadError, plan_quant
from freetoken.models.quant.scheme import QuantConfigError, read_quant_scheme
from freetoken.models.registry import family_for
from freetoken.utils.memory import host_available_bytes

log = logging.getLogger("freetoken.models")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# model.layers.{i}.{mlp|block_sparse_moe}.experts.{e}.{proj}.{weight|bias}
# (quantized experts' canonical tensors: ...{proj}.{q|s|z|g})
_EXPERT_KEY = re.compile(r"^(?P<bank>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.(?P<kind>weight|bias|q|s|z|g)$")


class CheckpointError(RuntimeError):
    """The checkpoint cannot be found, read, or does not fit."""


def resolve_model_path(model: str | os.PathLike) -> Path:
    """A local folder, or a hub id (`org/name`) found in the local Hugging Face cache.

    FreeToken never downloads: an id that is not cached is an error naming it.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    text = str(model)
    if path.exists():
        raise CheckpointError(f"model path {text!r} is a file; give the checkpoint's folder")
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", text):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
        try:
            return Path(snapshot_download(text, local_files_only=True))
        except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
            raise CheckpointError(
                f"model {text!r} is not a local folder and is not in the Hugging Face cache; "
                f"FreeToken does not download. Fetch it first (`hf download {text}`) or pass "
                f"a folder.") from e
    if text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise CheckpointError(f"there is no folder {str(path)!r}")
    raise CheckpointError(f"model {text!r} is neither a folder nor a hub id (org/name)")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors shards, checked for presence against the index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"cannot parse {index}: {e}") from e
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CheckpointError(f"{index.name} lists shards that are absent from {model_dir}: "
                                  f"{', '.join(missing)}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = cfg.torch_dtype if dtype == "auto" else dtype
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[name]


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return host_available_bytes()


def build_model(model_dir: Path, device: torch.device, dtype) -> tuple[MoeForCausalLM, ModelConfig]:
    """Parse config.json, choose the family and allocate its (unloaded) parameters."""
    model, cfg = init_model(model_dir, dtype)
    return materialize(model, device), cfg


def init_model(model_dir: Path, dtype) -> tuple[MoeForCausalLM, ModelConfig]:
    """Parse config.json, choose the family and build its modules on the meta device (shapes
    and dtypes, no memory), so placement can be decided before anything is allocated."""
    raw = read_config_json(model_dir)
    family = family_for(raw)
    cfg = family.parse(raw, model_dir)
    dtype = resolve_dtype(dtype, cfg)
    with torch.device("meta"):
        model = family.MODEL_CLASS(cfg)
    key_map = getattr(family, "KEY_MAP", DEFAULT_KEY_MAP)     # a KeyMap, or cfg -> KeyMap
    model.key_map = key_map if isinstance(key_map, KeyMap) else key_map(cfg)
    model = model.to(dtype)
    model.quant = None
    try:
        scheme = read_quant_scheme(raw, model_dir)
        if scheme is not None:       # after the cast: quantized tensors keep their dtypes
            model.quant = plan_quant(model, scheme, model.key_map, checkpoint_files(model_dir), dtype)
    except (QuantConfigError, QuantLoadError) as e:
        raise CheckpointError(str(e)) from None
    return model, cfg


def materialize(model: MoeForCausalLM, device: torch.device,
                host_banks: dict[ExpertBank, dict[str, torch.Tensor]] | None = None
                ) -> MoeForCausalLM:
    """Allocate a meta-built model's parameters on `device`, except the expert banks named in
    host_banks, which take the given host tensors ({name: [E, ...]}) and never touch the
    device."""
    host_banks = host_banks or {}
    on_host = {id(p) for bank in host_banks for p in bank.bank().values()}
    need = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in on_host)
    have = _available_bytes(device)
    if need > have * 0.95:
        dtype = next(model.parameters()).dtype
        raise CheckpointError(
            f"the model needs {need / 2**30:.2f} GiB of weights in {str(dtype)[6:]} but "
            f"{device} has {have / 2**30:.2f} GiB free")
    if not host_banks:
        model = model.to_empty(device=device)
    else:
        for module in model.modules():
            if module in host_banks:
                for name, tensor in host_banks[module].items():
                    setattr(module, ExpertBank.attr(name), nn.Parameter(tensor, requires_grad=False))
            else:
                module.to_empty(device=device, recurse=False)
    if model.config.tie_word_embeddings:   # to_empty allocates each module's tensors apart
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_weights(model: MoeForCausalLM, files: list[Path],
                 progress: Callable[[int, int], None] | None = None) -> None:
    """Copy every tensor of the checkpoint into its parameter; every parameter must be set."""
    params = dict(model.named_parameters(remove_duplicate=False))
    banks = {name: mod for name, mod in model.named_modules() if isinstance(mod, ExpertBank)}
    key_map = getattr(model, "key_map", DEFAULT_KEY_MAP)
    quant = getattr(model, "quant", None)
    expected = {n for n in params if not (model.config.tie_word_embeddings and n == "lm_head.weight")}
    loaded: set[str] = set()
    unexpected: list[str] = []
    total = sum(f.stat().st_size for f in files)
    done = 0
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for source in f.keys():
                    if key_map.skipped(source):
                        continue
                    key, get = key_map.rename(source), functools.partial(f.get_tensor, source)
                    parts = quant.convert(key, get) if quant is not None else None
                    if parts is None:
                        parts = [(key, get)]
                    for key, tensor in parts:
                        names = _load_one(source, key, tensor, params, banks, key_map, model.config)
                        if names is None:
                            unexpected.append(source)
                        else:
                            loaded.update(names)
        except CheckpointError:
            raise
        except QuantLoadError as e:
            raise CheckpointError(str(e)) from None
        except Exception as e:  # safetensors raises its own error type for corrupt files
            raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e} "
                                  f"(corrupt or truncated safetensors file?)") from e
        done += path.stat().st_size
        if progress:
            progress(done, total)
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} tensors this "
                              f"{type(model).__name__} does not use, e.g. {unexpected[:5]}")
    missing = _missing(expected, loaded, banks)
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
    rescaled = sum(bank.finish_load() for bank in banks.values())
    if rescaled:
        log.warning("NVFP4: %d expert halves had a gate/up global scale unlike their pair's and "
                    "were rescaled into one (rounded to e4m3)", rescaled)


def _load_one(source, key, tensor, params, banks, key_map: KeyMap, cfg) -> list[str] | None:
    """Load checkpoint tensor `source` (renamed to `key`; `tensor` is it, or a callable that
    reads it); the names it set, None if unused."""
    get = tensor if callable(tensor) else (lambda: tensor)
    if key == "lm_head.weight" and cfg.tie_word_embeddings:
        return ["lm_head.weight"]
    m = _EXPERT_KEY.match(key)
    if m and m["bank"] in banks and m["proj"] in ExpertBank.PROJ:
        bank = banks[m["bank"]]
        try:
            part = bank.load_expert(int(m["e"]), m["proj"], get(), m["kind"])
        except ValueError as e:
            raise CheckpointError(f"tensor {source}: {e}") from None
        return [f"{m['bank']}.{part}"]
    head, _, leaf = key.rpartition(".")
    if head in banks:
        if key in params:               # already the bank's layout (quantized gpt-oss experts)
            return [_copy(key, source, get(), params)]
        parts = key_map.fused_experts(leaf, get())
        if parts is None:
            return None
        return [_copy(f"{head}.{name}", source, tensor, params) for name, tensor in parts.items()]
    if key not in params:
        return None
    return [_copy(key, source, get(), params)]


def _copy(name: str, source: str, tensor: torch.Tensor, params) -> str:
    param = params.get(name)
    if param is None:
        raise CheckpointError(f"tensor {source}: the model has no {name}")
    if tuple(tensor.shape) != tuple(param.shape):
        # Only size-1 dimensions may differ (ERNIE's [1, E] selection bias for our [E]).
        if tensor.numel() != param.numel() or tensor.squeeze().shape != param.squeeze().shape:
            raise CheckpointError(f"tensor {source}: checkpoint shape {tuple(tensor.shape)}, "
                                  f"model expects {tuple(param.shape)} (config.json disagrees "
                                  f"with weights)")
        tensor = tensor.reshape(param.shape)
    with torch.no_grad():
        param.copy_(tensor)
    return name


def _missing(expected: set[str], loaded: set[str], banks: dict) -> set[str]:
    missing = set()
    for name in expected:
        bank_name, _, leaf = name.rpartition(".")
        if bank_name in banks and name not in loaded:
            bank = banks[bank_name]
            parts = [".gate", ".up"] if leaf.split("_")[0] in ("w13", "b13") else [""]
            for e in range(bank.num_experts):
                if not all(f"{bank_name}.{leaf}[{e}]{p}" in loaded for p in parts):
                    missing.add(f"{bank_name}.{e} ({leaf})")
        elif name not in loaded:
            missing.add(name)
    return missing


def load_model(model: str | os.PathLike, device="cpu", dtype="auto",
               progress: Callable[[int, int], None] | None = None):
    """Resolve, check and load a checkpoint. Returns (model in eval mode, ModelConfig, folder)."""
    model_dir = resolve_model_path(model)
    device = torch.device(device)
    module, cfg = build_model(model_dir, device, dtype)   # config and family errors first
    files = checkpoint_files(model_dir)
    load_weights(module, files, progress)
    return module.eval().requires_grad_(False), cfg, model_dir
