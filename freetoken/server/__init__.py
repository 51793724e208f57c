"""The serving front end: HTTP/1.1 (`server.http`), SSE and the API dialects (OpenAI, Anthropic).

Owns sockets, parsing, routing, error bodies and streaming writes. May import the
scheduler- and engine-facing types it hands requests to; nothing below imports it.
"""
