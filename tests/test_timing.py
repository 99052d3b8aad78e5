"""cpsparse.timing on its NumPy/CPU path: statistics, rotation, warm-up, probes, host time.

The CUDA paths (events, graphs, torch) need a GPU; here every clock is the
host's, and most tests drive a fake one so that the expected figures are exact.
"""

import subprocess
import types
import sys
import time

import numpy as np
import pytest

from cpsparse import timing


class FakeClock:
    """``time.perf_counter`` / ``perf_counter_ns`` that only move when a call 'costs'."""

    def __init__(self):
        self.now = 100.0                      # seconds

    def perf_counter(self):
        return self.now

    def perf_counter_ns(self):
        return int(round(self.now * 1e9))

    def spend(self, ms):
        self.now += ms / 1e3


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(timing.time, "perf_counter_ns", fake.perf_counter_ns)
    return fake


def test_summarize_median_and_percentiles():
    t = timing.summarize([5.0, 1.0, 2.0, 4.0, 3.0])
    assert t == {"median_ms": 3.0, "p10_ms": pytest.approx(1.4), "p90_ms": pytest.approx(4.6),
                 "iters": 5}
    assert timing.summarize([7.0], unit="us") == {"median_us": 7.0, "p10_us": 7.0,
                                                  "p90_us": 7.0, "iters": 1}
    with pytest.raises(ValueError, match="at least one"):
        timing.summarize([])


def test_percentiles_bracket_the_median_on_any_sample():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        t = timing.summarize(rng.exponential(size=n))
        assert t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
        assert t["iters"] == n


def test_time_cpu_measures_each_call_of_known_cost(clock):
    costs = iter([1000.0, 1000.0] + [float(c) for c in range(1, 11)])  # 2 warm-ups, 10 timed

    def fn():
        clock.spend(next(costs))

    t = timing.time_cpu(fn, warmup=2, iters=10)
    # the warm-ups (1 s each) are not in the figures; timed calls cost 1..10 ms
    assert t["iters"] == 10
    assert t["median_ms"] == pytest.approx(5.5)
    assert t["p10_ms"] == pytest.approx(1.9)
    assert t["p90_ms"] == pytest.approx(9.1)


def test_time_cpu_real_sleep():
    t = timing.time_cpu(time.sleep, [(0.003,)], warmup=1, iters=5)
    assert 2.9 <= t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
    assert t["median_ms"] < 100


def test_inputs_rotate_call_by_call(clock):
    seen = []

    def fn(i, tag):
        seen.append((i, tag))
        clock.spend(1.0 + i)

    inputs = [(0, "a"), (1, "b"), (2, "c")]
    t = timing.time_cpu(fn, inputs, warmup=2, iters=7)
    assert seen == [inputs[k % 3] for k in range(9)]
    # timed calls are calls 2..8: inputs 2, 0, 1, 2, 0, 1, 2 -> costs 3, 1, 2, 3, 1, 2, 3
    assert t["median_ms"] == pytest.approx(2.0)
    assert t["p90_ms"] == pytest.approx(3.0)


def test_bare_arguments_and_validation():
    seen = []
    timing.time_cpu(seen.append, [1, 2], warmup=0, iters=3)
    assert seen == [1, 2, 1]
    with pytest.raises(ValueError, match="iters"):
        timing.time_cpu(lambda: None, iters=0)
    with pytest.raises(ValueError, match="warmup"):
        timing.time_cpu(lambda: None, warmup=-1)
    with pytest.raises(ValueError, match="inputs"):
        timing.time_cpu(lambda: None, [])


def test_time_op_uses_the_cpu_clock_for_numpy(clock):
    t = timing.time_op(np, lambda: clock.spend(4.0), warmup=1, iters=3)
    assert t == {"median_ms": pytest.approx(4.0), "p10_ms": pytest.approx(4.0),
                 "p90_ms": pytest.approx(4.0), "iters": 3}


def test_time_host_in_microseconds(clock):
    costs = iter([50.0] + [0.010, 0.020, 0.030, 0.040, 0.050])     # ms: 10 .. 50 us

    def fn():
        clock.spend(next(costs))

    t = timing.time_host(fn, xp=np, warmup=1, iters=5)
    assert set(t) == {"median_us", "p10_us", "p90_us", "iters"}
    assert t["median_us"] == pytest.approx(30.0)
    assert t["p10_us"] == pytest.approx(14.0)
    assert t["iters"] == 5


def test_probe_times_the_inner_call_of_each_timed_call(clock):
    probe = timing.Probe(np)

    def inner(ms):
        clock.spend(ms)

    inner_timed = probe.wrap(inner)
    inner_costs = iter([100.0, 1.0, 2.0, 3.0])          # a warm-up, then 3 timed calls

    def driver():
        clock.spend(10.0)                               # the driver's own work
        inner_timed(next(inner_costs))

    t = timing.time_cpu(driver, warmup=1, iters=3, probe=probe)
    assert t["median_ms"] == pytest.approx(12.0)        # 10 + inner
    assert t["inner"]["median_ms"] == pytest.approx(2.0)
    assert t["inner"]["iters"] == 3                     # the warm-up's interval is dropped


def test_probe_start_stop_marks(clock):
    probe = timing.Probe(np)

    def driver():
        clock.spend(5.0)
        probe.start()
        clock.spend(2.0)
        probe.stop()

    t = timing.time_op(np, driver, warmup=0, iters=4, probe=probe)
    assert t["inner"]["median_ms"] == pytest.approx(2.0)
    assert t["median_ms"] == pytest.approx(7.0)
    with pytest.raises(RuntimeError, match="without start"):
        probe.stop()
    probe.start()
    with pytest.raises(RuntimeError, match="twice"):
        probe.start()


def test_probe_patch_restores_and_counts(clock):
    import types
    owner = types.SimpleNamespace(work=lambda ms: clock.spend(ms))
    original = owner.work
    probe = timing.Probe(np)
    with probe.patch(owner, "work"):
        assert owner.work is not original
        t = timing.time_cpu(lambda: owner.work(3.0), warmup=0, iters=2, probe=probe)
    assert owner.work is original
    assert t["inner"]["median_ms"] == pytest.approx(3.0)
    # a driver that does not call the probed function is an error, not a zero
    with probe.patch(owner, "work"):
        with pytest.raises(RuntimeError, match="recorded 0 intervals, expected 2"):
            timing.time_cpu(lambda: clock.spend(1.0), warmup=0, iters=2, probe=probe)


def test_probe_records_wrapped_calls_only_while_recording(clock):
    probe = timing.Probe(np)
    work = probe.wrap(lambda ms: clock.spend(ms))
    probe.recording = False
    work(5.0)                                           # runs, not recorded
    probe.recording = True
    work(2.0)
    assert clock.now == pytest.approx(100.007)
    assert probe.times_ms() == [pytest.approx(2.0)]


class FakeEventsXp:
    """The CuPy surface a Probe uses: events stamped by a fake clock, created counted."""

    def __init__(self, clock, create_ms=0.0):
        xp = self
        self.created = 0

        class Event:
            def __init__(self):
                xp.created += 1
                clock.spend(create_ms)          # cudaEventCreate's host time
                self.t = None

            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass

        self.cuda = types.SimpleNamespace(
            Event=Event, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3)


def test_probe_reuses_its_cuda_events_after_reset(clock):
    """Events are made by the warm-up's calls and recorded again by the timed ones: a
    timed interval never holds an event's creation."""
    xp = FakeEventsXp(clock)
    probe = timing.Probe(xp)
    work = probe.wrap(lambda ms: clock.spend(ms))

    def driver():
        work(1.0)
        work(2.0)

    driver()                                            # the warm-up: 4 marks, 4 events
    assert xp.created == 4
    for _ in range(3):
        probe.reset()
        driver()
        assert probe.times_ms() == [pytest.approx(1.0), pytest.approx(2.0)]
    assert xp.created == 4
    driver()                                            # without a reset: new events
    assert xp.created == 8 and len(probe.times_ms()) == 4
    probe.reserve(8)                                    # made now, used by the next marks
    assert xp.created == 16
    driver()
    probe.reserve(4)                                    # 4 of the 8 are still unused
    assert xp.created == 16
    driver()
    assert xp.created == 16 and len(probe.times_ms()) == 8


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_time_op_makes_the_timed_calls_events_after_the_warm_up(clock, warmup):
    """The clocks' loop makes every event of the timed calls after the warm-up, as many
    marks a call as the warm-up made: no interval holds an event's creation, whose host
    time (0.5 ms here) an interval of an idle GPU would read (a gated early return of
    0.002 ms read as 0.015). Without a warm-up the events come as the marks need them."""
    xp = FakeEventsXp(clock, create_ms=0.5)
    probe = timing.Probe(xp)
    work = probe.wrap(lambda ms: clock.spend(ms))

    def driver():
        clock.spend(3.0)
        work(1.0)

    t = timing.time_cpu(driver, warmup=warmup, iters=6, probe=probe)
    assert xp.created == (2 * 6 if warmup == 0 else 2 * max(warmup, 6))
    inner = 1.0 if warmup else 1.5
    assert probe.times_ms() == [pytest.approx(inner)] * 6
    assert t["inner"]["median_ms"] == pytest.approx(inner)


def test_numpy_has_no_graphs_and_no_ceilings():
    assert timing.try_time_graph(np, np.sum, [(np.ones(3),)]) == (
        None, "no CUDA graphs on the NumPy backend")
    assert timing.measure_ceilings(np) == {}
    timing.synchronize(np)


def test_importing_timing_touches_no_gpu():
    """Importing cpsparse.timing (and the bench) needs neither CuPy's device nor torch."""
    code = ("import sys\n"
            "import cpsparse.timing, cpsparse.bench\n"
            "bad = [m for m in ('cupy', 'torch') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_time_graph_waits_for_the_callers_stream(monkeypatch):
    """The side stream of time_graph does not wait for the caller's (non-blocking): the
    inputs, made on the caller's stream, must be finished before the first call reads
    them, and the replays must not run beside the caller's work. A fake CuPy records
    the order of events."""
    events = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def synchronize(self):
            events.append(f"sync {self.name}")

        def __enter__(self):
            events.append(f"enter {self.name}")
            return self

        def __exit__(self, *exc):
            return False

        def begin_capture(self):
            events.append("capture")

        def end_capture(self):
            return types.SimpleNamespace(launch=lambda stream: events.append("replay"))

    caller = FakeStream("caller")
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: caller,
        Stream=lambda non_blocking=False: FakeStream("side")))
    monkeypatch.setattr(timing, "cupy", lambda: fake_cupy)

    def fake_time_cuda(fn, inputs=None, *, warmup=3, iters=30, probe=None):
        fn()
        return timing.summarize([2.0, 2.0])

    monkeypatch.setattr(timing, "time_cuda", fake_time_cuda)
    got = timing.time_graph(lambda x: events.append(f"call {x}"), [(1,), (2,)], reps=2)
    assert got["median_ms"] == 1.0 and got["reps"] == 2
    assert events.index("sync caller") < events.index("enter side") < events.index("call 1")
    assert events.count("call 1") == 2 and "replay" in events


# ---- held probes (GPU time alone) ---------------------------------------------------

class FakeHeldXp(FakeEventsXp):
    """FakeEventsXp whose event records cost ``record_ms`` of the fake clock (what an
    empty held interval reads) and log, with the probe's holds, the order of both."""

    def __init__(self, clock, log, record_ms=0.0):
        super().__init__(clock)
        Event = self.cuda.Event

        class LoggedEvent(Event):
            def record(self):
                log.append("record")
                clock.spend(record_ms)
                super().record()

        self.cuda.Event = LoggedEvent
        self.cuda.get_current_stream = lambda: types.SimpleNamespace(synchronize=lambda: None)


@pytest.fixture
def holds(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "_hold_stream", lambda xp, ms: log.append(("hold", ms)))
    return log


def test_hold_needs_cupy_and_a_positive_time(clock):
    with pytest.raises(ValueError, match="Invalid hold_ms: holding the stream needs the CuPy"):
        timing.Probe(np, hold_ms=1.0)
    xp = FakeEventsXp(clock)
    for bad in (0, -1.0, True, "1", float("nan"), float("inf")):
        with pytest.raises(ValueError, match="Invalid hold_ms: expected a finite number > 0"):
            timing.Probe(xp, hold_ms=bad)
    assert timing.Probe(xp, hold_ms=2).hold_ms == 2


def test_held_probe_holds_the_stream_before_each_start_event(clock, holds):
    xp = FakeHeldXp(clock, holds)
    probe = timing.Probe(xp, hold_ms=3.0)
    work = probe.wrap(lambda ms: clock.spend(ms))
    work(0.5)
    probe.start()
    probe.stop()
    assert holds == [("hold", 3.0), "record", "record", ("hold", 3.0), "record", "record"]
    unheld_probe = timing.Probe(xp)                     # no hold_ms: no hold launched
    holds.clear()
    unheld_probe.wrap(lambda: None)()
    assert holds == ["record", "record"]
    assert unheld_probe.unheld() == 0


def test_unheld_counts_intervals_the_host_took_over_half_the_hold(clock, holds):
    xp = FakeHeldXp(clock, holds)
    probe = timing.Probe(xp, hold_ms=1.0)
    work = probe.wrap(lambda ms: clock.spend(ms))
    for ms in (0.2, 0.6, 0.4, 0.51):
        work(ms)
    assert probe.host_times_ms() == [pytest.approx(m) for m in (0.2, 0.6, 0.4, 0.51)]
    assert probe.unheld() == 2
    assert probe.unheld(last=2) == 1 and probe.unheld(last=0) == 0   # the timed ones only
    s = probe.summary(expected=4, floor_ms=0.3)
    assert (s["hold_ms"], s["floor_ms"], s["unheld"]) == (1.0, 0.3, 2)
    # less the floor, never below 0
    assert probe.times_ms(0.3) == [0.0, pytest.approx(0.3), pytest.approx(0.1),
                                   pytest.approx(0.21)]
    assert s["median_ms"] == pytest.approx(0.155)
    probe.reset()
    assert probe.host_times_ms() == [] and probe.unheld() == 0


def test_host_times_on_numpy_equal_the_intervals(clock):
    probe = timing.Probe(np)
    work = probe.wrap(lambda ms: clock.spend(ms))
    work(1.5)
    work(0.25)
    assert probe.host_times_ms() == probe.times_ms() == [pytest.approx(1.5),
                                                          pytest.approx(0.25)]
    assert "hold_ms" not in probe.summary()


def test_held_floor_is_what_an_empty_held_interval_reads(clock, holds, monkeypatch):
    assert timing.held_floor_ms(np) == 0.0
    xp = FakeHeldXp(clock, holds, record_ms=0.0013)
    monkeypatch.setattr(timing, "cupy", lambda: xp)
    assert timing.held_floor_ms(xp, 0.5, warmup=1, iters=4) == pytest.approx(0.0013)
    assert holds.count(("hold", 0.5)) == 5


def test_hold_for_covers_the_slowest_host_interval():
    assert timing.hold_for([0.1, 0.7, 0.3]) == pytest.approx(2.8)
    assert timing.hold_for([0.01]) == 1.0
    assert timing.hold_for(0.3, least_ms=0.5) == pytest.approx(1.2)


@pytest.mark.gpu
def test_held_probe_reads_gpu_time_and_no_host_time():
    """The hold keeps the stream for its time. Behind it, host work inside an interval
    does not show: an interval of host sleep alone reads the empty interval's floor, a
    kernel reads the same with or without host sleep after it, two kernels with host
    sleep between them read twice one. Without a hold the sleep shows; with a hold
    shorter than the host's interval the leak shows and is counted unheld."""
    import cupy as cp
    hold = timing.time_cuda(lambda: timing._hold_stream(cp, 20.0), warmup=1, iters=3)
    assert 19.0 < hold["median_ms"] < 30.0
    floor = timing.held_floor_ms(cp, iters=10)
    assert 0.0 <= floor < 0.05
    x = cp.random.random(1 << 25, dtype=cp.float32)     # 128 MB in, 128 MB out a kernel
    y = cp.empty_like(x)

    def interval(hold_ms, kernels, sleep_s):
        probe = timing.Probe(cp, hold_ms=hold_ms)

        def call():
            probe.start()
            for _ in range(kernels):
                cp.multiply(x, 2.0, out=y)
                time.sleep(sleep_s)                     # host only, after each launch
            if not kernels:
                time.sleep(sleep_s)
            probe.stop()
        timing.time_cuda(call, warmup=1, iters=5, probe=probe)
        return probe.summary(expected=5, floor_ms=floor if hold_ms else 0.0)

    assert interval(None, 0, 0.005)["median_ms"] > 4.5          # unheld: the sleep shows
    empty = interval(50.0, 0, 0.005)
    assert empty["unheld"] == 0 and empty["median_ms"] < 0.02
    one = interval(50.0, 1, 0.0)["median_ms"]
    assert one > 0.03, "the test kernel is too small to tell anything"
    slept = interval(50.0, 1, 0.005)
    assert slept["unheld"] == 0 and slept["median_ms"] == pytest.approx(one, rel=0.15)
    two = interval(50.0, 2, 0.005)
    assert two["unheld"] == 0 and two["median_ms"] == pytest.approx(2 * one, rel=0.25)
    short = interval(2.0, 0, 0.005)                     # 5 ms of host behind a 2 ms hold
    assert short["unheld"] == 5 and short["median_ms"] > 2.0
