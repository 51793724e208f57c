"""Turn a step's logits into tokens: logit bias, penalties, structured-output masks, then greedy,
temperature, top-k, top-p, min-p, per-request seeds.

logits: [N, V] float32, one row per sequence that samples this step. Rows are processed
together; only per-request random draws loop, so each seeded request's stream depends on its
own generator alone (the same seed gives the same tokens whatever it is batched with).
A draw is the inverse CDF at one uniform per row (not a random number per token).
Filters work on each row's top candidates (top-k, or the nucleus's), never a full sort
of the vocabulary unless a top-p nucleus is wider than NUCLEUS_CANDIDATES tokens.
The processors before them (logit_bias, presence/frequency/repetition penalties, the grammar
bitmask, min_tokens bans, forced tokens) touch only the rows that ask for them; logprobs report
the model's own distribution, before any of them.
"""

from __future__ import annotations

import dataclasses

import torch

from freetoken.engine.grammar import apply_bitmask
from freetoken.engine.sampling_params import SamplingParams


@dataclasses.dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned_ids: tuple[int, ...] = ()   # e.g. EOS before min_tokens is reached
    forced_id: int | None = None       # every other token masked out (scripted output, tests)
    prompt_ids: list[int] = ()         # for repetition_penalty
    output_ids: list[int] = ()         # for the three penalties


@dataclasses.dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: None, or (logprob of the sampled token, [(token id, logprob)] top-n).
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def sample(logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None = None) -> SampleResult:
    """bitmask: None, or [N, ceil(V/32)] int32 (grammar.py): a 0 bit masks that row's token."""
    n, vocab = logits.shape
    if logits.dtype != torch.float32:
        logits = logits.float()
    raw = logits                   # logprobs report the model's own distribution
    logits = _process(logits, rows, bitmask)

    # The host syncs of a step: the final tolist(), and one more only when a top-p row
    # without top-k must check that its nucleus lies within its candidates. Per-row settings
    # go to the device without a blocking copy (_rows_tensor); who samples is host-side.
    draw = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if not draw:
        token_ids = _greedy_ids(logits)
        return SampleResult(token_ids, _logprobs(raw, token_ids, rows))
    chosen = _argmax(logits)
    dev = logits.device
    drawn_rows = [rows[i] for i in draw]
    temps = _rows_tensor([r.params.temperature for r in drawn_rows], torch.float32, dev)
    picked = logits if len(draw) == n else logits[_rows_tensor(draw, torch.int64, dev)]
    sampled = _draw(picked / temps[:, None], drawn_rows)
    if len(draw) == n:
        chosen = sampled
    else:
        chosen[_rows_tensor(draw, torch.int64, dev)] = sampled
    token_ids = chosen.tolist()
    return SampleResult(token_ids, _logprobs(raw, token_ids, rows))


def _greedy_ids(logits: torch.Tensor) -> list[int]:
    """_argmax's ids as a list. On the CPU without a torch op: after a CPU engine's decode
    program each one cost 20-170 us, its code evicted by the weights' stream
    (engine/cpu_graph.py)."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1).tolist()
    return logits.numpy().argmax(axis=-1).tolist()


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit (a nan, where one is). On the CPU through numpy: torch's
    CPU argmax took 35 us a row of 32768, numpy's 3-4 (0.6% of a 5.5 ms INT4 batch-1 step)."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1))


def _process(logits: torch.Tensor, rows: list[SampleRow], bitmask) -> torch.Tensor:
    """Logit bias, penalties, the grammar mask, bans and forced tokens, on a copy."""
    vocab = logits.shape[1]
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
    banned = [i for i, r in enumerate(rows) if r.banned_ids or r.forced_id is not None]
    if not (biased or penalized or banned or bitmask is not None):
        return logits
    logits = logits.clone()
    for i in biased:
        bias = rows[i].params.logit_bias
        ids = [t for t in bias if 0 <= t < vocab]
        logits[i, ids] += torch.tensor([bias[t] for t in ids], device=logits.device)
    if penalized:
        idx = _rows_tensor(penalized, torch.int64, logits.device)
        logits[idx] = apply_penalties(logits[idx], [rows[i] for i in penalized])
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    for i in banned:
        row = rows[i]
        ids = [t for t in row.banned_ids if 0 <= t < vocab]
        # Never ban every token a grammar allows (a complete JSON value allows only EOS).
        if ids:
            kept = logits[i].clone()
            kept[ids] = float("-inf")
            if bitmask is None or bool(torch.isfinite(kept).any()):
                logits[i] = kept
        if row.forced_id is not None and 0 <= row.forced_id < vocab:
            logits[i] = float("-inf")
            logits[i, row.forced_id] = 0.0
    return logits


def apply_penalties(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """x [m, V] with vLLM's penalties: repetition (CTRL's: a seen token's logit divided by the
    penalty when positive, multiplied when negative; seen = in the prompt or the output), then
    OpenAI's frequency (x count in the output) and presence (once, if in the output)."""
    m, vocab = x.shape
    dev = x.device
    counts = torch.zeros(m, vocab, dtype=torch.float32, device=dev)
    for j, r in enumerate(rows):
        out = [t for t in r.output_ids if 0 <= t < vocab]
        if out:
            counts[j].index_add_(0, torch.tensor(out, device=dev), torch.ones(len(out), device=dev))
    rep = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in rep):
        seen = counts > 0
        for j, r in enumerate(rows):
            if rep[j] != 1.0 and r.prompt_ids:
                seen[j, torch.tensor([t for t in r.prompt_ids if 0 <= t < vocab], device=dev)] = True
        p = _rows_tensor(rep, torch.float32, dev)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    freq = _rows_tensor([r.params.frequency_penalty for r in rows], torch.float32, dev)[:, None]
    pres = _rows_tensor([r.params.presence_penalty for r in rows], torch.float32, dev)[:, None]
    return x - freq * counts - pres * (counts > 0).float()


def _rows_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-row setting on the device: through pinned memory without blocking on CUDA."""
    t = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


def _draw(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """One draw per row of x [m, V] (temperature applied) under its filters -> ids [m].

    Rows without top-k or top-p draw from the whole vocabulary (no sort). The others work
    on their candidates, the top min(top_k, V) tokens, or for top-p alone the top
    NUCLEUS_CANDIDATES when they hold at least top_p of the mass (the nucleus is then among
    them), else the whole sorted vocabulary: a sort of 150k logits per row costs far more
    than the step on a CPU, and the nucleus of a real model is a few hundred tokens at most.
    """
    m, vocab = x.shape
    out = torch.empty(m, dtype=torch.int64, device=x.device)
    plain = [j for j, r in enumerate(rows) if _cap(r.params, vocab) is None]
    filtered = sorted(set(range(m)) - set(plain))
    for group, fn in ((plain, _draw_plain), (filtered, _draw_filtered)):
        if group:
            sub = x if len(group) == m else x[_rows_tensor(group, torch.int64, x.device)]
            got = fn(sub, [rows[j] for j in group])
            if len(group) == m:
                return got
            out[_rows_tensor(group, torch.int64, x.device)] = got
    return out


NUCLEUS_CANDIDATES = 1024


def _cap(p: SamplingParams, vocab: int) -> int | None:
    """How many top tokens a row's filters look at first; None: the whole vocabulary."""
    if p.top_k > 0:
        return min(p.top_k, vocab)
    if p.top_p < 1.0:
        return min(NUCLEUS_CANDIDATES, vocab)
    return None


def _draw_plain(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    probs = _min_p(x.softmax(dim=-1), rows)
    return _pick(probs, rows)


def _draw_filtered(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    probs, ids, _ = filtered_candidates(x, rows)
    return ids.gather(1, _pick(probs, rows)[:, None]).squeeze(1)


def filtered_candidates(x: torch.Tensor, rows: list[SampleRow]):
    """x [m, V] -> (probs [m, C] after top-k, top-p and min-p, their token ids [m, C], each
    row's candidate count). Tokens outside a row's candidates have probability 0."""
    m, vocab = x.shape
    caps = [_cap(r.params, vocab) for r in rows]
    # [m] full-vocabulary normaliser, needed by the rows without top-k only.
    lse = x.logsumexp(dim=-1) if any(r.params.top_k <= 0 for r in rows) else None
    nucleus = [j for j, r in enumerate(rows) if r.params.top_k <= 0 and caps[j] < vocab]
    if nucleus:
        # Candidates hold the nucleus iff their mass reaches top_p (the one extra sync).
        idx = _rows_tensor(nucleus, torch.int64, x.device)
        top = x[idx].topk(max(caps[j] for j in nucleus), dim=-1).values
        mass = (top.logsumexp(dim=-1) - lse[idx]).exp().tolist()
        for j, held in zip(nucleus, mass):
            if held < rows[j].params.top_p:
                caps[j] = vocab
    vals, ids = x.topk(max(caps), dim=-1)                            # [m, C], descending
    dev = x.device
    c = vals.shape[1]
    drop = torch.arange(c, device=dev)[None, :] >= _rows_tensor(caps, torch.int64, dev)[:, None]
    has_k = _rows_tensor([r.params.top_k > 0 for r in rows], torch.bool, dev)
    # top-k rows normalise over their k tokens, top-p-only rows over the whole vocabulary.
    log_z = vals.masked_fill(drop, float("-inf")).logsumexp(dim=-1)
    if lse is not None:
        log_z = torch.where(has_k, log_z, lse)
    sorted_probs = (vals - log_z[:, None]).exp().masked_fill(drop, 0.0)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= _rows_tensor([r.params.top_p for r in rows], torch.float32, dev)[:, None]
    probs = _min_p(vals.masked_fill(drop, float("-inf")).softmax(dim=-1), rows)
    return probs, ids, caps


def filtered_probs_reference(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The reference of filtered_candidates: every filter over the whole vocabulary, sorted
    (the textbook way; tests compare against it, bench/sampler.py times it). -> [m, V]."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in rows],
                     device=logits.device)[:, None]
    drop = torch.arange(vocab, device=logits.device)[None, :] >= k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    top_p = torch.tensor([r.params.top_p for r in rows], device=logits.device)[:, None]
    drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    filtered = torch.full_like(logits, float("-inf")).scatter(
        -1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return _min_p(filtered.softmax(dim=-1), rows)


def _min_p(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    if not any(r.params.min_p > 0 for r in rows):
        return probs
    m = _rows_tensor([r.params.min_p for r in rows], torch.float32, probs.device)[:, None]
    probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _pick(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """One draw from each row of probs [m, C] (unnormalised is fine) by the inverse CDF: one
    uniform per row, so a seeded row's stream is its generator's alone, whatever it is
    batched with. The CDF is summed in float64 so that a 150k-token vocabulary's tail keeps
    its probabilities."""
    m = probs.shape[0]
    u = torch.rand(m, device=probs.device) if any(r.generator is None for r in rows) else \
        torch.empty(m, device=probs.device)
    for j, r in enumerate(rows):
        if r.generator is not None:
            u[j:j + 1] = torch.rand(1, generator=r.generator, device=r.generator.device).to(u.device)
    cdf = probs.double().cumsum(dim=-1)
    target = (u.double() * cdf[:, -1])[:, None]          # in [0, total): some cdf exceeds it
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


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


def token_logprobs(logits: torch.Tensor, targets: list[int], n: int) -> list:
    """Scoring: rows of logits [m, V] and the token each was followed by -> per row (logprob of
    that token, [(id, logprob)] its top n, its rank: 1 + how many tokens were likelier), from
    the model's own distribution."""
    lp = logits.float().log_softmax(dim=-1)
    picked_t = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])       # [m, 1]
    ranks = ((lp > picked_t).sum(dim=-1) + 1).tolist()
    picked = picked_t.squeeze(1).tolist()
    if not n:
        return [(v, [], r) for v, r in zip(picked, ranks)]
    vals, ids = lp.topk(n, dim=-1)
    return [(v, list(zip(i, t)), r) for v, i, t, r in zip(picked, ids.tolist(), vals.tolist(), ranks)]
