"""Shared test setup.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. The interpreter is
chosen when a kernel is decorated, so the variable must be set before triton_kernels imports.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def kernel_device():
    """On a GPU machine a kernel test's tensors are made on CUDA (the compiled kernels, autotuned
    ones with one fixed config); without one, CPU tensors go through the interpreter. Kernel
    test files use it with `pytestmark = pytest.mark.usefixtures("kernel_device")`."""
    if not torch.cuda.is_available():
        yield
        return
    import triton_kernels as tk
    torch.set_default_device("cuda")
    tk.set_fixed_configs(True)
    try:
        yield
    finally:
        tk.set_fixed_configs(False)
        torch.set_default_device("cpu")
