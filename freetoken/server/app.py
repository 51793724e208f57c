"""ServingApp: the served model's state and the routes of `ft serve`.

The HTTP server answers from the moment its socket is bound; the model loads in a worker
thread meanwhile, with /health reporting the phase and bytes loaded. Every /v1 route (and
/tokenize, /detokenize) passes one guard first: the API key (when one is set), then readiness
(503 while loading).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time

import freetoken
from freetoken.engine.config import EngineConfig
from freetoken.scheduler.async_engine import AsyncEngine, RequestStream, engine_thread
from freetoken.scheduler.config import SchedulerConfig
from freetoken.scheduler.core import EngineCore, RequestError
from freetoken.server.anthropic.messages import count_tokens, messages
from freetoken.server.config import ServerConfig
from freetoken.server.errors import HTTPError
from freetoken.server.http import Router
from freetoken.server.model_meta import ModelMeta
from freetoken.server.openai.chat import chat_completions
from freetoken.server.openai.completions import completions
from freetoken.server.openai.responses import responses
from freetoken.server.tokenize import detokenize, tokenize
from freetoken.server.progress import LoadProgress
from freetoken.utils import env

log = logging.getLogger("freetoken.server")


class ServingApp:
    def __init__(self, server: ServerConfig, engine: EngineConfig, scheduler: SchedulerConfig):
        self.server_config = server
        self.engine_config = engine
        self.scheduler_config = scheduler
        self.status = "loading"          # loading -> ok | error
        self.phase = "starting"
        self.done_bytes = 0
        self.total_bytes = 0
        self.error: str | None = None
        self.engine: AsyncEngine | None = None
        self.tokenizer = None
        self.meta = ModelMeta()          # the family's chat conventions, resolved at load
        self.script = None               # FREETOKEN_DEBUG_SCRIPT (tests only)
        self.max_model_len = 0
        self.started = time.time()
        self.keep_resident = None
        self.warmup_report: dict | None = None
        self.load_progress = LoadProgress()
        self.router = self._routes()

    # -- loading --------------------------------------------------------------------------
    async def load(self) -> bool:
        """Load the model off the event loop, then start the engine loop on it. False when
        loading failed: /health then says why, and the caller exits non-zero."""
        thread = engine_thread()        # the engine's own: see engine_thread
        try:
            core = await asyncio.get_running_loop().run_in_executor(thread, self._load_blocking)
        except Exception as e:  # noqa: BLE001 - reported on /health and in one paragraph
            thread.shutdown(wait=False)
            self.status, self.error = "error", f"{type(e).__name__}: {e}"
            log.error("%s", load_failure_paragraph(self.engine_config.model, e))
            if not isinstance(e, EXPECTED_LOAD_ERRORS):
                log.error("the traceback of that unexpected error:", exc_info=e)
            return False
        self.engine = AsyncEngine(core, step_delay_s=env.debug_step_delay_s(), thread=thread)
        self.engine.start()
        self.status, self.phase = "ok", "ready"
        log.info("ready: serving %s (context %d tokens)", self.server_config.served_model_name,
                 self.max_model_len)
        return True

    def _load_blocking(self) -> EngineCore:
        from freetoken.engine.model_runner import ModelRunner
        from freetoken.tokenizer import Tokenizer

        from freetoken.models.loader import resolve_model_path
        from freetoken.utils.prefetch import prefetch_checkpoint

        self.phase = "loading weights"
        delay = env.debug_load_delay_s()
        if delay:
            time.sleep(delay)
        self.keep_resident = prefetch_checkpoint(resolve_model_path(self.engine_config.model),
                                                 env.keep_resident_s(), at_boot=env.prefetch_model())
        runner = ModelRunner(self.engine_config, progress=self._progress)
        self.phase = "loading tokenizer"
        self.tokenizer = Tokenizer.from_dir(runner.model_dir)
        self._resolve_chat(runner.model_config.model_type)
        self.max_model_len = runner.max_model_len
        core = EngineCore(runner, self.tokenizer, self.scheduler_config,
                          instrument_prefill=env.instrument_prefill())
        if core.grammars is not None:
            core.grammars.warm()          # off the event loop: ~1 s for a 150k-token vocabulary
        self._warmup(core)
        self.load_progress.close()
        return core

    def _resolve_chat(self, model_type: str) -> None:
        from freetoken.server import model_meta
        from freetoken.server.debug_script import DebugScript

        try:
            template = self.tokenizer.get_chat_template()
        except ValueError:      # no template: the chat routes answer 400, completions still work
            template = ""
        if isinstance(self.tokenizer.chat_template, dict):     # named templates: all of them say
            template = "\n".join([template, *self.tokenizer.chat_template.values()])  # the formats
        self.meta = model_meta.resolve(model_type, template, self.server_config.reasoning_parser,
                                       set(self.tokenizer.all_special_tokens),
                                       self.server_config.tool_call_parser)
        log.info("parsers (%s): reasoning %s, tool calls %s", self.meta.chosen_by,
                 self.meta.reasoning_parser or "off", self.meta.tool_format or "none")
        log.info("chat conventions: %s", ", ".join(f"{k}={v}" for k, v in self.meta.describe().items()))
        path = env.debug_script()
        if path is not None:
            self.script = DebugScript.load(path)
            log.warning("FREETOKEN_DEBUG_SCRIPT=%s: scripted output for %d triggers (tests only)",
                        path, len(self.script.entries))

    def _warmup(self, core: EngineCore) -> None:
        """Compile and tune every kernel shape class before readiness (on by default on CUDA,
        where Triton compiles; the CPU runs torch references with nothing to compile)."""
        from freetoken.scheduler.core import EngineStats
        from freetoken.scheduler.warmup import run_warmup

        enabled = env.prefill_warmup()
        if enabled is False:
            log.info("warmup skipped: FREETOKEN_PREFILL_WARMUP=0")
            return
        if enabled is None and core.runner.device.type != "cuda":
            log.info("warmup skipped: the %s device runs torch references, with no kernels to compile "
                     "(FREETOKEN_PREFILL_WARMUP=1 forces it)", core.runner.device.type)
            return
        try:
            self.warmup_report = run_warmup(core, env.warmup_max_depth(), self._set_phase)
        except Exception:   # noqa: BLE001 - a failed warmup costs speed, not service
            log.exception("warmup failed; serving anyway (first requests may compile kernels)")
        core.stats = EngineStats()
        if getattr(core.runner, "moe", None) is not None:
            core.runner.moe.reset_counters()     # report serving traffic, not the ladder's

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.load_progress.phase(phase)

    def _progress(self, done: int, total: int) -> None:
        self.done_bytes, self.total_bytes = done, total
        self.load_progress.bytes(done, total)

    async def shutdown(self, timeout_s: float) -> None:
        if self.engine is not None:
            await self.engine.shutdown(timeout_s)
            moe = getattr(self.engine.core.runner, "moe", None)
            if moe is not None:
                moe.close()                      # writes --moe-trace's recording
        if self.keep_resident is not None:
            self.keep_resident.stop()

    # -- shared by the dialects -------------------------------------------------------------
    def check_model(self, body: dict) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        name = body.get("model")
        served = self.server_config.served_model_name
        if name is None:
            return served
        if not isinstance(name, str):
            raise HTTPError(400, "'model' must be a string", type="invalid_request_error", param="model")
        if name not in (served, self.server_config.model_path):
            raise HTTPError(404, f"The model '{name}' does not exist; this server serves '{served}'",
                            type="invalid_request_error", param="model", code="model_not_found")
        return name

    def submit(self, prompt_ids: list[int], params, forced_token_ids=None) -> RequestStream:
        try:
            return self.engine.submit(prompt_ids, params, forced_token_ids=forced_token_ids)
        except RequestError as e:
            raise HTTPError(400, str(e), type="invalid_request_error", param=e.param) from None

    # -- routes ---------------------------------------------------------------------------
    def _routes(self) -> Router:
        r = Router()
        r.set_cors(self.server_config.allowed_origins)
        r.add("GET", "/", self.root)
        r.add("GET", "/health", self.health)
        r.add("GET", "/v1/models", self.models)
        r.add("GET", "/v1/models/{id:path}", self.model)
        r.add("GET", "/v1/stats", self.stats)
        r.add("GET", "/metrics", self.metrics)
        r.add("GET", "/v1/instrumentation", self.instrumentation)
        r.add("POST", "/v1/chat/completions", lambda req, resp: chat_completions(self, req, resp))
        r.add("POST", "/v1/completions", lambda req, resp: completions(self, req, resp))
        r.add("POST", "/v1/responses", lambda req, resp: responses(self, req, resp))
        r.add("POST", "/v1/messages", lambda req, resp: messages(self, req, resp), dialect="anthropic")
        r.add("POST", "/v1/messages/count_tokens", lambda req, resp: count_tokens(self, req, resp),
              dialect="anthropic")
        r.add("POST", "/tokenize", lambda req, resp: tokenize(self, req, resp))
        r.add("POST", "/detokenize", lambda req, resp: detokenize(self, req, resp))
        for prefix in ("/v1/", "/tokenize", "/detokenize"):
            r.set_guard(prefix, self.guard)
        return r

    async def guard(self, request) -> None:
        key = self.server_config.api_key
        if key:
            auth = request.headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), key.encode()):
                raise HTTPError(401, "Incorrect or missing API key", type="invalid_request_error",
                                code="invalid_api_key")
        if self.status == "error":
            raise HTTPError(503, f"The model failed to load: {self.error}", type="service_unavailable")
        if self.status != "ok":
            raise HTTPError(503, f"The model is loading ({self.phase}); retry shortly",
                            type="service_unavailable", code="model_loading")

    async def health(self, request, response) -> None:
        if self.status == "error":
            response.send_json(503, {"status": "error", "detail": self.error})
        elif self.status == "loading":
            response.send_json(200, {"status": "loading", "phase": self.phase, "progress": {
                "done_bytes": self.done_bytes, "total_bytes": self.total_bytes}})
        else:
            response.send_json(200, {"status": "ok", "model": self.server_config.served_model_name,
                                     "uptime_s": round(time.time() - self.started, 1)})

    async def metrics(self, request, response) -> None:
        """Prometheus text format; scrapers need no key, like /health."""
        body = self.engine.metrics.registry.render() if self.engine else b""
        response.send_bytes(200, body, "text/plain; version=0.0.4; charset=utf-8")

    async def instrumentation(self, request, response) -> None:
        """The resolved configuration, read back off the live objects, and live counters."""
        import torch

        import triton_kernels

        runner = self.engine.core.runner
        alloc = runner.allocator
        body = {
            "model": {"served_name": self.server_config.served_model_name, "path": str(runner.model_dir),
                      "architectures": list(runner.model_config.architectures),
                      "dtype": str(runner.dtype).removeprefix("torch."),
                      "max_model_len": runner.max_model_len,
                      "weights": runner.quant_report()},
            "device": {"type": runner.device.type, "name": str(runner.device),
                       "gpu": _gpu_identity(runner.device),
                       "torch": torch.__version__, "triton": _triton_version(),
                       "cpu_threads": torch.get_num_threads()},
            "freetoken": {"version": freetoken.__version__, "git_commit": _git_commit()},
            "kernels": {"backend": self.engine.core.runner.config.kernel_backend,
                        "cpu_decode_program": runner.cpu_graph_report()},
            "kv_cache": {"blocks": alloc.num_blocks, "block_size": alloc.block_size,
                         "tokens": alloc.num_blocks * alloc.block_size, "free_blocks": alloc.num_free,
                         "bytes_per_token": runner.kv.bytes_per_token,
                         "layers": runner.kv.describe()},
            "state_slots": runner.kv.slots_report(),
            "scheduler": {"max_prefill_length": self.scheduler_config.max_prefill_length,
                          "max_step_time_s": self.scheduler_config.max_step_time_s,
                          "step_cost": (self.engine.core.scheduler.step_budget.describe()
                                        if self.engine.core.scheduler.step_budget else None),
                          # resolved: a hybrid model lowers it to its state slots
                          "max_running_requests": self.engine.core.scheduler.config.max_running_requests},
            "prefix_cache": prefix_cache_report(self.engine.core, self.scheduler_config),
            "warmup": self.warmup_report,
            "chat": self.meta.describe(),
        }
        moe_report = getattr(runner, "moe_report", None)
        if moe_report is not None:
            body["moe"] = moe_report()
        response.send_json(200, body)

    def _model_card(self) -> dict:
        return {"id": self.server_config.served_model_name, "object": "model", "created": int(self.started),
                "owned_by": "freetoken", "root": self.server_config.model_path,
                "max_model_len": self.max_model_len, "reasoning_efforts": self.meta.efforts,
                "reasoning_parser": self.meta.reasoning_parser if self.meta.reasoning else None,
                "tool_call_format": self.meta.tool_format, "tool_call_parser": self.meta.tool_format}

    async def models(self, request, response) -> None:
        response.send_json(200, {"object": "list", "data": [self._model_card()]})

    async def model(self, request, response) -> None:
        """GET /v1/models/{id}: the served model by its name (or its path), else 404."""
        self.check_model({"model": request.path_rest})
        response.send_json(200, self._model_card())

    async def root(self, request, response) -> None:
        """GET / (and HEAD /, as load balancers probe): who this is, and where to look."""
        response.send_json(200, {"server": "freetoken", "version": freetoken.__version__,
                                 "status": self.status, "model": self.server_config.served_model_name,
                                 "endpoints": ["/health", "/v1/models", "/v1/chat/completions",
                                               "/v1/completions", "/v1/responses", "/v1/messages"]})

    async def stats(self, request, response) -> None:
        core = self.engine.core
        alloc = core.runner.allocator
        response.send_json(200, {
            "running": self.engine.num_running, "waiting": self.engine.num_waiting,
            "kv_blocks_total": alloc.num_blocks, "kv_blocks_free": alloc.num_free,
            "kv_block_size": alloc.block_size, "kv_blocks_cached": alloc.num_cached,
            "prefix_cache_hit_tokens": alloc.prefix.stats.hit_tokens,
            "prefix_cache_queried_tokens": alloc.prefix.stats.queried_tokens,
            "tokens_generated": core.stats.tokens_generated,
            "prompt_tokens_computed": core.stats.prompt_tokens_computed,
            "steps": core.stats.steps, "max_batch_seqs": core.stats.max_batch_seqs,
            "preemptions": core.scheduler.num_preemptions,
            "recent_requests": list(self.engine.recent),
        })


def prefix_cache_report(core, requested) -> dict:
    """On or off (requested: the flag; enabled: after the model's cache kinds had their say),
    and the cache's size now (counters). The KV pool is the cache: its capacity is kv_cache's
    blocks, not repeated here so that arms differing in KV size differ in one place."""
    alloc = core.runner.allocator
    stats = alloc.prefix.stats
    return {"enabled": core.scheduler.caching, "requested": requested.enable_prefix_caching,
            "block_size": alloc.block_size, "capacity": "kv_cache.blocks",
            "counters": {"cached_blocks": alloc.prefix.num_hashed, "idle_blocks": alloc.num_cached,
                         "cached_tokens": alloc.prefix.num_hashed * alloc.block_size,
                         "queried_tokens": stats.queried_tokens, "hit_tokens": stats.hit_tokens,
                         "hit_rate": stats.hit_rate}}


def _triton_version() -> str | None:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


@functools.lru_cache(maxsize=1)
def _git_commit() -> str | None:
    """The checkout's commit when FreeToken runs from one (an editable install), else None."""
    import subprocess
    from pathlib import Path

    root = Path(freetoken.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _gpu_identity(device) -> dict | None:
    if device.type != "cuda":
        return None
    import torch

    from freetoken.utils.device import gpu_uuid
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {"name": props.name, "uuid": gpu_uuid(index),
            "capability": f"{props.major}.{props.minor}", "memory_bytes": props.total_memory}


def _expected_load_errors() -> tuple[type[BaseException], ...]:
    from freetoken.models.config import ModelConfigError
    from freetoken.models.loader import CheckpointError
    from freetoken.models.registry import UnsupportedModelError
    from freetoken.moe.plan import MoePlanError
    return (CheckpointError, ModelConfigError, UnsupportedModelError, MoePlanError)


# Errors that describe the checkpoint or the machine, not a bug: their message is the news,
# so no traceback follows it.
EXPECTED_LOAD_ERRORS = _expected_load_errors()


def load_failure_paragraph(model: str, error: Exception) -> str:
    """What was asked, why it cannot load, and what to do, in one paragraph for the log."""
    from freetoken.models.config import ModelConfigError
    from freetoken.models.registry import UnsupportedModelError
    from freetoken.moe.plan import MoePlanError

    if isinstance(error, UnsupportedModelError):
        todo = "Serve a checkpoint of a supported family."
    elif isinstance(error, ModelConfigError):
        todo = "Check that the folder is a complete Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json)."
    elif isinstance(error, MoePlanError):
        todo = "Give the experts more memory or change the --moe-* flags (see README, Experts in RAM)."
    elif isinstance(error, EXPECTED_LOAD_ERRORS):
        todo = ("FreeToken serves a local checkpoint folder, or a hub id already in the Hugging Face "
                "cache (`hf download ORG/NAME` fetches one); it never downloads.")
    else:
        todo = "This looks like a bug in FreeToken: the traceback follows; please report it."
    return (f"cannot serve model {model!r}: {type(error).__name__}: {error}. {todo} "
            f"/health answers 503 with this error until the server exits with status 1.")
