"""StepBudget sizes prefill chunks from the measured step cost (a + b * tokens)."""

from freetoken.scheduler.step_budget import MIN_CHUNK, StepBudget


def feed(budget: StepBudget, cost, steps: int = 12) -> list[int]:
    chunks = []
    for _ in range(steps):
        n = budget.chunk
        budget.observe(n, cost(n))
        chunks.append(budget.chunk)
    return chunks


def test_per_token_cost_shrinks_chunks_to_the_budget():
    b = StepBudget(0.5, 2048)
    chunks = feed(b, lambda n: 0.002 * n)          # 2 ms a token: 250 tokens fit in 0.5 s
    assert chunks[-1] == MIN_CHUNK and all(c <= 2048 for c in chunks)
    b = StepBudget(1.0, 2048)
    chunks = feed(b, lambda n: 0.001 * n)          # 1000 tokens fit
    assert 900 <= chunks[-1] <= 1000


def test_a_fixed_cost_over_the_budget_keeps_chunks_long():
    # Experts streamed over PCIe for any chunk: 3 s whatever the length. A shorter chunk
    # saves nothing per step, so after the probe the chunks grow back to the longest.
    b = StepBudget(1.0, 2048)
    chunks = feed(b, lambda n: 3.0 + 1e-5 * n)
    assert chunks[-1] == 2048


def test_growth_is_capped_and_cheap_steps_give_the_longest_chunk():
    b = StepBudget(1.0, 4096)
    b.observe(4096, 8.0)                           # far over: shrink
    assert b.chunk == 512
    chunks = [512] + feed(b, lambda n: 1e-5 * n)   # then cheap: grow back, at most 2x a step
    assert chunks[-1] == 4096
    assert all(b2 <= 2 * a for a, b2 in zip(chunks, chunks[1:]))
