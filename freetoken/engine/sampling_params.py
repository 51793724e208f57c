"""SamplingParams with vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class StructuredOutputs:
    """vLLM's StructuredOutputsParams: exactly one constraint. `json` is a JSON schema (dict or
    its text); `json_object` any JSON object; `regex`, `choice` (one of these strings) and
    `grammar` (Lark, llguidance's dialect) constrain text. `param` names the request field it
    came from, so a schema the grammar engine refuses is a 400 naming that field. The engine
compiles it (freetoken/engine/grammar.py) when the request is added."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    param: str = "structured_outputs"
    # Where the constraint starts (set by the server from the model's conventions):
    after: str | None = None           # once the output ends with this (e.g. "<tool_call>")
    rearm: bool = False                # ... and again after each completion (tool calls in text)
    think_block: tuple[str, str] | None = None   # the first token may open this block instead

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            err = ValueError(f"{self.param} needs exactly one constraint (json, json_object, regex, "
                             f"choice or grammar), got {', '.join(given) or 'none'}")
            err.param = self.param
            raise err


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
    presence_penalty: float = 0.0      # OpenAI's: minus this once for every token already output
    frequency_penalty: float = 0.0     # ... minus this times how often it was output
    repetition_penalty: float = 1.0    # vLLM's (CTRL's): prompt and output tokens' logits / this (> 0: x this)
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100]
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's logprob plus the top n
    structured_outputs: StructuredOutputs | None = None

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
            if isinstance(self.seed, float) and (not math.isfinite(self.seed) or abs(self.seed) >= 2**63):
                bad("seed", f"is out of range: it must be an integer in [-2**63, 2**63), got {self.seed!r}")
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            bad("seed", f"is out of range: it must be an integer in [-2**63, 2**63), got {self.seed}")
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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < float(self.repetition_penalty) <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                bad("logit_bias", "must map token ids to numbers")
            for k, v in self.logit_bias.items():
                if not -100.0 <= v <= 100.0:
                    bad("logit_bias", f"values must be in [-100, 100], got {v} for token {k}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
