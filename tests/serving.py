"""Start a real `ft serve` process on a free loopback port, for end-to-end tests; or the same
app in this process (InProcessServer), where a test can reach the live engine to inject a
fault."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpClient:
    """request() and sse() against self.base (and self.api_key, when set)."""
    api_key: str | None = None

    def request(self, method: str, path: str, body=None, headers: dict | None = None):
        """A plain HTTP request; returns (status, parsed JSON or raw bytes)."""
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if self.api_key and "Authorization" not in hdrs and "x-api-key" not in hdrs:
            hdrs["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    def sse(self, path: str, body: dict, headers: dict | None = None) -> list[tuple[str | None, object]]:
        """POST a streaming request; returns its events as (event name or None, parsed data)."""
        status, raw = self.request("POST", path, body, headers)
        assert status == 200, raw
        events, name = [], None
        for line in raw.decode().split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                events.append((name, data if data == "[DONE]" else json.loads(data)))
                name = None
        return events



class ServerProcess(HttpClient):
    def __init__(self, model_dir, *flags, env: dict | None = None, wait_ready: bool = True,
                 api_key: str | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "freetoken.cli", "serve", str(model_dir), "--port", str(self.port),
               "--device", "cpu", *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = f"/tmp/ft-serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        try:
            self.wait_listening()
            if wait_ready:
                self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def logs(self) -> str:
        if self.log.closed:      # stopped: the file is gone, its text kept
            return self._log_text
        with open(self.log_path) as f:
            return f.read()

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait_listening(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ft serve exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"ft serve did not listen in {timeout}s:\n{self.logs()}")

    def wait_ready(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, body = self.health()
            if body.get("status") == "ok":
                return body
            if body.get("status") == "error":
                raise RuntimeError(f"model failed to load: {body}\n{self.logs()}")
            time.sleep(0.1)
        raise TimeoutError(f"not ready in {timeout}s:\n{self.logs()}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
            with open(self.log_path) as f:
                self._log_text = f.read()
            os.unlink(self.log_path)     # leave no ft-serve-<port>.log behind
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class InProcessServer(HttpClient):
    """ServingApp and its HTTP server on a uvloop loop in a background thread, loaded and
    ready: what `ft serve` runs, minus the process, so `self.app.engine` is reachable."""

    def __init__(self, model_dir, **server_kwargs):
        import asyncio
        import threading

        import uvloop

        from freetoken.engine.config import EngineConfig
        from freetoken.scheduler.config import SchedulerConfig
        from freetoken.server.app import ServingApp
        from freetoken.server.config import ServerConfig
        from freetoken.server.http import start_server

        self.loop = uvloop.new_event_loop()
        self.app = ServingApp(ServerConfig(served_model_name=server_kwargs.pop("name", "tiny"),
                                           model_path=str(model_dir), **server_kwargs),
                              EngineConfig(model=str(model_dir), device="cpu"), SchedulerConfig())
        started = threading.Event()

        async def main():
            self.stop_event = asyncio.Event()
            self.http = await start_server(self.app.router, "127.0.0.1", 0)
            await self.app.load()
            started.set()
            await self.stop_event.wait()
            self.http.close()
            await self.app.shutdown(self.app.server_config.shutdown_timeout_s)
            await self.http.shutdown(timeout=1.0)

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),),
                                       name="in-process-server", daemon=True)
        self.thread.start()
        if not started.wait(120) or self.app.status != "ok":
            raise RuntimeError(f"in-process server did not get ready: {self.app.status} {self.app.error}")
        self.base = f"http://127.0.0.1:{self.http.port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
