"""Which implementation a public op runs: the Triton kernel or the torch reference.

"auto" resolves per tensor: Triton for CUDA tensors when triton imports, the reference
otherwise. A caller that wants another runs its ops inside `with kernel_backend(name):`, a
context variable scoped to that block and thread (the model runner wraps its forwards with
its config's backend, so two engines in one process keep their own; tests force "reference"
to compare). Kernel tests call the `_triton` launchers directly.
"""

import contextlib
import contextvars
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
_backend = contextvars.ContextVar("triton_kernels_backend", default="auto")
_fixed_configs = contextvars.ContextVar("triton_kernels_fixed_configs", default=False)


def check_backend(name: str) -> str:
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {_BACKENDS}, got {name!r}")
    return name


@contextlib.contextmanager
def kernel_backend(name: str):
    """Run the block's ops on backend `name` ("auto", "triton" or "reference")."""
    token = _backend.set(check_backend(name))
    try:
        yield
    finally:
        _backend.reset(token)


def get_backend() -> str:
    """The backend ops run on here ("auto" outside any kernel_backend block)."""
    return _backend.get()


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


@contextlib.contextmanager
def fixed_configs_scope(on: bool = True):
    """Launch autotuned kernels in the block with one fixed config instead of tuning: the
    kernel tests on a GPU check correctness, and tuning every shape they try would take
    minutes."""
    token = _fixed_configs.set(on)
    try:
        yield
    finally:
        _fixed_configs.reset(token)


def fixed_configs() -> bool:
    return _fixed_configs.get() or interpreting()


def use_triton(t) -> bool:
    """True when an op on tensor `t` should run its Triton kernel."""
    backend = _backend.get()
    if backend == "reference":
        return False
    if backend == "triton":
        return True
    return t.is_cuda and triton_available()
