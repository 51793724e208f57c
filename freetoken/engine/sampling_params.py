"""SamplingParams with vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1            # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None   # None: none; 0: the sampled token's; n: plus the top n
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the parameter; the server turns it into a 400."""
        def bad(param, msg):
            err = ValueError(f"{param} {msg}")
            err.param = param
            raise err

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be integers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
