"""A receiver's pause / sleep / update state, and the rules that follow from it.

One plain object, written by the control calls (``receiver/control/controller.py``) and asked by
the session loop (``receiver/session/follower.py``): may a session start, may this version be
committed now. Pure (no sockets, no event loop), so the rules are tested on their own.
The control lock serialises its writers; the session loop only reads it, waking on the
receiver's notification after each change.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field

from protocol.errors import StateError

from .engine import KV_CACHE, WEIGHT


@dataclass
class ControlState:
    """What the control calls decided. ``hold`` (fixed) commits only inside update_weights."""

    hold: bool = False
    paused: bool = False  # no new version commits (except up to apply_until)
    asleep: set[str] = field(default_factory=set)  # memory tags sleep released: weight, kv_cache
    apply_until: int | None = None  # while paused: update_weights lets versions through up to here
    rejoin: bool = False  # while paused: a control call needs a session (wakeup, update_weights)
    leaving: bool = False  # a control call asked the session to end

    def __post_init__(self) -> None:
        self.paused = self.paused or self.hold  # a held receiver is paused for good

    def may_connect(self) -> bool:
        """May a new session start: not while leaving or with the weights asleep, and
        while paused only when a control call needs one (or the receiver holds)."""
        if self.leaving or WEIGHT in self.asleep:
            return False
        return not self.paused or self.rejoin or self.hold

    def may_commit(self, version: int | None, current: int | None) -> bool:
        """May ``version`` be committed over ``current``, the applied one. True while
        leaving, so the waiting version wakes at once and the session ends."""
        if self.leaving:
            return True
        if not self.paused or version == current:  # the same version again is a repair (resync)
            return True
        until = self.apply_until
        return until is not None and (current is None or current < until)

    def check_resume(self) -> None:
        """``StateError`` unless resume may run (a held receiver never resumes)."""
        if self.hold:
            raise StateError("a held receiver (hold=True) commits only in update_weights; it cannot resume")
        self.check_awake()

    def check_update(self) -> None:
        """``StateError`` unless update_weights may run: paused and nothing asleep."""
        if not self.paused:
            raise StateError("Pause LLM Engine first: update_weights needs a paused receiver (it never resumes by itself)")
        self.check_awake()

    def check_awake(self) -> None:
        if self.asleep:
            raise StateError(f"{sorted(self.asleep)} asleep: wakeup first")

    def check_wakeup(self, wanted: Set[str], require_resume: bool) -> None:
        """``StateError`` for a wakeup of ``wanted`` that must not run: weights before the
        KV cache, or (``require_resume``) one that leaves a tag asleep."""
        left = sorted(self.asleep - wanted)
        if require_resume and left:
            raise StateError(f"wakeup of {sorted(wanted)} would leave {left} asleep, and generating on freed memory is unsafe, "
                             f"so the engine would stay paused: wake {sorted(self.asleep)} together (or give no tags)")
        if WEIGHT in wanted and KV_CACHE not in wanted and KV_CACHE in self.asleep:
            raise StateError("the KV cache is asleep: wake it before or with the weights (tags=kv_cache,weight)")
