"""HTTPError and the two JSON error shapes the API dialects answer with.

OpenAI:    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
Anthropic: {"type": "error", "error": {"type": ..., "message": ...}}

Handlers and guards raise HTTPError; the HTTP layer renders it in the route's dialect (or
the one the error names) so a guard written once answers each dialect in its own shape.
"""

from __future__ import annotations

import orjson

DIALECTS = ("openai", "anthropic")

# Anthropic's error type is a function of the status; an OpenAI type given by a shared
# guard (e.g. 401 "invalid_request_error") is replaced by the status's Anthropic type.
_ANTHROPIC_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}
_ANTHROPIC_TYPES = frozenset(_ANTHROPIC_BY_STATUS.values())


class HTTPError(Exception):
    """An error answered as `status` with a JSON body; raise it from handlers and guards.

    `type` defaults from the status; `dialect=None` means "the route's dialect";
    `headers` are added to the response (e.g. Allow for 405, Retry-After for 503).
    """

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | int | None = None,
                 dialect: str | None = None, headers: dict[str, str] | None = None):
        if not 400 <= status <= 599:
            raise ValueError(f"HTTPError status must be 4xx or 5xx, got {status}")
        if dialect is not None and dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.dialect = dialect
        self.headers = headers

    def body(self, dialect: str = "openai") -> bytes:
        return error_body(self.status, self.message, type=self.type, param=self.param,
                          code=self.code, dialect=self.dialect or dialect)

    def __repr__(self) -> str:
        return f"HTTPError({self.status}, {self.message!r}, type={self.type!r})"


def openai_type(status: int) -> str:
    if status == 503:
        return "service_unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


def anthropic_type(status: int, type: str | None = None) -> str:
    if type in _ANTHROPIC_TYPES and type != "invalid_request_error":
        return type
    return _ANTHROPIC_BY_STATUS.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: str | int | None = None, dialect: str = "openai") -> bytes:
    """The JSON bytes of an error response in the given dialect."""
    if dialect == "anthropic":
        return orjson.dumps({"type": "error",
                             "error": {"type": anthropic_type(status, type), "message": message}})
    return orjson.dumps({"error": {"message": message, "type": type or openai_type(status),
                                   "param": param, "code": code}})
