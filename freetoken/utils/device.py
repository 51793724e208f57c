"""Which device this process runs on, named so it can be recognised across restarts.

A GPU is named by its UUID ("GPU-" and 32 hex digits in nvidia-smi's spelling), which stays
the same when CUDA_VISIBLE_DEVICES renumbers the cards; the CPU by the host's name. Bandwidth
profiles (moe/profile.py) are filed under these keys.
"""

from __future__ import annotations

import socket

import torch


def gpu_uuid(index: int) -> str:
    """nvidia-smi's spelling of a visible card's UUID: GPU-xxxxxxxx-xxxx-..."""
    raw = str(getattr(torch.cuda.get_device_properties(index), "uuid", "")).lower()
    return raw if raw.startswith("gpu-") and raw[4:] else f"GPU-{raw}" if raw else f"GPU-index{index}"


def find_gpu(spec: str) -> int:
    """An index or a UUID (with or without the GPU- prefix) -> the visible index; ValueError
    saying what was found when nothing matches."""
    count = torch.cuda.device_count()
    if spec.isdigit():
        if int(spec) >= count:
            raise ValueError(f"only {count} GPU(s) visible")
        return int(spec)
    want = spec.lower().removeprefix("gpu-")
    for i in range(count):
        if gpu_uuid(i).lower().removeprefix("gpu-") == want:
            return i
    raise ValueError(f"no visible GPU has that UUID (visible: "
                     f"{', '.join(gpu_uuid(i) for i in range(count)) or 'none'})")


def device_key(device: torch.device | str) -> str:
    """The name a device's measurements are filed under: its GPU UUID, or cpu-HOSTNAME."""
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_uuid(device.index if device.index is not None else torch.cuda.current_device())
    return f"cpu-{socket.gethostname()}"
