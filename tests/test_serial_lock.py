"""The serial lock (tests/serial_lock.py) between processes, as two xdist workers use it:
tests that are not serial run side by side; a serial one waits for them, and no test
starts while it runs."""

import multiprocessing as mp
import time

from serial_lock import turn


def _hold(base, serial: bool, start_after_s: float, hold_s: float, t0: float, spans):
    time.sleep(max(0.0, t0 + start_after_s - time.monotonic()))  # one clock for all
    asked = time.monotonic()
    with turn(serial, base):
        began = time.monotonic()
        time.sleep(hold_s)
        spans.put((serial, asked, began, time.monotonic()))


def _run(base, jobs) -> list[tuple]:
    ctx = mp.get_context("spawn")
    spans = ctx.Queue()
    t0 = time.monotonic() + 3.0  # after every process has started
    procs = [ctx.Process(target=_hold, args=(base, *job, t0, spans)) for job in jobs]
    for p in procs:
        p.start()
    out = [spans.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    return sorted(out, key=lambda s: s[2])


def test_tests_run_side_by_side_and_a_serial_one_alone(tmp_path):
    base = tmp_path / "run"
    # two plain tests at once; a serial one asked for while they run; a plain one asked
    # for while the serial one waits its turn
    spans = _run(base, [(False, 0.0, 1.5), (False, 0.0, 1.5), (True, 0.5, 1.0),
                        (False, 0.9, 0.5)])
    plain = [s for s in spans if not s[0]]
    serial = next(s for s in spans if s[0])
    first, second = plain[0], plain[1]
    assert second[2] < first[3]  # the two plain ones overlapped
    _, asked, began, ended = serial
    for s in plain:  # none overlaps the serial one
        assert s[3] <= began + 0.05 or s[2] >= ended - 0.05, (s, serial)
    late = plain[2]
    assert late[1] < began and late[2] >= ended - 0.05  # asked before it ran, ran after
