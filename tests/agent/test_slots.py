"""``Slots``: the decode-slot semaphore on a C queue."""

from __future__ import annotations

import threading

import pytest

from device_agents.pipeline.slots import Slots


def test_slots_hand_out_capacity_then_wait_for_a_release() -> None:
    slots = Slots(2)
    assert slots.acquire(0) and slots.acquire(0)
    assert not slots.acquire(0.01)  # none free: times out
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(slots.acquire(30)))
    waiter.start()
    slots.release()
    waiter.join(30)
    assert got == [True] and slots.free() == 0


def test_slots_refuse_a_capacity_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Slots(0)
