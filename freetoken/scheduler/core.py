"""EngineCore: the step loop's body, shared by `LLM.generate` and `ft serve`.

step() reads like its stages: plan (schedule which tokens of which requests, lay out the
chunks and sampling rows) -> run (one batched forward and the sampler) -> finish (append,
stop checks, detokenize, free finished requests). LLM.generate runs the three in a row; the
server runs plan and finish on its event loop and run on the engine thread (async_engine.py),
so only the loop's thread ever touches request state.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from freetoken.engine.grammar import GrammarCompiler, GrammarError
from freetoken.engine.model_runner import ModelRunner, SeqChunk
from freetoken.engine.prefix_cache import unsupported_reason
from freetoken.engine.sampler import SampleRow, sample, token_logprobs
from freetoken.engine.sampling_params import SamplingParams
from freetoken.scheduler.config import SchedulerConfig
from freetoken.scheduler.output import TextStream
from freetoken.scheduler.request import FinishReason, Request
from freetoken.scheduler.scheduler import ScheduledChunk, Scheduler

log = logging.getLogger("freetoken.engine")


def context_warning(mc, max_model_len: int) -> str | None:
    """A context beyond what the model was trained for (a gateway's --max-seq-len-override
    cannot see the model): the trained length from max_position_embeddings, or what its RoPE
    scaling extends it to."""
    trained = mc.max_position_embeddings
    rope = mc.rope or {}
    factor = rope.get("factor")
    scaled = None
    if rope.get("rope_type", "default") != "default" and isinstance(factor, (int, float)) and factor > 1:
        scaled = int(int(rope.get("original_max_position_embeddings") or trained) * factor)
    limit = max(trained, scaled or 0)
    if max_model_len <= limit:
        return None
    scaling = (f"; its RoPE scaling ({rope.get('rope_type')}, factor {factor}) extends that to {scaled}"
               if scaled else "; it has no RoPE scaling")
    return (f"max_model_len {max_model_len} exceeds the context this model was trained for: "
            f"max_position_embeddings is {trained}{scaling}. Positions past {limit} are untrained "
            f"and outputs there may be garbage")


class RequestError(ValueError):
    """A request the engine cannot run (too long, bad ids); `param` names the culprit."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class RequestDelta:
    """What one step produced for one request."""
    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | None = None      # per new token: (logprob, [(id, logprob)]) or None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prefill: dict | None = None        # with instrument_prefill, on the finishing delta
    # With params.prompt_logprobs, on the first delta: per prompt token, None (the first) or
    # (logprob, [(id, logprob)] top-n).
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0         # prompt tokens taken from the prefix cache
    num_cache_created_tokens: int = 0  # prompt tokens this request added to the prefix cache


@dataclasses.dataclass
class StepPlan:
    """What one step computes, fixed on the loop thread before the forward runs."""
    scheduled: list[ScheduledChunk]
    chunks: list[SeqChunk]
    sampling: list[Request]          # the requests that sample, in row order
    rows: list[SampleRow]
    bitmask: object                  # the grammar masks of the constrained rows, or None
    all_logits: bool                 # a request wants prompt logprobs
    t0: float


@dataclasses.dataclass
class StepResult:
    sampled: object                  # sampler.SampleResult, or None when nothing samples
    prompt_logprobs: list            # [(request, values to append)]


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    tokens_generated: int = 0
    prompt_tokens_computed: int = 0
    max_batch_seqs: int = 0            # the most sequences one forward carried
    last_step_s: float = 0.0


class PrefillTimer:
    """FREETOKEN_INSTRUMENT_PREFILL: times each forward that carries prefill tokens (CUDA
    events on the GPU, a monotonic clock on the CPU) and charges it to every request that
    prefilled in it, summed across chunks. A forward shared by several prefilling requests
    is marked shared rather than split, since how to divide it is not knowable."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def run(self, runner, chunks, scheduled, all_logits: bool = False):
        prefilling = [s.request for s in scheduled
                      if s.request.num_computed_tokens < s.request.num_prompt_tokens]
        if not prefilling:
            return runner.run(chunks, all_logits=all_logits)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = runner.run(chunks, all_logits=all_logits)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            logits = runner.run(chunks, all_logits=all_logits)
            seconds = time.perf_counter() - t0
        tokens = {id(s.request): s.num_tokens for s in scheduled}
        for req in prefilling:
            req.prefill_s += seconds
            req.prefill_tokens += tokens[id(req)]
            req.prefill_shared |= len(prefilling) > 1
        return logits


class EngineCore:
    def __init__(self, runner: ModelRunner, tokenizer, scheduler_config: SchedulerConfig,
                 instrument_prefill: bool = False):
        self.runner = runner
        self.prefill_timer = PrefillTimer(runner.device) if instrument_prefill else None
        self.tokenizer = tokenizer
        scheduler_config = self._resolve_slots(
            self._resolve_prefix_caching(scheduler_config, runner), runner)
        self.scheduler = Scheduler(scheduler_config, runner.allocator, runner.kv.slots)
        self.requests: dict[str, Request] = {}
        self.streams: dict[str, TextStream] = {}
        # request id -> output tokens the sampler must pick first (scripted output, for tests)
        self.forced: dict[str, list[int]] = {}
        self.stats = EngineStats()
        self.eos_ids = set(runner.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.vocab_size = runner.model_config.vocab_size
        self.max_model_len = runner.max_model_len
        warning = context_warning(runner.model_config, self.max_model_len)
        if warning:
            log.warning("%s", warning)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_ids) \
            if tokenizer is not None else None
        self._ids = itertools.count()

    @staticmethod
    def _resolve_prefix_caching(config: SchedulerConfig, runner) -> SchedulerConfig:
        """Prefix caching stays on only where every layer's cache is attention KV."""
        reason = unsupported_reason(runner.cache_specs) if config.enable_prefix_caching else None
        if reason is None:
            return config
        log.info("prefix caching off: %s", reason)
        return dataclasses.replace(config, enable_prefix_caching=False)

    @staticmethod
    def _resolve_slots(config: SchedulerConfig, runner) -> SchedulerConfig:
        """Hybrid models: no more running requests than state slots (each holds one)."""
        slots = runner.kv.slots
        if slots is None or config.max_running_requests <= slots.num_slots:
            return config
        log.info("max_running_requests %d lowered to %d: each running request holds one of the "
                 "%d linear-attention state slots", config.max_running_requests, slots.num_slots,
                 slots.num_slots)
        return dataclasses.replace(config, max_running_requests=slots.num_slots)

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, forced_token_ids: list[int] | None = None) -> Request:
        self.check_prompt(prompt_token_ids, params.max_tokens)
        n = len(prompt_token_ids)
        room = self.max_model_len - n
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}")
        bias = params.logit_bias or {}
        bad = [t for t in bias if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"logit_bias names token {bad[0]}, outside the vocabulary "
                               f"(0..{self.vocab_size - 1})", "logit_bias")
        req = Request(request_id, prompt_token_ids, params, params.max_tokens or room)
        if params.structured_outputs is not None:
            req.grammar = self._compile(params.structured_outputs)
        self.requests[request_id] = req
        if forced_token_ids:
            self.forced[request_id] = list(forced_token_ids)
        if self.tokenizer is not None:
            self.streams[request_id] = TextStream(self.tokenizer, params)
        self.scheduler.add(req)
        return req

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None,
                     room_to_generate: bool = True) -> None:
        """Raises RequestError when the prompt cannot run: empty, ids outside the vocabulary,
        or longer than the context allows (with max_tokens, when given)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]!r} is outside the vocabulary (0..{self.vocab_size - 1})",
                               "prompt")
        if n > self.max_model_len or (room_to_generate and n == self.max_model_len):
            raise RequestError(f"the prompt has {n} tokens; this model's context is {self.max_model_len} "
                               f"tokens" + (", which leaves no room to generate" if room_to_generate else ""),
                               "messages")
        if max_tokens is not None and max_tokens > self.max_model_len - n:
            raise RequestError(f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds "
                               f"the model's context of {self.max_model_len} tokens", "max_tokens")

    def _compile(self, spec):
        if self.grammars is None:
            raise RequestError("structured outputs need the tokenizer (this engine has none)", spec.param)
        try:
            return self.grammars.compile(spec)
        except GrammarError as e:
            raise RequestError(str(e), e.param) from None

    def abort(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.finish(FinishReason.ABORT)
        req.grammar = None
        self.streams.pop(request_id, None)
        self.forced.pop(request_id, None)
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One whole step on this thread (LLM.generate, warmup)."""
        plan = self.plan_step()
        return [] if plan is None else self.finish_step(plan, self.run_step(plan))

    # The server splits the step across two threads: plan_step and finish_step touch request
    # state and run on the event loop; run_step is the forward and the sampler, reads only
    # the plan, and runs on the engine thread while the loop keeps serving sockets.
    def plan_step(self) -> StepPlan | None:
        """Schedule, lay out the chunks and build each sampling row (the loop's side)."""
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        sampling = [s.request for s in scheduled if s.samples]
        constrained = [(r.grammar, i) for i, r in enumerate(sampling)
                       if r.grammar is not None and r.grammar.active]
        # Prompt logprobs need every position's logits (only in steps that prefill such a request).
        all_logits = any(s.request.params.prompt_logprobs is not None
                         and s.request.num_computed_tokens < s.request.num_prompt_tokens for s in scheduled)
        return StepPlan(scheduled, [self._chunk(s) for s in scheduled], sampling,
                        [self._sample_row(r) for r in sampling],
                        self.grammars.fill(constrained, len(sampling)) if constrained else None,
                        all_logits, t0)

    def run_step(self, plan: StepPlan) -> StepResult:
        """The forward and the sampler: no request state is written here."""
        if self.prefill_timer is not None:
            logits = self.prefill_timer.run(self.runner, plan.chunks, plan.scheduled, plan.all_logits)
        else:
            logits = self.runner.run(plan.chunks, all_logits=plan.all_logits)
        prompt_lps = []
        if plan.all_logits:
            logits, prompt_lps = self._prompt_logprobs(plan.scheduled, logits)
        sampled = sample(logits, plan.rows, plan.bitmask) if plan.rows else None
        return StepResult(sampled, prompt_lps)

    def finish_step(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Append the sampled tokens, stop checks, text (the loop's side)."""
        for req, values in result.prompt_logprobs:
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None]
            req.prompt_logprobs += values
        deltas = self._postprocess(plan.scheduled, plan.sampling, result.sampled)
        self.stats.steps += 1
        self.stats.max_batch_seqs = max(self.stats.max_batch_seqs, len(plan.scheduled))
        self.stats.last_step_s = time.perf_counter() - plan.t0
        return deltas

    def _chunk(self, s: ScheduledChunk) -> SeqChunk:
        r = s.request
        start = r.num_computed_tokens
        return SeqChunk(r.token_ids(start, start + s.num_tokens), start, r.block_ids, s.samples,
                        -1 if r.state_slot is None else r.state_slot)

    def _prompt_logprobs(self, scheduled: list[ScheduledChunk], logits):
        """From a forward's logits [T, V] (every position): the prompt logprobs of the requests
        that ask, as (request, values to append), and the rows that sample, as run() returns
        them without all_logits. Position p's row scores prompt token p + 1; a recomputed
        (preempted) prompt is not scored twice."""
        rows, offset, found = [], 0, []
        for s in scheduled:
            req, start = s.request, s.request.num_computed_tokens
            n = req.params.prompt_logprobs
            if n is not None and start < req.num_prompt_tokens:
                first = len(req.prompt_logprobs or [None]) - 1   # the position scoring the next one
                last = min(start + s.num_tokens, req.num_prompt_tokens - 1)   # exclusive
                if first < last and first >= start:
                    targets = req.prompt_token_ids[first + 1:last + 1]
                    found.append((req, token_logprobs(
                        logits[offset + first - start:offset + last - start], targets, n)))
                elif req.prompt_logprobs is None:
                    found.append((req, []))
            offset += s.num_tokens
            if s.samples:
                rows.append(offset - 1)
        sampled = logits[torch.tensor(rows, device=logits.device)] if rows else logits[:0]
        return sampled, found

    def _postprocess(self, scheduled: list[ScheduledChunk], sampling: list[Request],
                     result) -> list[RequestDelta]:
        for s in scheduled:
            if not s.request.is_finished:      # aborted while its forward ran: nothing to add
                s.request.num_computed_tokens += s.num_tokens
                self.scheduler.cache_blocks(s.request)
                if s.request.num_output_tokens == 0:
                    self.stats.prompt_tokens_computed += s.num_tokens
        if not sampling:
            return []
        deltas = []
        now = time.monotonic()
        for req, token, lp in zip(sampling, result.token_ids, result.logprobs):
            if req.is_finished:
                continue
            req.output_token_ids.append(token)
            if req.grammar is not None:
                req.grammar.accept(token, req.output_token_ids)
            req.first_token_time = req.first_token_time or now
            self.stats.tokens_generated += 1
            deltas.append(self._advance(req, token, lp))
        return deltas

    def _sample_row(self, req: Request) -> SampleRow:
        banned = ()
        if req.num_output_tokens < req.params.min_tokens:
            banned = tuple(req.params.stop_token_ids) + (() if req.params.ignore_eos else tuple(self.eos_ids))
        forced = self.forced.get(req.request_id)
        n = req.num_output_tokens
        p = req.params
        return SampleRow(p, req.generator, banned,
                         forced[n] if forced is not None and n < len(forced) else None,
                         req.prompt_token_ids if p.repetition_penalty != 1.0 else (),
                         req.output_token_ids if p.has_penalties else ())

    def _advance(self, req: Request, token: int, lp) -> RequestDelta:
        """Stop checks for the new token, then its text."""
        p = req.params
        reason, stop = None, None
        if token in p.stop_token_ids:
            reason, stop = FinishReason.STOP, token
        elif not p.ignore_eos and token in self.eos_ids:
            reason, stop = FinishReason.STOP, token
        stream = self.streams.get(req.request_id)
        text = ""
        if stream is not None and reason is None:
            text, hit = stream.add(token)
            if hit is not None:
                reason, stop = FinishReason.STOP, hit
        if reason is None and req.grammar is not None and req.grammar.done:
            reason = FinishReason.STOP      # the constrained value is complete: only EOS could follow
        if reason is None and (req.num_output_tokens >= req.max_tokens
                               or req.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            if stream is not None and not isinstance(stop, str):
                text += stream.finish()   # a stop string already cut the text where it starts
            self._finish(req, reason, stop)
        return RequestDelta(req.request_id, [token], text, reason is not None,
                            reason.value if reason else None, stop,
                            [lp] if lp is not None else None,
                            req.num_prompt_tokens, req.num_output_tokens,
                            req.prefill_report() if reason is not None else None,
                            req.prompt_logprobs if req.num_output_tokens == 1 else None,
                            req.num_cached_tokens, req.num_cache_created_tokens)

    def _finish(self, req: Request, reason: FinishReason, stop) -> None:
        req.finish(reason, stop)
        req.grammar = None
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.streams.pop(req.request_id, None)
        self.forced.pop(req.request_id, None)
