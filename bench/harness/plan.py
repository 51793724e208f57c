"""The precommitted protocol as a list of blocks, fixed and recorded before anything runs.

A block is one (arm, workload, concurrency level) in one session: its warmups, then its
measured repetitions. Session 1 runs workload-major (each workload, each level, each arm in
the order given); session 2, when asked for, runs the same blocks in reverse, so that an
effect of running first or last (thermal state, caches, a neighbour's load) shows up as a
difference between sessions instead of hiding in one arm's numbers.
"""

from __future__ import annotations

import dataclasses

from bench.harness.manifest import Workload


@dataclasses.dataclass(frozen=True)
class Protocol:
    warmups: int
    measured: int
    sessions: int


@dataclasses.dataclass(frozen=True)
class Block:
    index: int
    session: int
    order: str              # "forward" or "reversed"
    arm: str
    workload: str
    concurrency: int
    warmups: int
    measured: int
    turns: int

    def expected(self, phase: str) -> int:
        """Generations this block owes in a phase: rounds x concurrent streams x turns."""
        rounds = self.warmups if phase == "warmup" else self.measured
        return rounds * self.concurrency * self.turns

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "expected_warmup": self.expected("warmup"),
                "expected_measured": self.expected("measured")}


def make_plan(arm_names: list[str], workloads: list[Workload], protocol: Protocol) -> list[Block]:
    forward = [(a, w, c) for w in workloads for c in w.concurrency for a in arm_names]
    blocks = []
    for session in range(1, protocol.sessions + 1):
        order = "forward" if session % 2 else "reversed"
        for arm, w, c in (forward if order == "forward" else forward[::-1]):
            blocks.append(Block(len(blocks), session, order, arm, w.name, c, protocol.warmups,
                                protocol.measured, w.num_turns))
    return blocks


def describe(blocks: list[Block]) -> list[str]:
    return [f"#{b.index:<3d} session {b.session} ({b.order}): arm {b.arm}, workload {b.workload}, "
            f"concurrency {b.concurrency}: {b.warmups} warmup + {b.measured} measured round(s), "
            f"{b.expected('warmup') + b.expected('measured')} generations" for b in blocks]
