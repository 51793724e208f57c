"""Loading progress in the terminal: the numbers /health reports (bytes of weights loaded, then
the warmup's steps), as a tqdm bar when stderr is a terminal, else as plain log lines (every
10% of the weights, and each warmup phase), so a log file stays readable."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("freetoken.server")


class LoadProgress:
    def __init__(self, tty: bool | None = None):
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._bar = None
        self._logged_tenth = -1

    def bytes(self, done: int, total: int) -> None:
        if total <= 0:
            return
        if self.tty:
            if self._bar is None:
                from tqdm import tqdm
                self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                 desc="loading weights", leave=False, file=sys.stderr)
            self._bar.update(done - self._bar.n)
            if done >= total:
                self.close()
            return
        tenth = done * 10 // total
        if tenth > self._logged_tenth:
            self._logged_tenth = tenth
            log.info("loading weights: %.1f of %.1f MiB (%d%%)", done / 2**20, total / 2**20, tenth * 10)

    def phase(self, phase: str) -> None:
        if self.tty:
            self.close()
            sys.stderr.write(f"\r\x1b[K{phase}")
            sys.stderr.flush()
        else:
            log.info("%s", phase)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
