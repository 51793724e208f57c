"""Turn a step's logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds.

logits: [N, V] float32, one row per sequence that samples this step. Rows are processed
together; only per-request random draws loop, so each seeded request's stream depends on its
own generator alone (the same seed gives the same tokens whatever it is batched with).
Sampling uses the exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p.
"""

from __future__ import annotations

import dataclasses

import torch

from freetoken.engine.sampling_params import SamplingParams


@dataclasses.dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned_ids: tuple[int, ...] = ()   # e.g. EOS before min_tokens is reached
    forced_id: int | None = None       # every other token masked out (scripted output, tests)


@dataclasses.dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: None, or (logprob of the sampled token, [(token id, logprob)] top-n).
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
    n, vocab = logits.shape
    raw = logits = logits.float()  # logprobs report the model's own distribution
    if any(r.banned_ids or r.forced_id is not None for r in rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            ids = [t for t in row.banned_ids if 0 <= t < vocab]
            logits[i, ids] = float("-inf")
            if row.forced_id is not None and 0 <= row.forced_id < vocab:
                logits[i] = float("-inf")
                logits[i, row.forced_id] = 0.0

    # The one host sync of a step is the final tolist(): the per-row settings go to the
    # device without a blocking copy (_rows_tensor), and all-greedy is decided on the host.
    chosen = logits.argmax(dim=-1)
    if not all(r.params.is_greedy for r in rows):
        dev = logits.device
        greedy = _rows_tensor([r.params.is_greedy for r in rows], torch.bool, dev)
        temps = _rows_tensor([r.params.temperature or 1.0 for r in rows], torch.float32, dev)
        probs = _filtered_probs(logits / temps[:, None], rows)
        noise = _exponential(probs, rows)
        sampled = (probs / noise).argmax(dim=-1)
        chosen = torch.where(greedy, chosen, sampled)
    token_ids = chosen.tolist()
    return SampleResult(token_ids, _logprobs(raw, token_ids, rows))


def _rows_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-row setting on the device: through pinned memory without blocking on CUDA."""
    t = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


def _filtered_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Apply top-k, top-p and min-p per row; returns renormalised probabilities [N, V]."""
    top_k = [r.params.top_k if r.params.top_k > 0 else 0 for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = _rows_tensor([kk or vocab for kk in top_k], torch.int64, logits.device)[:, None]
        drop = ranks >= k
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        p = _rows_tensor(top_p, torch.float32, logits.device)[:, None]
        drop |= mass_before >= p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(m > 0 for m in min_p):
        m = _rows_tensor(min_p, torch.float32, logits.device)[:, None]
        probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _exponential(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        return noise.exponential_()
    if unseeded:
        idx = _rows_tensor(unseeded, torch.int64, probs.device)
        noise[idx] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_()
    for i, r in enumerate(rows):
        if r.generator is not None:
            noise[i] = torch.empty(probs.shape[1], device=r.generator.device).exponential_(
                generator=r.generator).to(probs.device)
    return noise


def _logprobs(raw: torch.Tensor, token_ids: list[int], rows: list[SampleRow]):
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list = [None] * len(rows)
    if not wanted:
        return out
    lp = raw[wanted].log_softmax(dim=-1)
    top_n = max(rows[i].params.logprobs for i in wanted)
    top_vals, top_ids = lp.topk(max(top_n, 1), dim=-1) if top_n else (None, None)
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        top = []
        if n:
            top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist()))
        out[i] = (float(lp[j, token_ids[i]]), top)
    return out
