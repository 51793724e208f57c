"""The built-in demo model: what `ft serve` serves when no model is named.

Made on first use by the same code as tools/make_tiny_model.py and cached under the user's
cache folder, so a newcomer's first command needs no download. The folder name carries a
version: a change to the maker gets a fresh folder rather than a stale model.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from freetoken.utils import env

DEMO_NAME = "freetoken-demo-qwen3-moe"
DEMO_VERSION = 1

log = logging.getLogger("freetoken.demo")


def demo_model_path() -> Path:
    """The demo checkpoint's folder, building it (atomically) if it is not there yet."""
    path = env.cache_dir() / f"{DEMO_NAME}-v{DEMO_VERSION}" / DEMO_NAME
    if (path / "config.json").is_file():
        return path
    from freetoken.demo.tiny_model import make_tiny_model

    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("building the demo model in %s (first use only)", path)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=path.parent))
    try:
        make_tiny_model(tmp, family="qwen3_moe", seed=0)
        try:
            os.rename(tmp, path)     # atomic: concurrent first starts never see half a model
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
