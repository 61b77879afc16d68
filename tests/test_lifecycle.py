"""ControlState on its own: when a session may start and a version may commit, and
which control calls the state refuses. No sockets, no event loop."""

from __future__ import annotations

import pytest

from protocol.errors import StateError
from receiver.engine import KV_CACHE, WEIGHT
from receiver.lifecycle import ControlState


def test_a_held_state_starts_paused() -> None:
    assert ControlState(hold=True).paused
    assert not ControlState().paused


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (ControlState(), True),
        (ControlState(paused=True), False),  # paused: no new session until a call needs one
        (ControlState(paused=True, rejoin=True), True),
        (ControlState(hold=True), True),  # a held receiver stays connected
        (ControlState(leaving=True), False),
        (ControlState(hold=True, rejoin=True, leaving=True), False),
        (ControlState(paused=True, asleep={WEIGHT}, rejoin=True), False),  # no weights: nothing to sync into
        (ControlState(paused=True, asleep={KV_CACHE}, rejoin=True), True),
    ],
)
def test_may_connect(state: ControlState, expected: bool) -> None:
    assert state.may_connect() is expected


@pytest.mark.parametrize(
    ("state", "version", "current", "expected"),
    [
        (ControlState(), 5, 4, True),
        (ControlState(paused=True), 5, 4, False),
        (ControlState(paused=True), 4, 4, True),  # the same version again: a repair
        (ControlState(paused=True, apply_until=6), 5, 4, True),
        (ControlState(paused=True, apply_until=6), 7, 5, True),  # below the target: a resync may land past it
        (ControlState(paused=True, apply_until=6), 7, 6, False),  # reached: the rest wait
        (ControlState(paused=True, apply_until=6), 3, None, True),  # nothing held yet
        (ControlState(paused=True, leaving=True), 5, 4, True),  # wakes the waiter, which then leaves
        (ControlState(hold=True), 1, 0, False),
    ],
)
def test_may_commit(state: ControlState, version: int, current: int | None, expected: bool) -> None:
    assert state.may_commit(version, current) is expected


def test_refused_calls() -> None:
    with pytest.raises(StateError, match="cannot resume"):
        ControlState(hold=True).check_resume()
    with pytest.raises(StateError, match="asleep: wakeup first"):
        ControlState(paused=True, asleep={KV_CACHE}).check_resume()
    ControlState(paused=True).check_resume()

    with pytest.raises(StateError, match="Pause LLM Engine first"):
        ControlState().check_update()
    with pytest.raises(StateError, match="asleep: wakeup first"):
        ControlState(paused=True, asleep={WEIGHT}).check_update()
    ControlState(paused=True).check_update()

    both = ControlState(paused=True, asleep={WEIGHT, KV_CACHE})
    with pytest.raises(StateError, match="wake it before or with the weights"):
        both.check_wakeup({WEIGHT}, require_resume=False)
    with pytest.raises(StateError, match=r"would leave \['weight'\] asleep"):
        both.check_wakeup({KV_CACHE}, require_resume=True)
    both.check_wakeup({KV_CACHE}, require_resume=False)
    both.check_wakeup({WEIGHT, KV_CACHE}, require_resume=True)
    assert both.asleep == {WEIGHT, KV_CACHE}  # checks change nothing
