"""Which implementation a public op runs: the Triton kernel or the torch reference.

The engine sets the backend once at startup from its config ("auto" resolves per tensor:
Triton for CUDA tensors when triton imports, the reference otherwise). Tests force
"reference" to compare, and kernel tests call the `_triton` launchers directly.
"""

import functools
import os

try:
    import triton
    import triton.language as tl
except ImportError:   # no triton wheel for this platform: the references still run
    class _Missing:
        """Stands in for `triton` and `tl` so kernel files import; their launchers never run."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self

        def __call__(self, *args, **kwargs):
            # `@triton.jit` and `@triton.jit(...)` both leave the function as it is.
            return args[0] if len(args) == 1 and callable(args[0]) else self

    triton = tl = _Missing()

_BACKENDS = ("auto", "triton", "reference")
_backend = "auto"


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {_BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True under Triton's CPU interpreter, where autotuning cannot run (no active driver)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_fixed_configs = False


def set_fixed_configs(on: bool) -> None:
    """Launch autotuned kernels with one fixed config instead of tuning: the kernel tests on
    a GPU check correctness, and tuning every shape they try would take minutes."""
    global _fixed_configs
    _fixed_configs = on


def fixed_configs() -> bool:
    return _fixed_configs or interpreting()


def use_triton(t) -> bool:
    """True when an op on tensor `t` should run its Triton kernel."""
    if _backend == "reference":
        return False
    if _backend == "triton":
        return True
    return t.is_cuda and triton_available()
