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
    try:
        with tk.fixed_configs_scope():
            yield
    finally:
        torch.set_default_device("cpu")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls gain nothing from a second thread, and on a shared 2-core machine a busy
    core turns every parallel region into a spin-wait (tests ran 30x slower). Modules that
    run whole models use it: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def threads():
    """torch.set_num_threads for one test (the native CPU kernels run on torch's count),
    the count put back after it."""
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def no_saved_profiles(tmp_path_factory):
    """No `ft bench bw` profile of this machine is read: hybrid's measured K calibrates."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FREETOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("ftcache")))
        yield
