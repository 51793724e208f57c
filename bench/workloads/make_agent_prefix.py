#!/usr/bin/env python3
"""How agent_prefix.json was made: the agent fixture's system prompt and tools, a user message
that pastes a long station log (the head of long_prefill.txt, cut at an entry), then two short
exchanges. Each request resends the whole conversation and adds a few dozen tokens, as a
coding agent's turns do, so a prefix cache serves all but the tail of turns 2 and 3.

The committed JSON is the fixture (its sha256 is pinned in manifest.json); this script only
documents where it came from. Running it again writes the same bytes:

    python bench/workloads/make_agent_prefix.py > bench/workloads/agent_prefix.json

Sized for the demo model's tokenizer: about 3,000 prompt tokens at turn 1.
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENTRIES = 13          # station-log entries pasted into the first user message


def main() -> None:
    agent = json.loads((HERE / "agent_multiturn.json").read_text())
    log = (HERE / "long_prefill.txt").read_text()
    cut = log.index(f"\n\nEntry {ENTRIES + 1}:")
    messages = [
        agent["messages"][0],
        {"role": "user", "content": "The station log parser in stations/log.py mis-reads some entries. "
                                    "Here is the log it was given:\n\n" + log[:cut] + "\n\nWhich entries "
                                    "mention a fault that the crew did not fix on the same visit?"},
        {"role": "assistant", "content": "Let me go through the entries one by one and note each fault "
                                         "and whether the crew fixed it before leaving."},
        {"role": "user", "content": "Good. Start with the entries at Harbour Wall."},
        {"role": "assistant", "content": "At Harbour Wall the crew restored the link on the first visit; "
                                         "the later visits list their faults below."},
        {"role": "user", "content": "Now list the remaining open faults, one line each."},
    ]
    out = {"description": "A coding agent's long conversation (a pasted station log, about 3,000 tokens "
                          "on the demo tokenizer) and two short follow-ups: 3 requests, each adding a few "
                          "dozen tokens to the last.",
           "tools": agent["tools"], "messages": messages}
    print(json.dumps(out, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
