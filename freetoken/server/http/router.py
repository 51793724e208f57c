"""Router: exact method + path routing, 404/405 errors, and prefix guards.

    router = Router()
    router.add("POST", "/v1/chat/completions", chat)                # dialect "openai"
    router.add("POST", "/v1/messages", messages, dialect="anthropic")
    router.set_guard("/v1/", guard)   # async guard(request) -> None, or raises HTTPError

`dispatch` resolves the route (404 for an unknown path, 405 with Allow for a known path
and another method), sets `response.dialect` so every error on that request is answered in
the route's shape, runs the guards whose prefix the path starts with (auth, "model is
loading") and then the handler.
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

    def set_guard(self, prefix: str, guard: Guard) -> None:
        """Run `await guard(request)` before every routed request whose path starts with prefix."""
        self._guards.append((prefix, guard))

    def resolve(self, method: str, path: str) -> Route:
        methods = self._routes.get(path)
        if methods is None:
            raise HTTPError(404, f"no route for {path}", type="invalid_request_error", code="not_found")
        route = methods.get(method)
        if route is None:
            dialect = next(iter(methods.values())).dialect
            raise HTTPError(405, f"method {method} not allowed on {path}; allowed: {self._allow[path]}",
                            type="invalid_request_error", code="method_not_allowed",
                            dialect=dialect, headers={"Allow": self._allow[path]})
        return route

    async def dispatch(self, request: Request, response: Response) -> None:
        route = self.resolve(request.method, request.path)
        response.dialect = route.dialect
        for prefix, guard in self._guards:
            if request.path.startswith(prefix):
                await guard(request)
        await route.handler(request, response)

    def __len__(self) -> int:
        return sum(len(m) for m in self._routes.values())
