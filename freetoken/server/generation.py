"""One chat generation, whatever the dialect: ChatRequest -> prompt -> engine -> parsed output.

Chat Completions, Responses and Messages each turn their body into a ChatRequest (chat
messages, tools in Chat Completions' shape, tool_choice, effort, sampling params) and then
share everything else: the family's template kwargs for the effort, the chat template, the
text forced at the start of the answer (an empty think block for effort "none" where the
template cannot turn thinking off; a tool call's header for tool_choice required or named),
the scripted output of FREETOKEN_DEBUG_SCRIPT, the engine request, and the OutputParser
that splits reasoning, answer text and tool calls out of the detokenized deltas. The
dialects only translate the resulting Events into their own JSON and SSE shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

from freetoken.engine.sampling_params import SamplingParams
from freetoken.scheduler.async_engine import EngineFailure
from freetoken.server.debug_script import follow_prompt
from freetoken.server.errors import HTTPError
from freetoken.server.reasoning import ReasoningParser
from freetoken.server.structured import place, tool_call_grammar
from freetoken.server.toolcalls import HarmonyParser, make_tool_parser
from freetoken.server.tools import Event


@dataclasses.dataclass
class ChatRequest:
    messages: list[dict]
    params: SamplingParams
    tools: list[dict] | None = None            # [{"type": "function", "function": {...}}]
    tool_choice: str | dict = "auto"           # auto | none | required | {"name": ...}
    effort: str | None = None                  # None: the template's default
    template_kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ToolCall:
    id: str          # "call_<hex>"; dialects re-prefix the hex as they need
    name: str
    arguments: str = ""


@dataclasses.dataclass
class Prompt:
    text: str            # the template's render
    prefix: str          # forced start of the answer: in the prompt ids, parsed as output
    token_ids: list[int]
    in_reasoning: bool   # the render leaves a think block open


def build_prompt(ctx, req: ChatRequest) -> Prompt:
    meta, tok = ctx.meta, ctx.tokenizer
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    kwargs = meta.template_kwargs(req.effort, req.template_kwargs)
    try:
        text = tok.apply_chat_template(template_messages(req.messages), tools=tools,
                                       add_generation_prompt=True, tokenize=False, **kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise HTTPError(400, f"cannot render the chat template: {e}", type="invalid_request_error",
                        param="messages") from None
    in_reasoning = meta.opens_reasoning(text)
    prefix = ""
    if req.effort == "none" and (meta.toggle is None or meta.toggle not in req.template_kwargs):
        prefix = meta.thinking_off_prefix(text)
    forced = _forced_call(req.tool_choice, meta, tools) if tools else ""
    if forced and in_reasoning and not prefix:       # a forced call skips the thinking
        prefix = "<|end|><|start|>assistant" if meta.harmony else "\n" + meta.think_end + "\n\n"
    strict = tool_call_grammar(tools, req.tool_choice, tok, bool(forced)) \
        if tools and meta.tool_format == "hermes" else None
    if req.params.structured_outputs is not None and not forced:
        req.params.structured_outputs = place(req.params.structured_outputs, meta, text, prefix)
    if strict is not None or forced:   # the answer is a tool call, not what response_format describes
        # A forced call starts the answer (no thinking, as with the header in the prompt); in
        # free text a strict call's grammar starts at the model's own <tool_call>.
        req.params.structured_outputs = strict if forced else place(strict, meta, text, prefix)
        forced = "" if strict is not None else forced    # a strict call's grammar writes its header
    prefix += forced
    if meta.markers_are_special:
        req.params.skip_special_tokens = False
    return Prompt(text, prefix, tok.encode(text + prefix), in_reasoning)


def _forced_call(tool_choice, meta, tools: list[dict]) -> str:
    """The start of a tool call in the model's own format, so the model must make one: up to
    the arguments for a named tool (or the only one), else up to the name."""
    if meta.tool_format is None or tool_choice in ("auto", "none"):
        return ""
    if tool_choice == "required" and len(tools) == 1:
        tool_choice = {"name": tools[0]["function"]["name"]}
    name = None if tool_choice == "required" else tool_choice["name"]
    return make_tool_parser(meta.tool_format, tools).forced_prefix(name)


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates read them (as vLLM passes them): an assistant tool
    call's arguments given as a JSON string become the object (templates iterate them or
    apply tojson); arguments that do not parse stay as sent."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and any(_string_args(c) for c in calls):
            m = {**m, "tool_calls": [_object_args(c) for c in calls]}
        out.append(m)
    return out


def _string_args(call) -> bool:
    fn = call.get("function") if isinstance(call, dict) else None
    return isinstance(fn, dict) and isinstance(fn.get("arguments"), str)


def _object_args(call):
    if not _string_args(call):
        return call
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**call["function"], "arguments": args}}


class OutputParser:
    """Reasoning first; then, in the answer, tool calls (when tools are in play) in the
    model's format. Harmony (gpt-oss) splits both at once, by channel."""

    def __init__(self, meta, in_reasoning: bool = False, tool_names=None, prompt: str = ""):
        """tool_names: the request's tools (Chat Completions dicts, or names); None: none."""
        self.harmony = HarmonyParser(tool_names if meta.tool_format == "gpt_oss" else None,
                                     reasoning=meta.reasoning_parser == "gpt_oss", prompt=prompt) \
            if meta.harmony else None
        self.reasoning = ReasoningParser(meta.think_start, meta.think_end, in_reasoning) \
            if meta.reasoning and not meta.harmony else None
        self.tools = make_tool_parser(meta.tool_format, tool_names) \
            if tool_names is not None and meta.tool_format and not meta.harmony else None

    @property
    def in_reasoning(self) -> bool:
        if self.harmony is not None:
            return self.harmony.in_reasoning
        return self.reasoning is not None and self.reasoning.in_reasoning

    def feed(self, text: str) -> list[Event]:
        if self.harmony is not None:
            return self._merge(self.harmony.feed(text))
        pieces = self.reasoning.feed(text) if self.reasoning else [("content", text)]
        return self._route(pieces)

    def _merge(self, events) -> list[Event]:
        out: list[Event] = []
        _extend(out, events)
        return out

    def finish(self) -> list[Event]:
        if self.harmony is not None:
            return self._merge(self.harmony.finish())
        events = self._route(self.reasoning.finish() if self.reasoning else [])
        if self.tools is not None:
            _extend(events, self.tools.finish())
        return events

    def _route(self, pieces) -> list[Event]:
        out: list[Event] = []
        for kind, text in pieces:
            if kind == "content" and self.tools is not None:
                _extend(out, self.tools.feed(text))
            else:
                _extend(out, [Event(kind, text)])
        return out


def _extend(out: list[Event], events: list[Event]) -> None:
    for e in events:
        if e.kind in ("content", "reasoning") and not e.text:
            continue
        if e.kind in ("content", "reasoning") and out and out[-1].kind == e.kind:
            out[-1] = Event(e.kind, out[-1].text + e.text)
        else:
            out.append(e)


@dataclasses.dataclass
class Step:
    events: list[Event]
    delta: object        # the engine's RequestDelta (token ids, logprobs, finished)


class Generation:
    """A running chat request: iterate `steps()` (streaming) or await `collect()`; either way
    the totals (content, reasoning, tool_calls, finish_reason, token counts) add up here."""

    def __init__(self, stream, parser: OutputParser, prefix: str = ""):
        self.stream = stream
        self.parser = parser
        self.num_prompt_tokens = stream.num_prompt_tokens
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []
        self.finish_reason: str | None = None
        self.stop_reason = None            # the stop string or token id that ended it
        self.num_output_tokens = 0
        self.num_reasoning_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.prefill: dict | None = None
        self.prompt_logprobs: list | None = None   # with params.prompt_logprobs
        self.num_cached_tokens = 0          # prompt tokens served by the prefix cache
        self.num_cache_created_tokens = 0   # prompt tokens this request added to it
        self._pending = parser.feed(prefix) if prefix else []

    async def steps(self, ping_s: float | None = None):
        """Yield a Step per engine delta, or None after ping_s seconds without one. An engine
        failure raises HTTPError 500 with the engine's words (a stream turns it into its
        dialect's error event)."""
        try:
            while True:
                try:
                    async with asyncio.timeout(ping_s):
                        d = await self.stream.__anext__()
                except TimeoutError:
                    yield None
                    continue
                except StopAsyncIteration:
                    return
                except EngineFailure as e:   # a step that carried it failed, or shutdown
                    raise HTTPError(503 if e.unavailable else 500, str(e), type="server_error") from e
                yield self._take(d)
                if d.finished:
                    return
        finally:
            if not self.stream.finished:
                self.stream.abort()

    async def stream_to(self, response, ping_s: float | None, ping: bytes, render, error) -> bool:
        """Write render(step) for every step, `ping` after ping_s seconds without one, until
        the generation ends: True, and the caller writes its dialect's closing events. False
        when the client left, or when the engine failed: then `error(exc)`, the dialect's
        error event, has been written and the stream ended."""
        try:
            async for step in self.steps(ping_s):
                out = ping if step is None else render(step)
                if out:
                    await response.write(out)
                if response.disconnected:
                    return False
        except Exception as e:   # the engine failed mid-stream: tell the client, end the stream
            await response.write(error(e))
            response.end_stream()
            return False
        return True

    async def collect(self) -> "Generation":
        async for _ in self.steps():
            pass
        return self

    def _take(self, d) -> Step:
        was_reasoning = self.parser.in_reasoning
        events, self._pending = self._pending, []
        _extend(events, self.parser.feed(d.text))
        if d.finished:
            _extend(events, self.parser.finish())
        self.num_output_tokens = d.num_output_tokens
        self.token_ids.extend(d.new_token_ids)
        self.logprobs.extend(d.logprobs or [])
        self.prefill = d.prefill or self.prefill
        if getattr(d, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.num_cached_tokens = d.num_cached_tokens
        self.num_cache_created_tokens = d.num_cache_created_tokens
        if was_reasoning or any(e.kind == "reasoning" for e in events):
            self.num_reasoning_tokens += len(d.new_token_ids)
        for e in events:
            self._record(e)
        if d.finished:
            self.stop_reason = d.stop_reason
            self.finish_reason = "tool_calls" if d.finish_reason == "stop" and self.tool_calls \
                else d.finish_reason
        return Step(events, d)

    def _record(self, e: Event) -> None:
        if e.kind == "content":
            self.content += e.text
        elif e.kind == "reasoning":
            self.reasoning += e.text
        elif e.kind == "tool_start":
            e.id = e.id or f"call_{uuid.uuid4().hex[:24]}"     # Kimi's ids are the model's own
            self.tool_calls.append(ToolCall(e.id, e.name))
        elif e.kind == "tool_args":
            self.tool_calls[e.index].arguments += e.text


# Conversations longer than this render and tokenize on a worker thread (jinja2 and the
# tokenizers library release the loop; a 10 MB body took seconds on the loop's own thread).
OFF_LOOP_CHARS = 32_768


def input_chars(messages: list[dict], tools: list | None = None) -> int:
    """About how much text a request carries (its messages' contents and its tools)."""
    total = len(str(tools)) if tools else 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else m
        total += len(content) if isinstance(content, str) else len(str(content))
    return total


async def off_loop(size: int, fn, *args):
    """fn(*args) here when small, else on a worker thread so the event loop keeps serving."""
    if size < OFF_LOOP_CHARS:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def prepare_prompt(ctx, req: ChatRequest) -> Prompt:
    return await off_loop(input_chars(req.messages, req.tools), build_prompt, ctx, req)


async def start_generation(ctx, req: ChatRequest) -> tuple[Generation, Prompt]:
    """Render, submit and return the running Generation (HTTPError 400 if it cannot run)."""
    gens, prompt = await start_generations(ctx, req, 1)
    return gens[0], prompt


async def start_generations(ctx, req: ChatRequest, n: int) -> tuple[list[Generation], Prompt]:
    """n samples of one chat request (one render; seed + j for sample j when seeded)."""
    prompt = await prepare_prompt(ctx, req)
    gens: list[Generation] = []
    try:
        for j in range(n):
            params = req.params if n == 1 else sample_params(req.params, j)
            gens.append(_submit(ctx, req, prompt, params))
    except BaseException:
        for g in gens:
            g.stream.abort()
        raise
    return gens, prompt


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sample j's params: a copy, its seed offset by j so seeded samples differ."""
    seed = None if params.seed is None else (params.seed + j + 2**63) % 2**64 - 2**63
    return dataclasses.replace(params, seed=seed)


def _submit(ctx, req: ChatRequest, prompt: Prompt, params: SamplingParams) -> Generation:
    forced = None
    if ctx.script is not None:
        scripted = ctx.script.lookup(req.messages)
        if scripted is not None:
            text = follow_prompt(scripted, ctx.meta, prompt.text, prompt.prefix)
            eos = ctx.tokenizer.eos_token_id
            forced = ctx.tokenizer.encode(text) + ([eos] if eos is not None else [])
    stream = ctx.submit(prompt.token_ids, params, forced)
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    parser = OutputParser(ctx.meta, prompt.in_reasoning, tools, prompt.text)
    return Generation(stream, parser, prompt.prefix)
