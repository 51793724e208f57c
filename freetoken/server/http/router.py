"""Router: exact method + path routing, 404/405 errors, and prefix guards.

    router = Router()
    router.add("POST", "/v1/chat/completions", chat)                # dialect "openai"
    router.add("POST", "/v1/messages", messages, dialect="anthropic")
    router.set_guard("/v1/", guard)   # async guard(request) -> None, or raises HTTPError

`dispatch` resolves the route (404 for an unknown path, 405 with Allow for a known path
and another method), sets `response.dialect` so every error on that request is answered in
the route's shape, runs the guards whose prefix the path starts with (auth, "model is
loading") and then the handler. HEAD runs a GET route without sending its body. A path ending
in `{name:path}` matches any non-empty rest (`request.path_rest`), for ids holding "/".
With `set_cors(origins)`, a request from an allowed Origin gets Access-Control-Allow-Origin on
every answer, and a preflight (OPTIONS with Access-Control-Request-Method) is answered 204.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Awaitable, Callable

from freetoken.server.errors import DIALECTS, HTTPError

if TYPE_CHECKING:
    from freetoken.server.http.request import Request, Response

Handler = Callable[["Request", "Response"], Awaitable[None]]
Guard = Callable[["Request"], Awaitable[None]]


@dataclasses.dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    dialect: str = "openai"


class Router:
    def __init__(self, default_dialect: str = "openai"):
        if default_dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {default_dialect!r}")
        self.default_dialect = default_dialect       # for 404s and protocol-level errors
        self._routes: dict[str, dict[str, Route]] = {}     # path -> method -> route
        self._allow: dict[str, str] = {}                   # path -> "GET, POST"
        self._guards: list[tuple[str, Guard]] = []
        self._prefixes: list[tuple[str, str]] = []         # (prefix, pattern path) for {name:path}
        self.cors_origins: tuple[str, ...] = ()

    def set_cors(self, origins) -> None:
        """Origins browsers may call from ("*": any); none: no CORS headers, preflights 405."""
        self.cors_origins = tuple(origins)

    def add(self, method: str, path: str, handler: Handler, dialect: str = "openai") -> None:
        method = method.upper()
        if not path.startswith("/"):
            raise ValueError(f"route path must start with '/', got {path!r}")
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        methods = self._routes.setdefault(path, {})
        if method in methods:
            raise ValueError(f"route {method} {path} is already registered")
        methods[method] = Route(method, path, handler, dialect)
        self._allow[path] = ", ".join(sorted(methods))
        if path.endswith(":path}") and "{" in path:
            self._prefixes.append((path[:path.rindex("{")], path))

    def set_guard(self, prefix: str, guard: Guard) -> None:
        """Run `await guard(request)` before every routed request whose path starts with prefix."""
        self._guards.append((prefix, guard))

    def resolve(self, method: str, path: str) -> Route:
        methods = self._routes.get(path)
        if methods is None:
            pattern = next((p for prefix, p in self._prefixes
                            if path.startswith(prefix) and len(path) > len(prefix)), None)
            methods = self._routes.get(pattern) if pattern else None
            path = pattern or path
        if methods is None:
            raise HTTPError(404, f"no route for {path}", type="invalid_request_error", code="not_found")
        route = methods.get(method)
        if route is None and method == "HEAD":
            route = methods.get("GET")
        if route is None:
            dialect = next(iter(methods.values())).dialect
            raise HTTPError(405, f"method {method} not allowed on {path}; allowed: {self._allow[path]}",
                            type="invalid_request_error", code="method_not_allowed",
                            dialect=dialect, headers={"Allow": self._allow[path]})
        return route

    async def dispatch(self, request: Request, response: Response) -> None:
        response.head_only = request.method == "HEAD"     # errors too: a HEAD answer has no body
        origin = request.headers.get("origin")
        if origin and self.cors_origins and ("*" in self.cors_origins or origin in self.cors_origins):
            response.extra_headers = {"Access-Control-Allow-Origin": origin if "*" not in self.cors_origins
                                      else "*", "Vary": "Origin"}
            if request.method == "OPTIONS" and "access-control-request-method" in request.headers:
                response.send_bytes(204, b"", "text/plain", {
                    "Access-Control-Allow-Methods": "GET, POST, HEAD, OPTIONS",
                    "Access-Control-Allow-Headers": request.headers.get(
                        "access-control-request-headers", "authorization, content-type"),
                    "Access-Control-Max-Age": "600"})
                return
        route = self.resolve(request.method, request.path)
        if route.path != request.path and route.path.endswith(":path}"):
            request.path_rest = request.path[route.path.rindex("{"):]
        response.dialect = route.dialect
        for prefix, guard in self._guards:
            if request.path.startswith(prefix):
                await guard(request)
        await route.handler(request, response)

    def __len__(self) -> int:
        return sum(len(m) for m in self._routes.values())
