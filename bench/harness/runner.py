"""Runs the plan and writes the three artifacts: generations.jsonl (one line per generation,
written as it finishes), run.json and SUMMARY.md (both lead with the verdict).

run.json and SUMMARY.md are first written before the first warmup, saying INCOMPLETE and
INVALID (RUN_NOT_FINALIZED): a harness killed mid-run leaves a record that says so, never a
canonical-looking one. A run whose preflight found an invalidating reason is refused (nothing
measured, exit 3) unless --force; Ctrl-C or SIGTERM ends it INCOMPLETE with what it observed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path

from bench.harness import plan as plan_mod
from bench.harness import provenance, validity
from bench.harness.client import StreamResult
from bench.harness.manifest import Manifest, Workload, conversation
from bench.harness.plan import Block, Protocol
from bench.harness.preflight import Preflight
from bench.harness.records import make_record, reasons_from
from bench.harness.summary import render, summarize
from bench.harness.validity import Reason

SCHEMA = "freetoken-bench-run/1"
EXIT_OK, EXIT_NOT_VALID, EXIT_REFUSED, EXIT_INTERRUPTED = 0, 1, 3, 130


@dataclasses.dataclass
class Options:
    out_dir: Path
    allow: set
    varies: list
    force: bool = False
    timeout_s: float = 600.0
    argv: dict = dataclasses.field(default_factory=dict)     # sys.argv and the parsed flags
    max_failures_in_a_row: int = 3


class Aborted(Exception):
    pass


class Runner:
    def __init__(self, manifest: Manifest, workloads: list[Workload], arms: list, protocol: Protocol,
                 blocks: list[Block], options: Options, pre: Preflight, run_id: str):
        self.manifest, self.protocol, self.blocks, self.options, self.pre = manifest, protocol, blocks, options, pre
        self.workloads = {w.name: w for w in workloads}
        self.arms = {a.name: a for a in arms}
        self.run_id, self.started = run_id, time.time()
        self.records = list(pre.probes)
        self.interrupted, self.aborted, self.refused = False, None, False
        self.seq = self.conversations = self.failures_in_a_row = 0
        self.last_error = None
        self.jsonl = None

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> tuple[dict, int]:
        out = self.options.out_dir
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out / "generations.jsonl", "w")
        for r in self.pre.probes:
            self.jsonl.write(json.dumps(r) + "\n")
        self._finish(final=False)
        if validity.validity(validity.apply_overrides(list(self.pre.reasons), self.options.allow)) \
                == validity.INVALID and not self.options.force:
            self.refused = True
        else:
            try:
                self._execute()
            except KeyboardInterrupt:
                self.interrupted = True
            except Aborted as e:
                self.aborted = str(e)
            finally:
                for arm in self.arms.values():
                    arm.close()
        self.jsonl.close()
        record = self._finish(final=True)
        v = record["verdict"]
        if self.refused:
            return record, EXIT_REFUSED
        if self.interrupted:
            return record, EXIT_INTERRUPTED
        ok = v["status"] == validity.COMPLETE and v["validity"] != validity.INVALID
        return record, EXIT_OK if ok else EXIT_NOT_VALID

    def _runnable(self, b: Block) -> bool:
        """--force still cannot run an arm that failed preflight or a fixture that is not there."""
        bad = {(r.arm, r.workload) for r in self.pre.reasons
               if r.code in ("ARM_UNSUPPORTED", "SERVER_UNAVAILABLE", "FIXTURE_HASH_MISMATCH")}
        return not ({(b.arm, None), (b.arm, b.workload), (None, b.workload)} & bad) \
            and self.pre.arms[b.arm]["provenance"] is not None

    def _execute(self) -> None:
        opened = set()
        for b in self.blocks:
            if not self._runnable(b):
                continue
            arm = self.arms[b.arm]
            if arm.name not in opened:
                arm.open()          # a baseline's model load stays outside every measurement
                opened.add(arm.name)
            self._snapshot(arm, b, "before")
            asyncio.run(self._block(b, arm, self.workloads[b.workload]))
            self._snapshot(arm, b, "after")

    async def _block(self, b: Block, arm, w: Workload) -> None:
        for phase, rounds in (("warmup", b.warmups), ("measured", b.measured)):
            for rep in range(rounds):
                streams = []
                for stream in range(b.concurrency):
                    self.conversations += 1
                    streams.append(self._conversation(b, arm, w, phase, rep, stream, self.conversations))
                await asyncio.gather(*streams)
                if self.failures_in_a_row >= self.options.max_failures_in_a_row:
                    raise Aborted(f"{self.failures_in_a_row} generations failed in a row, the last with: "
                                  f"{self.last_error}")

    async def _conversation(self, b: Block, arm, w: Workload, phase: str, rep: int, stream: int, n: int) -> None:
        for turn, body in enumerate(conversation(w, n)):
            self.seq += 1
            seq = self.seq
            try:
                res = await arm.generate(w.api, body, self.options.timeout_s)
            except Exception as e:     # noqa: BLE001 - an in-process arm's failure is this generation's
                res = StreamResult(t_start=time.perf_counter(), t_start_unix=time.time(), t_end=time.perf_counter(),
                                   error=f"{type(e).__name__}: {e}")
            rec = make_record(res, self.pre.t0, w, body, seq=seq, session=b.session, order=b.order,
                              block=b.index, arm=arm.name, concurrency=b.concurrency, phase=phase, rep=rep,
                              stream=stream, turn=turn, conversation=n)
            self._write(rec)
            if rec["error"] is not None:
                self.failures_in_a_row += 1
                self.last_error = rec["error"]
                return          # the conversation's later turns would not be the pinned prompts
            self.failures_in_a_row = 0

    def _write(self, rec: dict) -> None:
        self.records.append(rec)
        self.jsonl.write(json.dumps(rec) + "\n")
        self.jsonl.flush()

    def _snapshot(self, arm, b: Block, when: str) -> None:
        cfg = self.pre.arms[arm.name]["config"]
        snap = arm.config_snapshot()
        cfg["snapshots"].append({"block": b.index, "when": when, "unix": time.time(),
                                 "sha256": provenance.digest(snap) if snap is not None else None})
        if snap is not None and cfg.get("initial") is not None:
            d = provenance.diff(cfg["initial"], snap)
            if d:
                cfg["changes"].append({"block": b.index, "when": when, "diff": d})

    # -- the record -------------------------------------------------------------------------
    def _reasons(self, final: bool) -> list[Reason]:
        reasons = list(self.pre.reasons)
        if not final:
            return reasons + [Reason("RUN_NOT_FINALIZED", f"started {time.ctime(self.started)}; a finished "
                                     f"run replaces this record")]
        reasons += reasons_from([r for r in self.records if r["phase"] != "probe"], self.workloads)
        for name, info in self.pre.arms.items():
            for change in info["config"].get("changes", []):
                shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(change["diff"].items())[:8])
                reasons.append(Reason("ARM_CONFIG_CHANGED", f"{change['when']} block {change['block']}: {shown}",
                                      arm=name))
        return reasons

    def _verdict(self, final: bool) -> dict:
        reasons = validity.dedupe(validity.apply_overrides(self._reasons(final), self.options.allow))
        reasons.sort(key=lambda r: (r.severity != validity.INVALID or r.overridden))
        by_block, expected, observed = [], 0, 0
        ok = [r for r in self.records if r["phase"] != "probe" and r["error"] is None]
        for b in self.blocks:
            row = {"block": b.index, "arm": b.arm, "workload": b.workload, "concurrency": b.concurrency}
            for phase in ("warmup", "measured"):
                row[f"expected_{phase}"] = b.expected(phase)
                row[f"observed_{phase}"] = sum(1 for r in ok if r["block"] == b.index and r["phase"] == phase)
                expected += row[f"expected_{phase}"]
                observed += row[f"observed_{phase}"]
            by_block.append(row)
        failed = sum(1 for r in self.records if r["phase"] != "probe" and r["error"] is not None)
        return {"status": validity.status(expected, observed, self.interrupted or not final),
                "validity": validity.validity(reasons), "reasons": [r.as_dict() for r in reasons],
                "expected_generations": expected, "observed_generations": observed,
                "failed_generations": failed, "interrupted": self.interrupted, "aborted": self.aborted,
                "refused": self.refused, "finalized": final, "by_block": by_block}

    def _finish(self, final: bool) -> dict:
        m, p = self.manifest, self.protocol
        record = {
            "verdict": self._verdict(final), "schema": SCHEMA, "run_id": self.run_id,
            "started_unix": self.started, "finished_unix": time.time() if final else None,
            "command": self.options.argv, "cwd": os.getcwd(), "out_dir": str(self.options.out_dir),
            "manifest": {"path": str(m.path), "version": m.version, "sha256": m.sha256, "is_default": m.is_default},
            "protocol": {"warmups": p.warmups, "measured": p.measured, "sessions": p.sessions, "order": m.order,
                         "manifest": {"warmups": m.warmups, "measured": m.measured, "sessions": m.sessions}},
            "overrides": {"allow": sorted(self.options.allow), "varies": self.options.varies,
                          "force": self.options.force},
            "workloads": {name: w.spec for name, w in self.workloads.items()},
            "plan": [b.as_dict() for b in self.blocks], "plan_text": plan_mod.describe(self.blocks),
            "harness": self.pre.harness, "arms": self.pre.arms,
            "summary": summarize(self.records) if final else {},
            "artifacts": {"generations": "generations.jsonl", "summary": "SUMMARY.md"},
        }
        _atomic_write(self.options.out_dir / "run.json", json.dumps(record, indent=1, default=str) + "\n")
        _atomic_write(self.options.out_dir / "SUMMARY.md", render(record))
        return record


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def explain(pre: Preflight, blocks: list[Block], allow: set, force: bool) -> tuple[str, bool]:
    """The dry run's report: the plan, then every reason; and whether the run would be refused."""
    reasons = validity.dedupe(validity.apply_overrides(list(pre.reasons), allow))
    reasons.sort(key=lambda r: (r.severity != validity.INVALID or r.overridden))
    verdict = validity.validity(reasons)
    refused = verdict == validity.INVALID and not force
    lines = ["Plan (in execution order):"] + [f"  {line}" for line in plan_mod.describe(blocks)]
    for name, info in pre.arms.items():
        prov = info["provenance"] or {}
        model = prov.get("model", {})
        lines.append(f"Arm {name}: {info['describe']}; model {model.get('id') or model.get('path')}, "
                     f"config.json sha256 {(model.get('config_sha256') or 'unknown')[:16]}")
    for r in pre.probes:
        lines.append(f"Probe {r['arm']}/{r['workload']} turn {r['turn']}: "
                     + (f"error {r['error']}" if r["error"] else f"{r['prompt_tokens']} prompt tokens"))
    lines.append(f"Verdict before measuring: {verdict}" + (" (the run would be REFUSED; --force measures "
                                                          "anyway, labelled INVALID)" if refused else ""))
    lines += [f"  - {r.line()}" for r in reasons] or ["  (no reasons: the run would be VALID)"]
    return "\n".join(lines), refused
