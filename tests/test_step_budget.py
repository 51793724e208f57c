"""StepBudget sizes prefill chunks from the measured step cost (a + b * tokens + c * pairs)."""

from dataclasses import dataclass

from freetoken.scheduler.step_budget import MIN_CHUNK, StepBudget, pairs


@dataclass
class Chunk:
    num_tokens: int
    start: int


def prefill(budget: StepBudget, cost, prompt: int, decodes: int = 1) -> list[int]:
    """Prefill one prompt of `prompt` tokens beside `decodes` running streams (at position
    100), one step at a time, the step taking cost(chunks) seconds; returns the chunks."""
    done, chunks = 0, []
    while done < prompt:
        plan = budget.plan()
        step = [Chunk(plan.take(1, 100), 100) for _ in range(decodes)]
        n = plan.take(min(prompt - done, budget.max_tokens), done)   # max_prefill_length
        assert n > 0
        step.append(Chunk(n, done))
        budget.observe(step, cost(step))
        chunks.append(n)
        done += n
    return chunks


def linear(a, b, c=0.0):
    return lambda step: a + sum(b * ch.num_tokens + c * pairs(ch.num_tokens, ch.start)
                                for ch in step)


def test_the_first_chunk_is_short_and_grows_at_most_2x():
    # Nothing seen yet: a first chunk of 2048 would be seconds of silence on a slow CPU.
    b = StepBudget(0.4, 2048)
    chunks = prefill(b, linear(0.02, 1e-4), 12_000)          # 3800 tokens would fit
    assert chunks[:4] == [256, 2 * 257 - 1, 2 * 514 - 1, 2047]    # the decode counts too
    assert max(chunks) == 2047


def test_per_token_cost_shrinks_chunks_to_the_budget():
    b = StepBudget(0.5, 2048)
    chunks = prefill(b, linear(0.0, 0.002), 4000)     # 250 would fit: the floor, after a probe
    assert chunks[1] == 512 and set(chunks[2:-1]) == {MIN_CHUNK}
    b = StepBudget(1.0, 2048)
    chunks = prefill(b, linear(0.0, 0.001), 8000)            # 1000 fit, the decode among them
    assert 900 <= chunks[-2] <= 1000


def test_chunks_shrink_as_the_context_grows():
    # Attention: at position 0 a token costs 0.1 ms, at 12,000 about 0.5 ms. The budget holds
    # all along once the fit has seen the growth (the first steps only probe).
    b = StepBudget(0.4, 2048)
    cost = linear(0.01, 1e-4, 0.03)
    chunks = prefill(b, cost, 12_000)
    assert chunks[3] > 2 * chunks[-2]
    done, over = 0, []
    for n in chunks:
        t = cost([Chunk(1, 100), Chunk(n, done)])
        over.append(t)
        done += n
    assert max(over[5:]) < 0.4 * 1.1


def test_a_fixed_cost_over_the_budget_keeps_chunks_long():
    # Experts streamed over PCIe for any chunk: 3 s whatever the length. A shorter chunk
    # saves nothing per step: the step at MIN_CHUNK over the budget probes a 2x chunk, which
    # costs the same, and the chunks grow to the longest.
    b = StepBudget(1.0, 2048)
    chunks = prefill(b, linear(3.0, 1e-5), 8000)
    assert chunks[:4] == [256, 512, 2048, 2048]


def test_a_per_token_cost_over_the_budget_at_the_floor_stays_at_the_floor():
    # 2 s for 256 tokens: the probe at 512 costs twice as much, so the floor it is.
    b = StepBudget(1.0, 2048)
    chunks = prefill(b, linear(0.0, 0.008), 6000)
    assert chunks[1] == 512 and chunks[-2] == MIN_CHUNK
    assert sum(c > MIN_CHUNK for c in chunks) <= 2


def test_decodes_always_run_and_the_first_chunk_always_progresses():
    b = StepBudget(0.1, 2048)
    streams = [Chunk(1, 5000)] * 300                              # over the budget on their own
    b.observe(streams + [Chunk(256, 0)], 2.0)
    b.observe(streams + [Chunk(700, 256)], 2.5)
    plan = b.plan()
    assert [plan.take(1, 5000) for _ in range(300)] == [1] * 300
    assert plan.take(4000, 0) == MIN_CHUNK                         # the floor, however late
    assert plan.take(4000, 0) == 0                                 # a second chunk waits


def test_the_report_is_plain_json():
    import orjson
    b = StepBudget(0.4, 2048)
    prefill(b, linear(0.02, 1e-4, 0.01), 3000)
    report = orjson.loads(orjson.dumps(b.describe()))            # numpy scalars would raise
    assert report["steps_fitted"] > 0 and report["fixed_s"] > 0
