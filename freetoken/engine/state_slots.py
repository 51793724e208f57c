"""SlotAllocator: the per-request state slots of linear-attention layers, beside the blocks.

A recurrent layer's state does not grow with the context, so it is not paged: each running
request holds one slot, the same row of every recurrent layer's pool (cache_spec.py's
RecurrentStateSpec: the float32 state and the conv window). The scheduler admits a request
only when a slot and its KV blocks are both available (check/do: `can_allocate` /
`allocate`), and frees the slot when the request finishes, is aborted or is preempted (a
preempted request recomputes its state from its tokens when it resumes).
"""

from __future__ import annotations


class SlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # A stack: the most recently freed slot is reused first.
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"state slots exhausted: all {self.num_slots} are in use")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"state slot {slot} freed while not in use")
        self._used.remove(slot)
        self._free.append(slot)

    def check(self) -> None:
        """Assert the invariants (tests): every slot is free or used, never both."""
        free = set(self._free)
        assert len(free) == len(self._free) and not free & self._used
        assert len(free) + len(self._used) == self.num_slots
