"""HTTP/1.1 for `ft serve`: httptools parsing, routing, JSON answers and SSE streams, no framework.

Owns the socket side only and knows nothing of models. The API routes use: `Router`
(add, set_guard), `Request` (method, path, query, headers, body, client, json()),
`Response` (send_json, send_bytes, send_error, start_stream, write, end_stream,
disconnected, on_disconnect, wait_disconnected), `sse_event` / `SSE_DONE` / `SSE_PING`,
and `start_server` + `HttpConfig` + `HttpServer` to listen and shut down.
"""

from freetoken.server.errors import HTTPError
from freetoken.server.http.request import Request, Response
from freetoken.server.http.router import Route, Router
from freetoken.server.http.server import HttpConfig, HttpServer, start_server
from freetoken.server.http.sse import SSE_DONE, SSE_PING, sse_comment, sse_event

__all__ = ["HTTPError", "HttpConfig", "HttpServer", "Request", "Response", "Route", "Router",
           "SSE_DONE", "SSE_PING", "sse_comment", "sse_event", "start_server"]
