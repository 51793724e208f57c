"""Arms: what generates. `UrlArm` is any OpenAI-compatible server by URL (a `ft serve`, a
llama.cpp server, vLLM); `LaunchedArm` is a `ft serve` the harness starts with given flags and
stops at the end (one FreeToken configuration); `TransformersArm` (transformers_arm.py) runs
transformers in-process.

Every arm answers the same questions: can it run (`preflight`), what is it (`provenance`,
with the dotted names of what it could not record), what is its configuration right now
(`config_snapshot`, compared before and after every block), and `generate` one request.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import tempfile
import time

from bench.harness import client, provenance
from bench.harness.validity import Reason


class UrlArm:
    kind = "url"

    def __init__(self, name: str, url: str, api_key: str | None = None, model: str | None = None):
        self.name = name
        self.endpoint = client.Endpoint.parse(url)
        self.api_key = api_key
        self.model = model
        self.is_freetoken = False

    def describe(self) -> dict:
        return {"kind": self.kind, "url": self.endpoint.base, "model": self.model}

    def _get(self, path: str):
        return client.get_json(self.endpoint.base, path, self.api_key)

    def preflight(self) -> list[Reason]:
        status, body = self._get("/health")
        if status is None:
            return [Reason("SERVER_UNAVAILABLE", f"{self.endpoint.base} is unreachable: {body}", arm=self.name)]
        if status == 404:       # servers without /health: ready when they list their models
            status, body = self._get("/v1/models")
        if status != 200 or isinstance(body, dict) and body.get("status") not in (None, "ok"):
            return [Reason("SERVER_UNAVAILABLE", f"not ready: HTTP {status} {str(body)[:200]}", arm=self.name)]
        if self.model is None:
            status, models = self._get("/v1/models")
            data = models.get("data") if isinstance(models, dict) else None
            if status != 200 or not data:
                return [Reason("SERVER_UNAVAILABLE", f"/v1/models answered HTTP {status}; give --model",
                               arm=self.name)]
            self.model = data[0]["id"]
        return []

    def supports(self, workload, concurrency: int) -> str | None:
        return None

    def provenance(self, harness: dict) -> dict:
        """The server's own account of itself. /v1/instrumentation is FreeToken's resolved
        configuration; without it the model's identity falls back to /v1/models and /health."""
        inst_status, inst = self._get("/v1/instrumentation")
        models_status, models = self._get("/v1/models")
        health_status, health = self._get("/health")
        extra = {p: body for p, (s, body) in ((p, self._get(p)) for p in ("/version", "/props")) if s == 200}
        self.is_freetoken = inst_status == 200 and isinstance(inst, dict)
        listed = (models.get("data") or [{}])[0] if isinstance(models, dict) else {}
        if self.is_freetoken:
            path, source = inst.get("model", {}).get("path"), "/v1/instrumentation"
            device = inst.get("device", {})
        else:
            path, source, device = listed.get("root"), "/v1/models", {}
        sha = provenance.model_config_sha256(path)
        gpu = self._gpu(device, harness)
        record = {
            "kind": self.kind, "url": self.endpoint.base, "loopback": self.endpoint.is_loopback,
            "instrumentation": {"status": inst_status, "body": inst},
            "models": {"status": models_status, "body": models},
            "health": {"status": health_status, "body": health}, "server_info": extra,
            "model": {"id": self.model, "path": path, "config_sha256": sha, "source": source},
            "device": {"type": device.get("type"), "gpu": gpu},
            "versions": {"torch": device.get("torch"),
                         "triton": _find(inst, "triton") if self.is_freetoken else None},
        }
        missing = []
        if not self.is_freetoken:
            missing.append(f"server.instrumentation (GET /v1/instrumentation: HTTP {inst_status})")
        if sha is None:
            missing.append(f"model.config_sha256 (config.json of {path!r} is not readable here)")
        if not self.endpoint.is_loopback:
            missing.append("server.host (the server is not on this machine: its CPU and RAM are unknown)")
        if self.is_freetoken and record["versions"]["torch"] is None:
            missing.append("server.versions.torch")
        if device.get("type") == "cuda":
            missing += [f"gpu.{k}" for k in ("name", "uuid", "driver") if not (gpu or {}).get(k)]
            if record["versions"]["triton"] is None:
                missing.append("server.versions.triton (not in /v1/instrumentation)")
        record["missing"] = missing
        return record

    @staticmethod
    def _gpu(device: dict, harness: dict) -> dict | None:
        reported = device.get("gpu")
        if not reported:
            return None
        local = provenance.gpu_by_uuid(reported.get("uuid"), harness.get("gpus"))
        return {**reported, "driver": (local or {}).get("driver")}

    def config_snapshot(self) -> dict | None:
        """The configuration to hold fixed: FreeToken's resolved one, else the model listing."""
        status, inst = self._get("/v1/instrumentation")
        if status is None:
            return None         # unreachable: nothing to compare (the generations will say so)
        if status == 200 and isinstance(inst, dict):
            path = inst.get("model", {}).get("path")
            return provenance.config_projection(inst, provenance.model_config_sha256(path))
        status, models = self._get("/v1/models")
        return {"models": models if status == 200 else f"HTTP {status}"}

    async def generate(self, api: str, body: dict, timeout: float) -> client.StreamResult:
        body = {"model": self.model, **body, "stream": True, "stream_options": {"include_usage": True}}
        return await client.stream(self.endpoint, api, body, self.api_key, timeout)

    async def count_prompt(self, api: str, body: dict, timeout: float) -> client.StreamResult:
        """One token of the same request, for its usage.prompt_tokens (the dry run's probe)."""
        return await self.generate(api, {**body, "max_tokens": 1}, timeout)

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass


class LaunchedArm(UrlArm):
    """`ft serve ARGS` on a free loopback port, started in preflight, stopped by close()."""
    kind = "url"

    def __init__(self, name: str, serve_args: str, api_key: str | None = None, ready_timeout_s: float = 1800):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        super().__init__(name, f"http://127.0.0.1:{port}", api_key)
        self.argv = [sys.executable, "-m", "freetoken.cli", "serve", *shlex.split(serve_args),
                     "--host", "127.0.0.1", "--port", str(port)] + (["--api-key", api_key] if api_key else [])
        self.ready_timeout_s = ready_timeout_s
        self.proc = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"ft-bench-{name}-", suffix=".log", delete=False)

    def describe(self) -> dict:
        return {**super().describe(), "launched": self.argv[3:], "log": self.log.name}

    def preflight(self) -> list[Reason]:
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return [Reason("SERVER_UNAVAILABLE", f"`ft serve` exited with {self.proc.returncode}: "
                               f"{self._log_tail()}", arm=self.name)]
            status, body = self._get("/health")
            if status == 200 and isinstance(body, dict) and body.get("status") == "ok":
                return super().preflight()
            if isinstance(body, dict) and body.get("status") == "error":
                return [Reason("SERVER_UNAVAILABLE", f"the model failed to load: {body.get('detail')}",
                               arm=self.name)]
            time.sleep(0.1)
        return [Reason("SERVER_UNAVAILABLE", f"not ready in {self.ready_timeout_s:g}s", arm=self.name)]

    def _log_tail(self) -> str:
        with open(self.log.name) as f:
            return f.read()[-1500:]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _find(obj, key: str):
    """The first value under `key` anywhere in a nested dict (for fields whose place may move)."""
    if isinstance(obj, dict):
        if key in obj and not isinstance(obj[key], dict):
            return obj[key]
        for v in obj.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None
