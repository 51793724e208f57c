"""Tiny checkpoints from freetoken.demo.tiny_model, built once per test session.

Import the fixture into a test module (`from tiny_fixtures import tiny_model_dir`). The cache is
module-global, so test files that import it share one build per set of arguments.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from freetoken.demo.tiny_model import make_tiny_model

_BUILT: dict[tuple, Path] = {}


def _key(family: str, seed: int, name: str | None, shape: dict) -> tuple:
    return family, seed, name, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                            for k, v in shape.items()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(family="qwen3_moe", seed=0, name=None, **shape) -> the checkpoint folder
    (read-only: other tests share it). `name` is the folder's name, which `ft serve` serves the
    model as; None leaves it to pytest."""
    def build(family: str = "qwen3_moe", seed: int = 0, name: str | None = None, **shape) -> Path:
        key = _key(family, seed, name, shape)
        if key not in _BUILT:
            out = tmp_path_factory.mktemp(f"tiny-{family}-s{seed}")
            _BUILT[key] = make_tiny_model(out / name if name else out, family=family, seed=seed, **shape)
        return _BUILT[key]
    return build
