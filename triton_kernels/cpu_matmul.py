"""Dense projections on the CPU: a 16-bit weight widened to float32 for many rows at once.

torch's bfloat16 and float16 matmuls on a CPU without AVX-512 BF16 / AMX (AVX2 machines,
most desktops) run one matrix-vector product per row: 16 rows cost 16x one row, 512 rows
(a prefill chunk) 290x. float32 goes to the BLAS GEMM. Widening the weight (one vectorized
copy, ~0.2 ns a weight) and multiplying in float32 costs about the same as the 16-bit
product at 8 rows, half at 16, a sixth at 512 (measured on a 2-core AVX2 EPYC, [512, 1024]):
so from WIDE_ROWS rows on the weight is widened, a tile of rows at a time. Both accumulate in float32 and round the
output to x's dtype once; the sums run in other orders, so the bits differ in the last place.
On the GPU and in float32 this is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WIDE_ROWS = 12
TILE_ELEMENTS = 1 << 20   # weights widened at a time: 4 MB of float32 that stays in cache (a
                          # whole lm_head, 128 MB for 32k x 1024, was 2x slower than bf16)
_NARROW = (torch.bfloat16, torch.float16)


def widens(x: torch.Tensor, rows: float | None = None) -> bool:
    """True when a product of x ([rows, K]; rows: x's unless given, e.g. the mean rows per
    expert of a MoE call) with a weight in x's dtype runs faster widened."""
    return (x.device.type == "cpu" and x.dtype in _NARROW
            and (x.shape[0] if rows is None else rows) >= WIDE_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           wide: bool | None = None) -> torch.Tensor:
    """F.linear(x [.., K], weight [N, K], bias) in x's dtype; wide: widen (None: decide by
    x's rows, see widens)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if not (widens(rows) if wide is None else wide):
        return F.linear(x, weight, bias)
    xf = rows.float()
    n, k = weight.shape
    step = max(1, TILE_ELEMENTS // k)
    buf = torch.empty(min(step, n), k)
    parts = []
    for r in range(0, n, step):
        w = buf[:min(step, n - r)].copy_(weight[r:r + step])
        parts.append(F.linear(xf, w, None if bias is None else bias[r:r + step].float()))
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
