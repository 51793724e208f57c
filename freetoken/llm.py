"""The offline Python API, with vLLM's names: LLM, SamplingParams, llm.generate, llm.logits.

    from freetoken import LLM, SamplingParams
    llm = LLM("path/or/org-name", device="cpu")
    out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    print(out[0].text)

generate() feeds every prompt to the same continuous-batching EngineCore that `ft serve`
runs, and steps it until all are done.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.model_runner import ModelRunner, SeqChunk
from freetoken.engine.sampling_params import SamplingParams
from freetoken.moe.config import MoeConfig, parse_cpu_layers
from freetoken.scheduler.config import SchedulerConfig
from freetoken.scheduler.core import EngineCore, RequestError


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None    # with SamplingParams.prompt_logprobs: None, then (lp, top, rank)

    @property
    def outputs(self):   # vLLM keeps the completion one level down; offer both spellings
        return [self]


# Keywords that have an `ft serve` flag, by the type that flag parses its text to: each also
# takes the flag's string form ("8", "0.5", "1,3", "false"), as the flag would.
_INT_KEYWORDS = ("max_model_len", "kv_cache_tokens", "max_prefill_length", "max_running_requests",
                 "moe_cache_size", "moe_cpu_threads", "moe_hybrid_k", "kv_reserve_tokens",
                 "max_state_slots")
_FLOAT_KEYWORDS = ("moe_cache_rate", "pin_budget_gb", "moe_lfu_decay")
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True,
               "false": False, "0": False, "no": False, "off": False}


def from_flag_text(name: str, value):
    """The Python value of keyword `name` given as its flag's text; other values pass as they
    are (the configs validate them)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if name in _INT_KEYWORDS:
            return int(text)
        if name in _FLOAT_KEYWORDS:
            return float(text)
    except ValueError:
        kind = "an integer" if name in _INT_KEYWORDS else "a number"
        raise ValueError(f"{name} must be {kind}, got {value!r}") from None
    if name == "moe_cpu_layers":
        return parse_cpu_layers(text)
    if name in ("enable_prefix_caching", "enforce_eager"):
        if text.lower() not in _BOOL_WORDS:
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return _BOOL_WORDS[text.lower()]
    return value


class LLM:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "auto",
                 skip_tokenizer_init: bool = False, max_model_len: int | None = None,
                 kv_cache_tokens: int | None = None, max_prefill_length: int = 2048,
                 max_running_requests: int = 64, block_size: int = 16,
                 kernel_backend: str = "auto", moe_backend: str = "auto",
                 moe_cache_size: int | None = None, moe_cache_rate: float | None = None,
                 moe_cache_policy: str = "lfu-decay", moe_cpu_layers=None,
                 moe_cpu_threads: int | None = None, moe_hybrid_k: int | None = None,
                 pin_budget_gb: float | None = None, kv_reserve_tokens: int = 8192,
                 moe_prefetch: str | bool = "auto", moe_lfu_decay: float = 0.9,
                 moe_trace: str | None = None, enable_prefix_caching: bool = True,
                 max_state_slots: int | None = None, enforce_eager: bool = False,
                 lm_head_dtype: str = "auto"):
        # moe_*: where the experts live and run (see freetoken.moe.config.MoeConfig).
        from freetoken.demo.builtin import DEMO_NAME, demo_model_path
        if model == DEMO_NAME:            # the demo's served name, as `ft serve` with no model serves it
            model = str(demo_model_path())
        # moe_trace is written when this LLM is collected or the interpreter exits, or by
        # llm.runner.moe.close(). enable_prefix_caching: share and keep the KV blocks of common
        # prompt prefixes (vLLM's name; on by default). max_state_slots: hybrid linear-attention
        # models' per-request state slots (None: from memory); max_running_requests is capped to it.
        # enforce_eager: a CPU engine runs the modules at every decode step, not its native
        # program (engine/cpu_graph.py; vLLM's name for going without CUDA graphs).
        # lm_head_dtype: "int8" reads a CPU engine's output layer in 8 bits (EngineConfig).
        f = from_flag_text
        moe = MoeConfig(backend=moe_backend, cache_size=f("moe_cache_size", moe_cache_size),
                        cache_rate=f("moe_cache_rate", moe_cache_rate),
                        cache_policy=moe_cache_policy,
                        cpu_layers=f("moe_cpu_layers", moe_cpu_layers),
                        cpu_threads=f("moe_cpu_threads", moe_cpu_threads),
                        hybrid_k=f("moe_hybrid_k", moe_hybrid_k),
                        pin_budget_gb=f("pin_budget_gb", pin_budget_gb),
                        kv_reserve_tokens=f("kv_reserve_tokens", kv_reserve_tokens),
                        prefetch=moe_prefetch, lfu_decay=f("moe_lfu_decay", moe_lfu_decay),
                        trace_path=moe_trace)
        self.engine_config = EngineConfig(
            model=model, device=device, dtype=dtype, max_model_len=f("max_model_len", max_model_len),
            kv_cache_tokens=f("kv_cache_tokens", kv_cache_tokens), block_size=block_size,
            max_state_slots=f("max_state_slots", max_state_slots),
            enforce_eager=f("enforce_eager", enforce_eager), lm_head_dtype=lm_head_dtype,
            skip_tokenizer_init=skip_tokenizer_init, kernel_backend=kernel_backend, moe=moe)
        self.runner = ModelRunner(self.engine_config)
        self.tokenizer = None
        if not skip_tokenizer_init:
            from freetoken.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_dir(self.runner.model_dir)
        self.engine = EngineCore(self.runner, self.tokenizer,
                                 SchedulerConfig(
                                     max_prefill_length=f("max_prefill_length", max_prefill_length),
                                     max_running_requests=f("max_running_requests",
                                                            max_running_requests),
                                     enable_prefix_caching=f("enable_prefix_caching",
                                                             enable_prefix_caching)))
        if moe_trace and self.runner.moe is not None:
            weakref.finalize(self, self.runner.moe.close)

    @property
    def model_config(self):
        return self.runner.model_config

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this LLM was made with skip_tokenizer_init=True: give token ids, not text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError("each prompt must be a string or a list of token ids")

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        encoded = [self._encode(p) for p in prompts]   # all checked before any is queued
        reqs = []
        try:
            for (_, ids), sp in zip(encoded, per_prompt):
                reqs.append(self.engine.add_request(ids, sp))
        except RequestError:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        texts = {r.request_id: [] for r in reqs}
        logprobs = {r.request_id: [] for r in reqs}
        prompt_lps = {}
        while self.engine.has_work:
            for d in self.engine.step():
                if d.request_id in texts:
                    texts[d.request_id].append(d.text)
                    if d.prompt_logprobs is not None:
                        prompt_lps[d.request_id] = d.prompt_logprobs
                    if d.logprobs:
                        logprobs[d.request_id].extend(d.logprobs)
        return [RequestOutput(r.request_id, text, r.prompt_token_ids, r.output_token_ids,
                              "".join(texts[r.request_id]),
                              r.finish_reason.value if r.finish_reason else None, r.stop_reason,
                              logprobs[r.request_id] if r.params.logprobs is not None else None,
                              prompt_lps.get(r.request_id))
                for r, (text, _) in zip(reqs, encoded)]

    @torch.inference_mode()
    def logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Float32 logits [T, vocab] for every position of `token_ids`, computed through the
        engine's paged-KV forward (optionally in prefill chunks of chunk_size)."""
        self.engine.check_prompt(list(token_ids), None, room_to_generate=False)
        alloc, slots = self.runner.allocator, self.runner.kv.slots
        n = len(token_ids)
        if slots is not None and not slots.can_allocate():
            raise RuntimeError("logits() needs a free linear-attention state slot: every one is "
                               "held by a running request")
        blocks = alloc.allocate(alloc.blocks_for(n))
        slot = slots.allocate() if slots is not None else -1
        try:
            step = chunk_size or n
            rows = [self.runner.run([SeqChunk(list(token_ids[s:s + step]), s, blocks, True, slot)],
                                    all_logits=True) for s in range(0, n, step)]
        finally:
            alloc.free(blocks)
            if slots is not None:
                slots.free(slot)
        return torch.cat(rows).cpu()
