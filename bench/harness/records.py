"""One generation -> one JSONL record, the checks each record carries, and the reasons that
the records of a run add up to.

Times in a record: `t_start_s` is seconds since the run started (perf_counter), every other
time is seconds since this request's own start: `event_times_s` holds one entry per SSE event
that carried generated text, so its differences are the inter-token latencies as the client
saw them (a server that batches tokens into one event shows fewer events than tokens).
"""

from __future__ import annotations

from collections import defaultdict

from bench.harness.client import StreamResult
from bench.harness.manifest import Workload
from bench.harness.validity import Reason

SCHEMA = "freetoken-bench-generation/1"


def make_record(res: StreamResult, t0: float, w: Workload, body: dict, **where) -> dict:
    """`where`: seq, session, order, block, arm, concurrency, phase, rep, stream, turn, conversation."""
    times = [t - res.t_start for t in res.event_times]
    rec = {"schema": SCHEMA, **where, "workload": w.name, "class": w.cls, "api": w.api,
           "max_tokens": body["max_tokens"], "t_start_unix": res.t_start_unix,
           "t_start_s": res.t_start - t0, "ttft_s": times[0] if times else None,
           "e2e_s": res.t_end - res.t_start, "event_times_s": times,
           "prompt_tokens": res.prompt_tokens, "completion_tokens": res.completion_tokens,
           "cached_tokens": res.cached_tokens,
           "finish_reason": res.finish_reason, "http_status": res.http_status, "error": res.error}
    rec["checks"] = checks(rec, w, body)
    return rec


def checks(rec: dict, w: Workload, body: dict) -> dict:
    """True/False per condition; None where a failed generation left nothing to check."""
    if rec["error"] is not None:
        return {"usage": None, "output_length": None, "prompt_in_class": None}
    has_usage = rec["prompt_tokens"] is not None and rec["completion_tokens"] is not None
    out_ok = prompt_ok = None
    if has_usage:
        out_ok = abs(rec["completion_tokens"] - body["max_tokens"]) <= w.output_tolerance \
            and (not body.get("ignore_eos") or rec["finish_reason"] == "length")
        prompt_ok = w.prompt_classes[rec["turn"]].contains(rec["prompt_tokens"])
    return {"usage": has_usage, "output_length": out_ok, "prompt_in_class": prompt_ok}


def reasons_from(records: list[dict], workloads: dict[str, Workload]) -> list[Reason]:
    """One reason per (failed check, arm, workload), saying how many generations failed it."""
    failed = defaultdict(list)
    for r in records:
        for check, code in (("usage", "USAGE_MISSING"), ("output_length", "OUTPUT_LENGTH_MISMATCH"),
                            ("prompt_in_class", "PROMPT_OUT_OF_CLASS")):
            if r["checks"][check] is False:
                failed[(code, r["arm"], r["workload"])].append(r)
    reasons = []
    for (code, arm, name), rs in failed.items():
        total = sum(1 for r in records if r["arm"] == arm and r["workload"] == name and r["error"] is None)
        phases = "/".join(sorted({r["phase"] for r in rs}))
        if code == "USAGE_MISSING":
            detail = "no usage (prompt_tokens, completion_tokens) in the stream"
        elif code == "OUTPUT_LENGTH_MISMATCH":
            seen = sorted({(r["max_tokens"], r["completion_tokens"], r["finish_reason"]) for r in rs})
            detail = "asked/got/finish " + ", ".join(f"{a}/{g}/{f}" for a, g, f in seen)
        else:
            w = workloads[name]
            seen = sorted({(r["turn"], r["prompt_tokens"]) for r in rs})
            detail = ", ".join(f"turn {t}: {n} prompt tokens, class {w.cls} allows "
                               f"{w.prompt_classes[t].min}-{w.prompt_classes[t].max}" for t, n in seen)
        reasons.append(Reason(code, f"{len(rs)} of {total} generations ({phases}): {detail}", arm, name))
    return reasons
