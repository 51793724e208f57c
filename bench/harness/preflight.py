"""Everything checked before the first warmup, shared by `--dry-run` and a real run: the
manifest and its fixtures, the protocol against the manifest's, the checkout and host, each
arm's readiness, provenance and configuration, and one probe per prompt (max_tokens 1) that
reads the server's own prompt length so an out-of-class prompt is known before measuring.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from bench.harness import provenance
from bench.harness.manifest import Manifest, Workload, conversation, fixture_problem
from bench.harness.plan import Protocol
from bench.harness.records import make_record, reasons_from
from bench.harness.validity import Reason

PROBE_CONVERSATION = 0      # measured conversations count from 1; a probe is conversation 0


@dataclasses.dataclass
class Preflight:
    reasons: list[Reason]
    harness: dict
    arms: dict[str, dict]           # name -> describe, provenance, config
    probes: list[dict]              # generation records, phase "probe"
    t0: float


def run_preflight(manifest: Manifest, workloads: list[Workload], arms: list, protocol: Protocol,
                  varies: list[str], timeout_s: float) -> Preflight:
    t0 = time.perf_counter()
    reasons = _protocol_reasons(manifest, protocol)
    broken = set()
    for w in workloads:
        problem = fixture_problem(w)
        if problem:
            reasons.append(Reason("FIXTURE_HASH_MISMATCH", problem, workload=w.name))
            broken.add(w.name)
    harness = provenance.harness()
    reasons += [Reason("PROVENANCE_MISSING", field) for field in provenance.harness_missing(harness)]
    if harness["git"]["dirty"]:
        reasons.append(Reason("DIRTY_TREE", f"{len(harness['git']['changed_files'])} changed or untracked "
                              f"files in {harness['git']['repo']}"))
    records, arm_info = [], {}
    for arm in arms:
        info = arm_info[arm.name] = {"describe": arm.describe(), "provenance": None, "config": {}}
        problems = arm.preflight()
        if problems:
            reasons += problems
            continue
        info["describe"] = arm.describe()       # now with what preflight learnt (the model name)
        info["provenance"] = prov = arm.provenance(harness)
        reasons += [Reason("PROVENANCE_MISSING", field, arm=arm.name) for field in prov["missing"]]
        snap = arm.config_snapshot()
        info["config"] = {"initial": snap, "sha256": provenance.digest(snap), "snapshots": [], "changes": []}
        for w in workloads:
            for c in w.concurrency:
                why = arm.supports(w, c)
                if why:
                    reasons.append(Reason("ARM_UNSUPPORTED", why, arm=arm.name, workload=w.name))
            if w.name not in broken:
                records += asyncio.run(_probe(arm, w, t0, timeout_s))
    reasons += _probe_failures(records) + reasons_from(records, {w.name: w for w in workloads})
    reasons += arms_config_differ(arms, arm_info, varies)
    return Preflight(reasons, harness, arm_info, records, t0)


def _protocol_reasons(manifest: Manifest, protocol: Protocol) -> list[Reason]:
    reasons = []
    pinned = Protocol(manifest.warmups, manifest.measured, manifest.sessions)
    if (protocol.warmups, protocol.measured) != (pinned.warmups, pinned.measured) \
            or protocol.sessions < pinned.sessions:
        reasons.append(Reason("PROTOCOL_OVERRIDDEN", f"{protocol.warmups} warmup + {protocol.measured} "
                              f"measured x {protocol.sessions} session(s); the manifest pins "
                              f"{pinned.warmups} + {pinned.measured} x {pinned.sessions}"))
    if not manifest.is_default:
        reasons.append(Reason("CUSTOM_MANIFEST", f"{manifest.path} (sha256 {manifest.sha256[:16]})"))
    return reasons


async def _probe(arm, w: Workload, t0: float, timeout_s: float) -> list[dict]:
    out = []
    for turn, body in enumerate(conversation(w, PROBE_CONVERSATION)):
        res = await arm.count_prompt(w.api, body, timeout_s)
        out.append(make_record(res, t0, w, {**body, "max_tokens": 1}, seq=None, session=0, order="probe",
                               block=None, arm=arm.name, concurrency=1, phase="probe", rep=0, stream=0,
                               turn=turn, conversation=PROBE_CONVERSATION))
    return out


def _probe_failures(records: list[dict]) -> list[Reason]:
    return [Reason("ARM_UNSUPPORTED", f"the probe request failed: {r['error']}", r["arm"], r["workload"])
            for r in records if r["error"] is not None]


def arms_config_differ(arms: list, arm_info: dict, varies: list[str]) -> list[Reason]:
    """Arms of the same kind with resolved configurations must differ only where --varies says."""
    reasons = []
    comparable = [a for a in arms if arm_info[a.name]["config"].get("initial") is not None
                  and (a.kind != "url" or a.is_freetoken)]
    for a, b in zip(comparable, comparable[1:]):
        if a.kind != b.kind:
            continue
        d = provenance.diff(arm_info[a.name]["config"]["initial"], arm_info[b.name]["config"]["initial"])
        undeclared = {k: v for k, v in d.items() if not any(k == p or k.startswith(p + ".") for p in varies)}
        if undeclared:
            shown = "; ".join(f"{k}: {x!r} vs {y!r}" for k, (x, y) in list(undeclared.items())[:8])
            flags = " ".join(f"--varies {k}" for k in undeclared)
            reasons.append(Reason("ARMS_CONFIG_DIFFER", f"arms {a.name} and {b.name} differ in {shown} "
                                  f"(if intended, declare it: {flags})", arm=f"{a.name},{b.name}"))
    return reasons
