#!/usr/bin/env bash
# The README's first command, as a newcomer runs it: a fresh venv without the test extra,
# `pip install -e . && ft serve` (the demo model), /health ok, one streamed answer, a clean stop.
# A runtime import that only the test extra pulls in fails here, not on a newcomer's machine.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d /tmp/ft-fresh-venv.XXXXXX)
cache=$(mktemp -d /tmp/ft-fresh-cache.XXXXXX)
log="$venv/serve.log"
port=19191
cleanup() { [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null; rm -rf "$venv" "$cache"; }
trap cleanup EXIT
python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0           # the README's CPU build
python -m pip install -q -e .
XDG_CACHE_HOME="$cache" ft serve --port "$port" --device cpu >"$log" 2>&1 &
pid=$!
python - "$port" "$log" <<'PY'
import json, sys, time, urllib.request
port, log = sys.argv[1], sys.argv[2]
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 300
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            if json.loads(r.read())["status"] == "ok":
                break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("ft serve did not become ready:\n" + open(log).read())
    time.sleep(0.5)
body = json.dumps({"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8,
                   "stream": True}).encode()
req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    events = [l for l in r.read().decode().splitlines() if l.startswith("data: ")]
assert events and events[-1] == "data: [DONE]", events
print(f"fresh venv: ft serve ready, streamed {len(events) - 1} events")
PY
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
pid=
[ "$status" -eq 0 ] || { cat "$log"; echo "ft serve exited with $status"; exit 1; }
echo "fresh venv: ft serve stopped cleanly"
