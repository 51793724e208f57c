"""Verdicts: a run's status (COMPLETE or INCOMPLETE) and its validity (VALID, INVALID or
NON_CANONICAL), each backed by reasons with stable codes.

Two separate questions. Completeness: did every generation the protocol expected happen and
succeed? Validity: were the conditions the manifest pins actually met? An invalidating reason
that `--allow CODE` overrides (only those marked overridable) turns INVALID into
NON_CANONICAL; it is never dropped from the record.
"""

from __future__ import annotations

import dataclasses

INVALID, NON_CANONICAL, VALID = "INVALID", "NON_CANONICAL", "VALID"
COMPLETE, INCOMPLETE = "COMPLETE", "INCOMPLETE"


@dataclasses.dataclass(frozen=True)
class Code:
    severity: str           # INVALID or NON_CANONICAL
    overridable: bool
    meaning: str


CODES = {
    "OUTPUT_LENGTH_MISMATCH": Code(INVALID, False, "a generation's usage.completion_tokens is not the "
                                   "requested max_tokens (with ignore_eos), or it did not finish by length"),
    "PROMPT_OUT_OF_CLASS": Code(INVALID, True, "a prompt's usage.prompt_tokens lies outside its workload "
                                "class's tolerance"),
    "USAGE_MISSING": Code(INVALID, True, "the server reported no usage, so prompt and output lengths "
                          "cannot be verified"),
    "PROVENANCE_MISSING": Code(INVALID, True, "a provenance field could not be recorded"),
    "ARM_CONFIG_CHANGED": Code(INVALID, False, "an arm's resolved configuration changed during the run"),
    "ARMS_CONFIG_DIFFER": Code(INVALID, False, "two arms' resolved configurations differ in a field "
                               "that --varies does not declare"),
    "FIXTURE_HASH_MISMATCH": Code(INVALID, False, "a prompt fixture is missing or its sha256 is not the "
                                  "one the manifest pins"),
    "SERVER_UNAVAILABLE": Code(INVALID, False, "an arm's server was unreachable or not ready"),
    "ARM_UNSUPPORTED": Code(INVALID, False, "an arm cannot run a workload as pinned"),
    "RUN_NOT_FINALIZED": Code(INVALID, False, "the harness stopped before it finished this record "
                              "(killed, or still running)"),
    "PROTOCOL_OVERRIDDEN": Code(NON_CANONICAL, False, "warmups, measured repetitions or sessions differ "
                                "from the manifest's protocol"),
    "CUSTOM_MANIFEST": Code(NON_CANONICAL, False, "the workloads come from a manifest other than "
                            "bench/workloads/manifest.json"),
    "DIRTY_TREE": Code(NON_CANONICAL, False, "the FreeToken checkout has uncommitted changes, so its "
                       "commit does not identify the code that ran"),
}
OVERRIDABLE = sorted(code for code, c in CODES.items() if c.overridable)


@dataclasses.dataclass
class Reason:
    code: str
    detail: str
    arm: str | None = None
    workload: str | None = None
    overridden: bool = False

    def __post_init__(self):
        if self.code not in CODES:
            raise ValueError(f"unknown reason code {self.code}")

    @property
    def severity(self) -> str:
        return CODES[self.code].severity

    def as_dict(self) -> dict:
        return {"code": self.code, "severity": self.severity, "overridden": self.overridden,
                "arm": self.arm, "workload": self.workload, "detail": self.detail}

    def line(self) -> str:
        where = ", ".join(f"{k} {v}" for k, v in (("arm", self.arm), ("workload", self.workload)) if v)
        tag = f"{self.severity} (overridden by --allow: NON_CANONICAL)" if self.overridden else self.severity
        return f"{self.code} [{tag}]{' (' + where + ')' if where else ''}: {self.detail}"


def apply_overrides(reasons: list[Reason], allow: set[str]) -> list[Reason]:
    for r in reasons:
        r.overridden = r.code in allow and CODES[r.code].overridable
    return reasons


def validity(reasons: list[Reason]) -> str:
    if any(r.severity == INVALID and not r.overridden for r in reasons):
        return INVALID
    return NON_CANONICAL if reasons else VALID


def status(expected: int, observed: int, interrupted: bool) -> str:
    return COMPLETE if observed >= expected and not interrupted else INCOMPLETE


def dedupe(reasons: list[Reason]) -> list[Reason]:
    seen, out = set(), []
    for r in reasons:
        key = (r.code, r.arm, r.workload, r.detail)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out
