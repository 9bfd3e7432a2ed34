"""A preemption notice (issue 25): the generator will be reclaimed at a deadline (SIGTERM with
``BUCKETRL_PREEMPTION_NOTICE_S``, or a proxy drain carried by the heartbeat's answer).

From the notice on, the worker samples nothing new; a call still sampling when the notice is nearly over (less
a safety margin for the releases and the exit) is abandoned and its prompts handed back; what the submitter has
not submitted by then is released too. Prompts leased but never handed to the engine are released at once.
"""

from __future__ import annotations

import threading
import time


class NoticeExpired(Exception):
    """Raised from the engine's ``while_running`` hook: the notice leaves no time to finish this call."""


def margin_s(notice_s: float) -> float:
    """What the worker keeps of a notice for its releases and exit: a quarter of it, 1 to 5 s."""
    return min(5.0, max(1.0, 0.25 * notice_s))


class Notice:
    """The deadline (monotonic, margin deducted) and which leased prompts the engine has (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.deadline: float | None = None
        self.given_at: float | None = None
        self._sampling: set[str] = set()

    def give(self, notice_s: float) -> bool:
        """Record a notice (a later one never extends an earlier one); True for the first."""
        now = time.monotonic()
        deadline = now + max(0.0, notice_s - margin_s(notice_s))
        with self._lock:
            first = self.deadline is None
            self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
            self.given_at = now if first else self.given_at
        return first

    @property
    def given(self) -> bool:
        return self.deadline is not None

    def left(self) -> float | None:
        """Seconds left to work (None: no notice)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def check(self) -> None:
        """The engine hook's check: raise once the time to work is over."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise NoticeExpired("preemption notice: the call would not finish in time")

    def take(self, prompt_ids: list[str], held: list[str]) -> bool:
        """The engine is about to sample these prompts: False (sample nothing) once a notice was given. ``held``
        (the ledger) prunes the record of prompts settled since."""
        with self._lock:
            if self.deadline is not None:
                return False
            self._sampling &= set(held)
            self._sampling.update(prompt_ids)
            return True

    def idle(self, held: list[str]) -> list[str]:
        """Held prompts the engine never got: nothing will come of them, so they go back at once."""
        with self._lock:
            return [p for p in held if p not in self._sampling]
