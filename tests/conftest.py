"""Shared test setup.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. The interpreter is
chosen when a kernel is decorated, so the variable must be set before triton_kernels imports.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
