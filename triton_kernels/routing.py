"""MoE routing with a selection bias and expert groups (DeepSeek-V3, GLM-4.5, MiniMax-M2,
ERNIE-4.5, gpt-oss-style softmax routers alike).

logits: [T, E] router logits -> (weights [T, k] float32, ids [T, k] int64):
- scores = sigmoid(logits) or softmax(logits) over the E experts, in float32;
- choice = scores + bias ([E] float32, the aux-loss-free balancing bias), for selection only;
- groups (n_group > 1): the E experts are n_group contiguous groups of E / n_group; a group
  scores the sum of its top-2 choices (its one choice if it has one expert); only the
  topk_group best groups stay in play, the others' experts count as -inf;
- ids = the top_k choices, in descending order, ties to the lowest expert id;
- weights = scores[ids] (never the bias), / (their sum + 1e-20) if renormalize, * scale
  (routed_scaling_factor).
"""

import torch

from triton_kernels._dispatch import tl, triton, use_triton

_SCORINGS = ("sigmoid", "softmax")
_MAX_EXPERTS = 512          # DeepSeek-V3 has 256, Qwen3-Next 512
_MAX_GROUPS = 16


def biased_topk_reference(logits: torch.Tensor, top_k: int, *, bias: torch.Tensor | None = None,
                          scoring: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
                          renormalize: bool = True, scale: float = 1.0):
    _check_routing_args(logits, top_k, bias, scoring, n_group, topk_group)
    t, e = logits.shape
    logits = logits.float()
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = (grouped[..., 0] if e // n_group == 1
                        else grouped.topk(2, dim=-1).values.sum(dim=-1))           # [T, G]
        keep = _stable_top(group_scores, topk_group)
        in_play = torch.zeros(t, n_group, dtype=torch.bool, device=logits.device)
        in_play.scatter_(1, keep, True)
        choice = choice.masked_fill(~in_play.repeat_interleave(e // n_group, dim=1),
                                    float("-inf"))
    ids = _stable_top(choice, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def _stable_top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last axis, descending, ties to the lowest index
    (torch.topk leaves tie order unspecified)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


@triton.jit
def _argmax_lowest(x, ids, BIG: tl.constexpr):
    """Max over the last two axes of x [R, A, B] and the lowest id where it is reached."""
    best = tl.max(tl.max(x, axis=2), axis=1)                                       # [R]
    hit = x == best[:, None, None]
    return best, tl.min(tl.min(tl.where(hit, ids, BIG), axis=2), axis=1)


@triton.jit(do_not_specialize=["T"])
def _biased_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, stride_lt, stride_le, scale,
                        E: tl.constexpr, K: tl.constexpr, SOFTMAX: tl.constexpr,
                        HAS_BIAS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                        N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                        G_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    # A [BLOCK_T, G_PAD, S_PAD] tile of rows per program: expert e = g * GROUP_SIZE + s sits
    # at (g, s), so a group is one row of the last axis (without groups, N_GROUP = 1 and the
    # whole row is one group). Padding experts and dropped groups are -inf; k rounds of
    # argmax pick the top k.
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_g = tl.arange(0, G_PAD)
    offs_s = tl.arange(0, S_PAD)
    mask_t = offs_t < T
    experts = offs_g[:, None] * GROUP_SIZE + offs_s[None, :]                       # [G, S]
    real = (offs_g < N_GROUP)[:, None] & (offs_s < GROUP_SIZE)[None, :]
    ptrs = (logits_ptr + offs_t.to(tl.int64)[:, None, None] * stride_lt
            + (experts * stride_le)[None, :, :])
    x = tl.load(ptrs, mask=mask_t[:, None, None] & real[None, :, :], other=float("-inf"))
    x = tl.where(mask_t[:, None, None], x.to(tl.float32), 0.0)   # keep padding rows finite
    if SOFTMAX:
        p = tl.exp(x - tl.max(tl.max(x, axis=2), axis=1)[:, None, None])
        scores = p / tl.sum(tl.sum(p, axis=2), axis=1)[:, None, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=real, other=0.0).to(tl.float32)[None, :, :]
    choice = tl.where(real[None, :, :], choice, float("-inf"))
    # Padding slots get id E, which no real expert has (their g * GROUP_SIZE + s may).
    ids3 = (tl.zeros((BLOCK_T, G_PAD, S_PAD), dtype=tl.int32)
            + tl.where(real, experts, E)[None, :, :])
    if N_GROUP > 1:
        # A group's score: its best choice plus its second best (the best's first slot out).
        top1 = tl.max(choice, axis=2)                                              # [T, G]
        first = tl.min(tl.where(choice == top1[:, :, None], offs_s[None, None, :], S_PAD),
                       axis=2)
        if GROUP_SIZE > 1:
            rest = tl.where(offs_s[None, None, :] == first[:, :, None], float("-inf"), choice)
            group_score = top1 + tl.max(rest, axis=2)
        else:
            group_score = top1
        group_score = tl.where((offs_g < N_GROUP)[None, :], group_score, float("-inf"))
        keep = tl.zeros((BLOCK_T, G_PAD), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_score, axis=1)
            gid = tl.min(tl.where(group_score == best[:, None], offs_g[None, :], G_PAD), axis=1)
            picked = offs_g[None, :] == gid[:, None]
            keep = tl.where(picked, 1, keep)
            group_score = tl.where(picked, float("-inf"), group_score)
        choice = tl.where(keep[:, :, None] != 0, choice, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    top_id = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(K):
        _, best_id = _argmax_lowest(choice, ids3, E)
        chosen = ids3 == best_id[:, None, None]
        best_w = tl.sum(tl.sum(tl.where(chosen, scores, 0.0), axis=2), axis=1)
        top_w = tl.where(offs_k[None, :] == j, best_w[:, None], top_w)
        top_id = tl.where(offs_k[None, :] == j, best_id[:, None], top_id)
        choice = tl.where(chosen, float("-inf"), choice)
    if RENORMALIZE:
        top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + 1e-20)
    top_w = top_w * scale
    out_offs = offs_t.to(tl.int64)[:, None] * K + offs_k[None, :]
    out_mask = mask_t[:, None] & (offs_k < K)[None, :]
    tl.store(w_ptr + out_offs, top_w, mask=out_mask)
    tl.store(ids_ptr + out_offs, top_id.to(tl.int64), mask=out_mask)


def biased_topk_triton(logits: torch.Tensor, top_k: int, *, bias: torch.Tensor | None = None,
                       scoring: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
                       renormalize: bool = True, scale: float = 1.0):
    _check_routing_args(logits, top_k, bias, scoring, n_group, topk_group)
    t, e = logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    group_size = e // n_group
    g_pad = triton.next_power_of_2(n_group)
    s_pad = triton.next_power_of_2(group_size)
    # About 2K experts' worth of tile a program: 16 rows of 128, 8 of 256, 4 of 512.
    block_t = max(1, min(16, 2048 // (g_pad * s_pad)))
    _biased_topk_kernel[(triton.cdiv(t, block_t),)](
        logits, logits if bias is None else bias, weights, ids, t, logits.stride(0),
        logits.stride(1), float(scale), E=e, K=top_k, SOFTMAX=scoring == "softmax",
        HAS_BIAS=bias is not None, GROUP_SIZE=group_size, N_GROUP=n_group,
        TOPK_GROUP=topk_group if n_group > 1 else 1, RENORMALIZE=bool(renormalize),
        BLOCK_T=block_t, G_PAD=g_pad, S_PAD=s_pad, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4)
    return weights, ids


def _check_routing_args(logits, top_k, bias, scoring, n_group, topk_group):
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"biased_topk: logits must be float [T, E], got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    e = logits.shape[1]
    if e > _MAX_EXPERTS:
        raise ValueError(f"biased_topk: {e} experts > {_MAX_EXPERTS} are not supported")
    if scoring not in _SCORINGS:
        raise ValueError(f"biased_topk: scoring must be one of {_SCORINGS}, got {scoring!r}")
    if bias is not None and (bias.shape != (e,) or not bias.is_floating_point()
                             or not bias.is_contiguous()):
        raise ValueError(f"biased_topk: bias must be a contiguous float [{e}] tensor, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    if not 1 <= n_group <= _MAX_GROUPS or e % n_group:
        raise ValueError(f"biased_topk: n_group {n_group} must be in 1..{_MAX_GROUPS} and divide "
                         f"{e} experts")
    if n_group > 1 and not 1 <= topk_group <= n_group:
        raise ValueError(f"biased_topk: topk_group {topk_group} must be in 1..{n_group}")
    in_play = e if n_group == 1 else topk_group * (e // n_group)
    if not 1 <= top_k <= in_play:
        raise ValueError(f"biased_topk: top_k {top_k} must be in 1..{in_play} (the experts "
                         f"of the groups kept)")


def biased_topk(logits: torch.Tensor, top_k: int, *, bias: torch.Tensor | None = None,
                scoring: str = "sigmoid", n_group: int = 1, topk_group: int = 1,
                renormalize: bool = True, scale: float = 1.0):
    op = biased_topk_triton if use_triton(logits) else biased_topk_reference
    return op(logits, top_k, bias=bias, scoring=scoring, n_group=n_group,
              topk_group=topk_group, renormalize=renormalize, scale=scale)
