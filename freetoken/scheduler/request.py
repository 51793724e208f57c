"""Request: one generation's state as the scheduler sees it."""

from __future__ import annotations

import enum
import time

import torch

from freetoken.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"          # EOS, a stop token id or a stop string
    LENGTH = "length"      # max_tokens or the context length
    ABORT = "abort"        # client went away or the server is shutting down


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 max_tokens: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.max_tokens = max_tokens          # resolved: params.max_tokens or what context allows
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # the stop string or token that ended it
        self.num_computed_tokens = 0          # tokens whose K/V are in the cache
        self.block_ids: list[int] = []
        self.state_slot: int | None = None    # hybrid models: its linear-attention state slot
        # Prefix caching (scheduler.py): the hash chain of its full blocks, how many of its
        # blocks are registered in the cache, and for usage: prompt tokens found cached at
        # admission, and prompt tokens this request's blocks added to the cache.
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens = 0
        self.num_cache_created_tokens = 0
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.prefill_s = 0.0                  # with instrument_prefill: forward time of its prefill
        self.prefill_tokens = 0
        self.prefill_shared = False
        self.grammar = None                   # structured outputs: engine.grammar.Grammar
        self.prompt_logprobs: list | None = None   # with params.prompt_logprobs, filled by prefill
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start..end of prompt + output, without joining the two lists (a decode step
        asks for one token; joining would copy the whole context every step)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, stop_reason=None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def prefill_report(self) -> dict | None:
        if not self.prefill_tokens:
            return None
        return {"prefill_s": round(self.prefill_s, 6), "prefill_tokens": self.prefill_tokens,
                "prefill_tokens_per_s": round(self.prefill_tokens / self.prefill_s, 1) if self.prefill_s else None,
                "shared": self.prefill_shared}
