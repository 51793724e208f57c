"""biased_topk (sigmoid/softmax scores, selection bias, DeepSeek-V3's expert groups): the
reference against a per-token loop written out here, and the Triton kernel against the
reference (interpreter on CPU, compiled on a GPU, as in test_kernels.py)."""

import math

import pytest
import torch

import triton_kernels as tk
from test_kernels import _kernel_device, _seed, assert_close  # noqa: F401
from triton_kernels.routing import biased_topk_reference, biased_topk_triton


def naive_biased_topk(logits, top_k, bias, scoring, n_group, topk_group, renormalize, scale):
    """One token at a time, selection by Python sorts on (-value, id): lowest id wins ties."""
    t, e = logits.shape
    size = e // n_group
    all_w, all_ids = [], []
    for row in logits.float():
        scores = torch.sigmoid(row) if scoring == "sigmoid" else torch.softmax(row, dim=0)
        choice = (scores + (0 if bias is None else bias.float())).tolist()
        allowed = range(e)
        if n_group > 1:
            def group_score(g):
                top = sorted(choice[g * size:(g + 1) * size], reverse=True)
                return top[0] + (top[1] if size > 1 else 0.0)
            groups = sorted(range(n_group), key=lambda g: (-group_score(g), g))[:topk_group]
            allowed = [i for g in groups for i in range(g * size, (g + 1) * size)]
        ids = sorted(allowed, key=lambda i: (-choice[i], i))[:top_k]
        w = [float(scores[i]) for i in ids]
        if renormalize:
            total = sum(w) + 1e-20
            w = [x / total for x in w]
        all_w.append([x * scale for x in w])
        all_ids.append(ids)
    return torch.tensor(all_w, dtype=torch.float32), torch.tensor(all_ids, dtype=torch.int64)


def _logits(t, e, dtype=torch.float32):
    # Distinct logits per row on a 1/32 grid (exact in float16), spread over [-4, 4).
    logits = torch.stack([torch.randperm(e) for _ in range(t)]).float() * (8.0 / e) - 4.0
    return (torch.round(logits * 32) / 32).to(dtype)


def _assert_same_ids(got, want, what):
    bad = got != want
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {got.numel()} ids differ; first at "
                             f"{where}: got {got[where].item()}, expected {want[where].item()}")


CONFIGS = [  # e, top_k, n_group, topk_group
    (6, 2, 1, 1),
    (60, 4, 4, 2),            # 4 groups of 15: padded groups
    (128, 8, 1, 1),
    (160, 6, 1, 1),
    (256, 8, 8, 4),           # DeepSeek-V3
    (16, 3, 16, 5),           # groups of one expert: a group scores its one choice
    (512, 10, 16, 4),         # the widest supported
]
OPTIONS = [  # with bias, renormalize, scale
    (False, True, 1.0),
    (True, True, 2.5),
    (True, False, 1.0),
]


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("with_bias,renormalize,scale", OPTIONS)
@pytest.mark.parametrize("e,top_k,n_group,topk_group", CONFIGS)
@pytest.mark.parametrize("t", [1, 5, 33])
def test_biased_topk(t, e, top_k, n_group, topk_group, with_bias, renormalize, scale, scoring):
    logits = _logits(t, e)
    # A bias on a 1/256 grid, big enough to reorder experts (softmax scores are ~1/E).
    bias = torch.randint(-8, 9, (e,)).float() / (256 if scoring == "sigmoid" else 8 * e)
    bias = bias if with_bias else None
    kw = dict(bias=bias, scoring=scoring, n_group=n_group, topk_group=topk_group,
              renormalize=renormalize, scale=scale)
    w_ref, ids_ref = biased_topk_reference(logits, top_k, **kw)
    assert w_ref.dtype == torch.float32 and ids_ref.dtype == torch.int64
    w_naive, ids_naive = naive_biased_topk(logits, top_k, bias, scoring, n_group, topk_group,
                                           renormalize, scale)
    _assert_same_ids(ids_ref, ids_naive, "reference vs naive")
    assert_close(w_ref, w_naive, atol=1e-6, rtol=1e-5, what="reference vs naive weights")
    w, ids = biased_topk_triton(logits, top_k, **kw)
    _assert_same_ids(ids, ids_ref, "triton vs reference")
    assert_close(w, w_ref, atol=1e-6, rtol=1e-5, what="triton vs reference weights")


def test_groups_exclude_experts_and_bias_only_selects():
    # 4 groups of 4. Expert 0 has the best score, but its group (0-3) has a poor second; the
    # bias pushes expert 13 in, yet its weight stays its unbiased score.
    logits = torch.full((1, 16), -4.0)
    logits[0, 0] = 4.0
    logits[0, 4:6] = 2.0
    logits[0, 8:10] = 1.5
    logits[0, 12:14] = torch.tensor([0.5, 0.0])
    bias = torch.zeros(16)
    bias[13] = 0.6
    kw = dict(bias=bias, scoring="sigmoid", n_group=4, topk_group=2, renormalize=False)
    for op in (biased_topk_reference, biased_topk_triton):
        w, ids = op(logits, 2, **kw)
        # group scores: 0-3: s(4)+s(-4) = 0.999; 4-7: 2 s(2) = 1.76; 8-11: 2 s(1.5) = 1.64;
        # 12-15: s(.5) + s(0) + .6 = 1.72 -> groups 1 and 3; picks 13 (1.1) then 4.
        assert ids.tolist() == [[13, 4]], op.__name__
        assert_close(w, torch.sigmoid(torch.tensor([[0.0, 2.0]])), atol=1e-6, rtol=1e-6)


def test_ties_go_to_the_lowest_id_in_choice_order():
    logits = torch.zeros(3, 12)
    logits[1, [3, 7, 9]] = 1.0
    logits[2, 11] = 2.0
    for op in (biased_topk_reference, biased_topk_triton):
        _, ids = op(logits, 4, scoring="softmax")
        assert ids.tolist() == [[0, 1, 2, 3], [3, 7, 9, 0], [11, 0, 1, 2]], op.__name__


def test_float16_logits_and_empty_batch():
    logits = _logits(9, 64, torch.float16)
    kw = dict(bias=torch.randn(64) / 100, n_group=8, topk_group=3)
    w, ids = biased_topk_triton(logits, 6, **kw)
    w_ref, ids_ref = biased_topk_reference(logits, 6, **kw)
    _assert_same_ids(ids, ids_ref, "triton vs reference")
    assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    assert math.isclose(float(w.sum(-1).mean()), 1.0, rel_tol=1e-5)
    w, ids = biased_topk_triton(torch.zeros(0, 64), 6)
    assert w.shape == ids.shape == (0, 6)


def test_bad_routing_args_are_rejected():
    logits = torch.zeros(2, 60)
    for kw, match in ((dict(scoring="relu"), "scoring"), (dict(n_group=7), "n_group"),
                      (dict(n_group=4, topk_group=5), "topk_group"),
                      (dict(bias=torch.zeros(59)), "bias")):
        with pytest.raises(ValueError, match=match):
            biased_topk_triton(logits, 2, **kw)
    with pytest.raises(ValueError, match="top_k"):
        biased_topk_reference(logits, 31, n_group=4, topk_group=2)     # only 30 in play
    with pytest.raises(ValueError, match="512"):
        biased_topk_reference(torch.zeros(1, 1024), 2)


def test_public_op_dispatches():
    logits = _logits(4, 32)
    want = biased_topk_reference(logits, 4, n_group=4, topk_group=2, scale=1.5)
    with tk.kernel_backend("triton"):
        got = tk.biased_topk(logits, 4, n_group=4, topk_group=2, scale=1.5)
    _assert_same_ids(got[1], want[1], "public op")
    assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("op", [biased_topk_reference, biased_topk_triton])
def test_biased_topk_matches_transformers_deepseek_v3_router(op):
    """DeepSeek-V3's router as transformers writes it (the oracle): sigmoid scores, the
    e_score_correction_bias for selection only, groups scored by the sum of their top-2
    biased scores, 4 of 8 groups kept, top-8, renormalised, times routed_scaling_factor 2.5.
    Its topk is unsorted, so both sides are compared as id-sorted sets."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=256, num_experts_per_tok=8,
                           n_group=8, topk_group=4, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_()
        # A bias as large as the scores' spread, so it really moves the selection.
        router.e_score_correction_bias.uniform_(-0.5, 0.5)
    x = torch.randn(9, 32)
    with torch.no_grad():
        logits, w_hf, ids_hf = router(x)
    w, ids = op(logits, 8, bias=router.e_score_correction_bias, scoring="sigmoid", n_group=8,
                topk_group=4, renormalize=True, scale=2.5)
    ids_hf, order = ids_hf.sort(dim=-1)
    ids, mine = ids.sort(dim=-1)
    _assert_same_ids(ids, ids_hf, "ids vs transformers")
    assert_close(w.gather(1, mine), w_hf.gather(1, order).float(), atol=1e-6, rtol=1e-5,
                 what="weights vs transformers")
    # The bias moved the choice: without it, some token picks other experts.
    _, ids_plain = op(logits, 8, scoring="sigmoid", n_group=8, topk_group=4, scale=2.5)
    assert not torch.equal(ids_plain.sort(dim=-1).values, ids)
