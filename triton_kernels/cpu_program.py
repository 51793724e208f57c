"""A fixed sequence of native kernel calls over fixed buffers, replayed by row count: the CPU
engine's answer to a CUDA graph (cpu_program.c).

A CPU engine's decode step makes ~8 native calls a layer. Each cost 10-15 us beyond its
work: ctypes' conversion of ~25 arguments (1.4 us), the bound call's checks and its output
tensors, and the modules' Python between them (a 12-layer model of negligible weights
stepped in 1.7 ms). A program records each call once as an Op (the bound calls' `op`
methods, cpu_native.py, check its buffers then), and a run hands the kernel library runs of
them in one call each. Steps the library has no kernel for (torch's int4 GEMM: Int4Linear)
run between those runs as Python callables of the row count, over the same buffers.

Every buffer is the program's, sized for `rows` rows; a run takes t <= rows of them, the
first t rows of each (the kernels' outputs are a function of their own rows only, so the
same bits as the calls made one by one on [t, ..] tensors).

`profile`: None, or a float64 array of one entry an item (`items`, labelled by `labels`) to
which each run adds each item's wall time in ns (bench/cpu_profile.py: where a decode step's
time goes, op by op, inside real steps).
"""

from __future__ import annotations

import ctypes
import time
from typing import Callable

import numpy as np
import torch

from triton_kernels.cpu_native import (ATTN_RANGE, OP_ATTN, OP_EMBED, OP_GDN, OP_MLA,
                                       NativeKernels, Op, _check_rc)

_INTS = 32          # cpu_program.c's OP_INTS


class _COp(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("a", ctypes.c_int64 * _INTS),
                ("f", ctypes.c_float * 4)]


class CpuProgram:
    """Ops and Python steps in order (each op holds the tensors it points into), each with a
    label for its errors ("layer 3's attention")."""

    def __init__(self, kernel: NativeKernels, rows: int):
        self.kernel, self.rows = kernel, rows
        self.items: list[Op | Callable[[int], None]] = []
        self.labels: list[str] = []
        self._runs: list | None = None
        self.profile: np.ndarray | None = None

    def add(self, op: Op, label: str) -> None:
        if op.rows < self.rows:         # a run of self.rows would pass its buffers' ends
            raise ValueError(f"native program: {label}'s buffers hold {op.rows} rows, the "
                             f"program runs up to {self.rows}")
        if len(op.ints) > _INTS or len(op.floats) > 4:
            raise ValueError(f"native program: {label} has {len(op.ints)} ints and "
                             f"{len(op.floats)} floats (at most {_INTS} and 4)")
        self.items.append(op)
        self.labels.append(label)
        self._runs = None

    def python(self, step: Callable[[int], None], label: str) -> None:
        """A step the library has no kernel for: called with the run's row count."""
        self.items.append(step)
        self.labels.append(label)
        self._runs = None

    def compile(self) -> None:
        """Consecutive ops as one ctypes array each (with their labels, for errors), each run
        with the index of its first item."""
        runs, ops = [], []
        for i, (item, label) in enumerate(zip(self.items + [None], self.labels + [""])):
            if isinstance(item, Op):
                ops.append((item, label))
                continue
            if ops:
                arr = (_COp * len(ops))()
                for c, (op, _) in zip(arr, ops):
                    c.kind = op.kind
                    c.a[:len(op.ints)] = op.ints
                    c.f[:len(op.floats)] = op.floats
                runs.append(((arr, ops), i - len(ops)))
                ops = []
            if item is not None:
                runs.append((item, i))
        self._runs = runs

    def run(self, t: int) -> None:
        if not 1 <= t <= self.rows:
            raise ValueError(f"native program: 1 to {self.rows} rows, got {t}")
        if self._runs is None:
            self.compile()
        threads = torch.get_num_threads()
        failed = ctypes.c_int64(-1)
        profile = self.profile
        if profile is not None and (profile.shape != (len(self.items),)
                                    or profile.dtype != np.float64
                                    or not profile.flags.c_contiguous):
            raise ValueError(f"native program: a profile of {len(self.items)} float64 entries "
                             f"expected, got {profile.shape} {profile.dtype}")
        for run, first in self._runs:
            if callable(run):
                start = time.perf_counter_ns()
                with torch.inference_mode():    # (the run itself is entered outside it)
                    run(t)
                if profile is not None:
                    profile[first] += time.perf_counter_ns() - start
                continue
            arr, ops = run
            if profile is None:
                rc = self.kernel.run(ctypes.addressof(arr), len(ops), t, threads,
                                     ctypes.byref(failed))
            else:
                rc = self.kernel.run_timed(ctypes.addressof(arr), len(ops), t, threads,
                                           ctypes.byref(failed),
                                           profile.ctypes.data + first * profile.itemsize)
            if rc:
                op, label = ops[failed.value]
                if op.kind == OP_GDN:
                    from triton_kernels.cpu_gated_delta import _raise
                    _raise(rc, label)
                if rc == -2:
                    raise ValueError(f"{label}: " + (
                        ATTN_RANGE if op.kind in (OP_ATTN, OP_MLA)
                        else "a token id outside the vocabulary" if op.kind == OP_EMBED
                        else "an expert id outside its bank"))
                if rc == -4:
                    raise ValueError(f"{label}: op kind {op.kind} is not one the library has")
                _check_rc(rc, label, "its scratch")     # -3: int4 groups; else memory
