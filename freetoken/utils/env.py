"""Every FREETOKEN_* environment variable, read here and nowhere else, with typed accessors.

Each accessor reads the variable when called, so tests can set them per case.
"""

from __future__ import annotations

import os
from pathlib import Path


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _float(name: str, default: float) -> float:
    raw = _get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None


def _bool(name: str, default: bool) -> bool:
    raw = _get(name)
    if raw is None:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0/1/true/false, got {raw!r}")


def api_key() -> str | None:
    """FREETOKEN_API_KEY: the key clients must send (the --api-key flag wins)."""
    return _get("FREETOKEN_API_KEY")


def cache_dir() -> Path:
    """Where FreeToken keeps the demo model and tuning results: FREETOKEN_CACHE_DIR, else
    $XDG_CACHE_HOME/freetoken, else ~/.cache/freetoken."""
    explicit = _get("FREETOKEN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = _get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "freetoken"


def debug_load_delay_s() -> float:
    """FREETOKEN_DEBUG_LOAD_DELAY_S: sleep this long while loading (to test /health while loading)."""
    return _float("FREETOKEN_DEBUG_LOAD_DELAY_S", 0.0)


def debug_step_delay_s() -> float:
    """FREETOKEN_DEBUG_STEP_DELAY_S: sleep this long in every engine step (to test stalls)."""
    return _float("FREETOKEN_DEBUG_STEP_DELAY_S", 0.0)


def log_level() -> str | None:
    return _get("FREETOKEN_LOG_LEVEL")


def prefetch_model() -> bool:
    """FREETOKEN_PREFETCH_MODEL: advise the kernel to read the checkpoint in at boot (default on)."""
    return _bool("FREETOKEN_PREFETCH_MODEL", True)


def keep_resident_s() -> float:
    """FREETOKEN_KEEP_RESIDENT_S: re-advise the checkpoint every N seconds (default 120; 0 = off)."""
    value = _float("FREETOKEN_KEEP_RESIDENT_S", 120.0)
    if value < 0:
        raise ValueError("FREETOKEN_KEEP_RESIDENT_S must be >= 0")
    return value


def server_url() -> str:
    """FREETOKEN_URL: the server `ft ctl` talks to (default http://127.0.0.1:1919)."""
    return _get("FREETOKEN_URL") or "http://127.0.0.1:1919"


def instrument_prefill() -> bool:
    """FREETOKEN_INSTRUMENT_PREFILL=1: time each prefill forward and report it per request."""
    return _bool("FREETOKEN_INSTRUMENT_PREFILL", False)


def prefill_warmup() -> bool | None:
    """FREETOKEN_PREFILL_WARMUP: 0 skips the warmup ladder, 1 forces it; unset = on for CUDA."""
    raw = _get("FREETOKEN_PREFILL_WARMUP")
    return None if raw is None else _bool("FREETOKEN_PREFILL_WARMUP", True)


def warmup_max_depth() -> int | None:
    """FREETOKEN_WARMUP_MAX_DEPTH: cap the KV depth the warmup walks (tokens)."""
    raw = _get("FREETOKEN_WARMUP_MAX_DEPTH")
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"FREETOKEN_WARMUP_MAX_DEPTH must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError("FREETOKEN_WARMUP_MAX_DEPTH must be positive")
    return value


def debug_script() -> Path | None:
    """FREETOKEN_DEBUG_SCRIPT (tests only): a JSON file {trigger: output text}. A chat request
    whose latest user or tool message contains a trigger gets exactly that output, forced
    token by token through the sampler, so parsers, stop handling and SSE run for real on
    random weights. Never set it in production."""
    raw = _get("FREETOKEN_DEBUG_SCRIPT")
    return Path(raw).expanduser() if raw else None


def pin_budget_gb() -> float | None:
    """FREETOKEN_PIN_BUDGET_GB: host RAM to page-lock for experts (the --pin-budget-gb flag wins)."""
    raw = _get("FREETOKEN_PIN_BUDGET_GB")
    return None if raw is None else _float("FREETOKEN_PIN_BUDGET_GB", 0.0)
