"""Structured outputs: a request's constraint as an llguidance matcher, whose token mask the
sampler applies to that request's row only (constrained and free requests share a batch).

Why llguidance rather than xgrammar: llguidance builds its tokenizer straight from the
tokenizer.json text our `tokenizers` backend already holds (xgrammar wants a transformers
tokenizer, and its wheel pulls in transformers and a JIT FFI runtime); it takes the model's
vocabulary size (n_vocab), which may exceed the tokenizer's (ids past the tokenizer are never
allowed); it is one dependency-free abi3 wheel; and it computes masks on the CPU as bitmasks
[N, ceil(V/32)] int32, which the sampler unpacks with plain torch ops on the CPU or the GPU.

A Grammar follows the output token by token (forced tokens included); the matcher is what
the output so far implies, so a preempted request that is recomputed keeps it unchanged.
Optionally the constraint starts only after a marker (the end of a think block the prompt
opened; `<tool_call>` in free text, re-armed after each call), and at the first token the
model may open a think block instead, in which case it starts after the block ends.
"""

from __future__ import annotations

import json
import logging

import torch

from freetoken.engine.sampling_params import StructuredOutputs

log = logging.getLogger("freetoken.engine")

# JSON whitespace between tokens, bounded: unbounded whitespace lets a weak model pad
# forever until max_tokens cuts the JSON; 16 characters still fit pretty-printed JSON.
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
JSON_OPTIONS = {"whitespace_pattern": WHITESPACE}


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


MISSING = ("structured outputs (response_format json_schema/json_object, guided choice, regex "
           "and grammars) need the llguidance package, which is not installed here: "
           "pip install 'llguidance>=1.0'")


def _llguidance(param: str = "response_format"):
    """The llguidance module, or a GrammarError (a 400) that says it is missing: a server
    without it still serves everything else."""
    try:
        import llguidance
    except ImportError:
        raise GrammarError(MISSING, param) from None
    return llguidance


class GrammarCompiler:
    """One per engine: the llguidance tokenizer (built on first use, ~0.1-1 s) and compile()."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._ll_tokenizer = None
        self._executor = None

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            self._ll_tokenizer = _llguidance().LLTokenizer(
                self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=self.eos_ids or None)
        return self._ll_tokenizer

    def warm(self) -> None:
        """Build the llguidance tokenizer now (a server does it while loading, not in a request).
        Without llguidance the server starts all the same: a warning now, and a clear 400 for
        each request that asks for a constraint."""
        try:
            _ = self.ll_tokenizer
        except GrammarError as e:
            log.warning("%s; serving without them", e)

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def grammar_text(self, spec: StructuredOutputs) -> str:
        LLMatcher = _llguidance(spec.param).LLMatcher

        try:
            if spec.json is not None:
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema must be an object")
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if spec.json_object:
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if spec.regex is not None:
                return LLMatcher.grammar_from_regex(spec.regex)
            if spec.choice is not None:
                if not spec.choice or not all(isinstance(c, str) for c in spec.choice):
                    raise ValueError("choice must be a non-empty list of strings")
                return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.choice)))
            return LLMatcher.grammar_from_lark(spec.grammar)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{spec.param}: {e}", spec.param) from None

    def compile(self, spec: StructuredOutputs) -> "Grammar":
        """A fresh Grammar for one request; GrammarError (a 400) when it cannot compile."""
        LLMatcher = _llguidance(spec.param).LLMatcher

        text = self.grammar_text(spec)
        error = LLMatcher.validate_grammar(text, self.ll_tokenizer)
        if error:
            raise GrammarError(f"{spec.param} cannot be compiled to a grammar: {error}", spec.param)
        matcher = LLMatcher(self.ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.param} cannot be compiled to a grammar: {matcher.get_error()}",
                               spec.param)
        return Grammar(matcher, self._ids(spec.after), spec.rearm,
                       self._single_id(spec.think_block[0]) if spec.think_block else None,
                       self._ids(spec.think_block[1]) if spec.think_block else None)

    def _ids(self, text: str | None) -> list[int] | None:
        return self.tokenizer.encode(text) if text else None

    def _single_id(self, text: str) -> int | None:
        ids = self.tokenizer.encode(text)
        return ids[0] if len(ids) == 1 else None

    def fill(self, grammars: list[tuple["Grammar", int]], num_rows: int) -> torch.Tensor:
        """The bitmask [num_rows, words] int32 (CPU): all ones, but for each (grammar, row)
        the tokens its grammar allows next."""
        mask = torch.full((num_rows, self.words), -1, dtype=torch.int32)
        active = [(g.matcher, row) for g, row in grammars]
        if active:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor()
            self._executor.unsafe_compute_mask_ptr(active, mask.data_ptr(), self.words * 4, num_rows)
        for g, row in grammars:
            if g.extra_id is not None and g.num_seen == 0:
                mask[row, g.extra_id // 32] |= _bit(g.extra_id % 32)
        return mask


def _bit(i: int) -> int:
    """Bit i of an int32 word as a Python int that fits int32 (bit 31 is the sign)."""
    return -(1 << 31) if i == 31 else 1 << i


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with every token whose bit is 0 in mask [N, ceil(V/32)] set to -inf."""
    n, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (mask.to(logits.device, non_blocking=True)[:, :, None] >> shifts) & 1   # [N, W, 32]
    allowed = bits.reshape(n, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))


class Grammar:
    """One request's constraint state. `active`: the sampler masks this row now."""

    def __init__(self, matcher, after_ids: list[int] | None, rearm: bool,
                 think_start_id: int | None, think_end_ids: list[int] | None):
        self.matcher = matcher
        self.after_ids = after_ids
        self.rearm = rearm
        self.think_start_id = think_start_id
        self.think_end_ids = think_end_ids
        self.waiting_for = after_ids          # marker ids the output must end with first
        self.num_seen = 0                     # output tokens followed
        self.failed = False
        self.done = False                     # the constraint is complete: the request stops

    @property
    def active(self) -> bool:
        return self.waiting_for is None and not self.failed and not self.done

    @property
    def extra_id(self) -> int | None:
        """A token allowed besides the grammar's at the first step: opening a think block."""
        return self.think_start_id if self.active else None

    def accept(self, token: int, output_ids: list[int]) -> None:
        """Follow one output token (output_ids already ends with it)."""
        first = self.num_seen == 0
        self.num_seen += 1
        if self.failed or self.done:
            return
        if self.waiting_for is not None:
            w = self.waiting_for
            if len(output_ids) >= len(w) and output_ids[-len(w):] == w:
                self.waiting_for = self.after_ids if w is self.think_end_ids else None
            return
        if first and token == self.think_start_id:
            self.waiting_for = self.think_end_ids
            return
        if not self.matcher.consume_token(token):
            # Only a forced (scripted) token can do this: the sampler never picks a masked one.
            log.warning("structured output: token %d breaks the grammar; unconstrained from here: %s",
                        token, self.matcher.get_error()[:200])
            self.failed = True
            return
        if self.matcher.is_stopped():
            if self.rearm:
                self.matcher.reset()
                self.waiting_for = self.after_ids
            else:
                self.done = True
