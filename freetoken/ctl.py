"""`ft ctl health|stats|models`: a thin client for people and scripts that do not want curl.

The address comes from --url or FREETOKEN_URL, the key from --api-key or FREETOKEN_API_KEY.
Prints the server's JSON; exits 0 on a 2xx answer, 1 on an error answer, 2 if unreachable.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

PATHS = {"health": "/health", "stats": "/v1/stats", "models": "/v1/models",
         "instrumentation": "/v1/instrumentation"}


def http_get(url: str, api_key: str | None, timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, raw body) of a GET, the key sent as a bearer token; an error answer is returned
    like any other, an unreachable server raises urllib.error.URLError or OSError."""
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def run(what: str, url: str, api_key: str | None, timeout: float = 10.0) -> int:
    try:
        status, raw = http_get(url.rstrip("/") + PATHS[what], api_key, timeout)
    except (urllib.error.URLError, OSError) as e:
        print(f"ft ctl: cannot reach {url}: {getattr(e, 'reason', e)}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(json.loads(raw), indent=2))
    except ValueError:
        print(raw.decode(errors="replace"))
    return 0 if 200 <= status < 300 else 1
