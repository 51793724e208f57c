"""SchedulerConfig: the token budget and concurrency limits of continuous batching."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_prefill_length: int = 2048     # tokens one step may compute (prefill chunks + decodes)
    max_running_requests: int = 64
    enable_prefix_caching: bool = True  # share and keep full KV blocks of common prefixes

    def __post_init__(self):
        if self.max_prefill_length < 1:
            raise ValueError("max_prefill_length must be positive")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be positive")
