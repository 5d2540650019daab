"""Log dropped messages without letting a flood of them flood the log."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

LOG_INTERVAL_S = 10.0


@dataclass(slots=True)
class DropLog:
    """Counts dropped messages; logs the first, then one line per LOG_INTERVAL_S with the count
    since: one peer sending garbage in a loop must not fill the disk or slow the reader."""

    logger: logging.Logger
    what: str  # "from the worker", "from the gateway"
    dropped: int = 0
    unlogged: int = 0
    last_log: float = float("-inf")

    def drop(self, reason: object) -> None:
        self.dropped += 1
        self.unlogged += 1
        now = time.monotonic()
        if now - self.last_log >= LOG_INTERVAL_S:
            self.logger.warning("dropped %d bad message(s) %s (%d in all): %s",
                                self.unlogged, self.what, self.dropped, reason)
            self.unlogged = 0
            self.last_log = now
