"""SchedulerConfig: the token budget and concurrency limits of continuous batching."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_length: int = 2048     # tokens one step may compute (prefill chunks + decodes)
    max_running_requests: int = 64
    # Shorten prefill chunks so a step takes about this long (step_budget.py); None: chunks
    # of max_prefill_length whatever they cost (the offline LLM API's throughput default).
    max_step_time_s: float | None = None
    enable_prefix_caching: bool = True  # share and keep full KV blocks of common prefixes

    def __post_init__(self):
        if self.max_prefill_length < 1:
            raise ValueError("max_prefill_length must be positive")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be positive")
        if self.max_step_time_s is not None and not self.max_step_time_s > 0:
            raise ValueError("max_step_time_s must be positive (or None: no budget)")
