"""The benchmark harness behind `ft bench serve`: frozen workloads (manifest.py), arms that
generate (arms.py, transformers_arm.py), a raw-socket SSE client (client.py), provenance,
the precommitted protocol and its execution (plan.py, runner.py), validity verdicts
(validity.py) and the artifacts: generations.jsonl, run.json, SUMMARY.md (summary.py).

Imports the standard library (torch and transformers lazily, for the in-process baseline)
and, from freetoken, only `ft ctl`'s http_get; never freetoken's server, scheduler or engine:
the system under test is reached over HTTP, as a user's client reaches it.
"""
