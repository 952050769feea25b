"""A timed step's timeline over several processes: a transfer's wait is idle, not work."""

import math

from dynjax.balance.schedules import Task
from dynjax.parallel.profile import busy_seconds
from dynjax.parallel.timeline import _READY, _TRANSFER, _timeline

NO = -math.inf


def test_a_transfer_holding_the_device_delays_the_next_task_and_counts_as_idle():
    """Stage 0 of two processes: F1 waits on the device until F0's transfer ends at 4.0 (the
    other process took part only then), so F1 runs 4.0-4.5, not 1.0-4.5; a transfer the
    watcher found already done when it looked says nothing (B0 starts when F1 ends)."""
    f0, f1, b0 = Task("F", 0), Task("F", 1), Task("B", 0)
    # (task, dispatched, the arrival of what it waits for from before the step, its end,
    # whether the watcher saw it end)
    row = [(_READY, 0.0, NO, 0.0, False), (f0, 0.0, NO, 1.0, True),
           (_TRANSFER, 0.0, NO, 4.0, True), (f1, 0.1, NO, 4.5, True),
           (_TRANSFER, 0.1, NO, 4.6, False), (b0, 0.2, NO, 5.0, True)]
    (times,) = _timeline({0: row}, 0.0).values()
    assert [(t.kind, t.microbatch, t.start, t.end) for t in times] == [
        ("F", 0, 0.0, 1.0), ("F", 1, 4.0, 4.5), ("B", 0, 4.5, 5.0)]
    assert busy_seconds(times) == 2.0  # of a 5 s step: 3 s waiting for the other process
    # Without the transfers' ends, F1 would count the wait as its work.
    plain = [entry for entry in row if entry[0] != _TRANSFER]
    (times,) = _timeline({0: plain}, 0.0).values()
    assert busy_seconds(times) == 5.0


def test_a_received_transfer_delays_the_first_task_that_computes_after_it():
    """The last stage of two processes: its forward runs inside its backward, so F0 computes
    nothing here and is noted at its dispatch (0.5), before F0's input arrives (3.0); B0,
    which computes, starts then: the wait for the other process is idle time."""
    f0, b0 = Task("F", 0), Task("B", 0)
    row = [(_READY, 0.0, NO, 0.0, False), (_TRANSFER, 0.1, NO, 3.0, True),
           (f0, 0.5, NO, 0.5, False), (b0, 0.5, NO, 4.0, True)]
    (times,) = _timeline({1: row}, 0.0).values()
    assert [(t.kind, t.start, t.end) for t in times] == [("F", 0.5, 0.5), ("B", 3.0, 4.0)]
    assert busy_seconds(times) == 1.0
