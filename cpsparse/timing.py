"""The one timing module of cpsparse: ``python -m cpsparse.bench`` and every
``benchmarks/`` script time through it, and nothing else in the repository
reads a clock or records a CUDA event.

Method (the same on every path):

* warm-up calls first (compilation, memory-pool fill, handle creation);
* ``inputs`` is a list of argument tuples, rotated call by call (call ``i``
  gets ``inputs[i % len(inputs)]``) so that repeated calls do not just
  measure the L2 cache;
* every timed call is measured on its own; the result is the median with the
  10th and 90th percentiles (linear interpolation) and the iteration count:
  ``{"median_ms", "p10_ms", "p90_ms", "iters"}`` (``*_us`` for host times).

Clocks:

==========================  ==================================================
:func:`time_cpu`            ``time.perf_counter`` (the NumPy path)
:func:`time_cuda`           CuPy CUDA events on the current stream
:func:`time_torch`          torch CUDA events on torch's current stream
:func:`time_op`             :func:`time_cpu` for NumPy, :func:`time_cuda` for CuPy
:func:`time_graph`          ``reps`` calls captured once in a CUDA graph (CuPy),
                            replayed; per-call times
:func:`time_graph_torch`    the same for torch callables
:func:`try_time_graph`      :func:`time_graph` or why not (NumPy, not capturable)
:func:`time_host`           wall time until a Python call returns, on an idle
                            GPU (``perf_counter_ns``, microseconds)
:class:`Probe`              intervals inside a driver's call (a wrapped inner
                            function, or manual start/stop marks), on the same
                            clock as the call around them, or (``hold_ms``)
                            their GPU time alone
:func:`held_floor_ms`       what a held interval reads with nothing in it
==========================  ==================================================

Ceilings, measured one way for every script (:func:`measure_ceilings`):
device-to-device copy bandwidth (TB/s, bytes read + written, CuPy) and the
bf16 and fp8 GEMM rates (TFLOP/s, torch when it is installed).

Examples
--------
>>> import numpy as np
>>> from cpsparse import timing
>>> inputs = [(np.ones(1000),), (np.zeros(1000),)]
>>> t = timing.time_op(np, np.sum, inputs, warmup=1, iters=20)
>>> sorted(t), t["iters"]
(['iters', 'median_ms', 'p10_ms', 'p90_ms'], 20)
>>> t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
True
"""

import contextlib
import functools
import time

import numpy

__all__ = ["summarize", "time_cpu", "time_cuda", "time_torch", "time_op", "time_graph",
           "time_graph_torch", "try_time_graph", "time_host", "Probe", "hold_for",
           "held_floor_ms", "cupy",
           "torch_or_none", "synchronize", "copy_bandwidth_tbs", "bf16_gemm_tflops",
           "fp8_gemm_tflops", "measure_ceilings"]


# ---- backends ----------------------------------------------------------------

def cupy():
    """The ``cupy`` module (imported on first use: importing this module needs no GPU).

    Examples
    --------
    >>> from cpsparse import timing
    >>> callable(timing.cupy)
    True
    """
    import cupy as cp
    return cp


def torch_or_none():
    """``torch`` when it imports and sees a CUDA device, else None (an optional peer).

    Examples
    --------
    >>> from cpsparse import timing
    >>> timing.torch_or_none() is None or hasattr(timing.torch_or_none(), "cuda")
    True
    """
    try:
        import torch
    except Exception:  # noqa: BLE001 - the peer is optional
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a torch without a driver
        return None


def synchronize(xp=numpy):
    """Wait until the device of ``xp`` is idle (no-op for NumPy).

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse import timing
    >>> timing.synchronize(np)
    """
    if xp is not numpy:
        xp.cuda.Device().synchronize()


# ---- statistics ----------------------------------------------------------------

def summarize(times, unit="ms"):
    """Median, 10th and 90th percentiles and count of ``times``.

    Parameters
    ----------
    times : sequence of float
        One measurement per timed call, in ``unit``.
    unit : str
        Suffix of the keys (``"ms"`` or ``"us"``).

    Returns
    -------
    dict
        ``{"median_<unit>", "p10_<unit>", "p90_<unit>", "iters"}`` (floats, and
        the number of measurements). Percentiles interpolate linearly, so
        ``p10 <= median <= p90`` always holds.

    Examples
    --------
    >>> from cpsparse.timing import summarize
    >>> summarize([5.0, 1.0, 2.0, 4.0, 3.0])
    {'median_ms': 3.0, 'p10_ms': 1.4, 'p90_ms': 4.6, 'iters': 5}
    >>> summarize([10.0, 20.0], unit="us")["median_us"]
    15.0
    """
    values = numpy.asarray(list(times), dtype=numpy.float64)
    if values.size == 0:
        raise ValueError("Invalid times: expected at least one measurement")
    p10, median, p90 = numpy.percentile(values, [10, 50, 90])
    return {f"median_{unit}": float(median), f"p10_{unit}": float(p10),
            f"p90_{unit}": float(p90), "iters": int(values.size)}


def _rotation(inputs):
    inputs = [()] if inputs is None else list(inputs)
    if not inputs:
        raise ValueError("Invalid inputs: expected a non-empty list of argument tuples")
    return [args if isinstance(args, tuple) else (args,) for args in inputs]


def _check_counts(warmup, iters):
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"Invalid warmup: expected an int >= 0, got {warmup!r}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"Invalid iters: expected an int >= 1, got {iters!r}")


def _measure(fn, inputs, warmup, iters, clock, probe, unit="ms"):
    """The loop every clock shares: warm-up, then ``iters`` calls measured one by one.

    ``clock`` is ``(begin, end)``: ``begin()`` before a call, ``end()`` after it
    returns the call's time. Call ``i`` (warm-ups included) gets
    ``inputs[i % len(inputs)]``.
    """
    _check_counts(warmup, iters)
    inputs = _rotation(inputs)
    n = len(inputs)
    begin, end, settle = clock
    for i in range(warmup):
        fn(*inputs[i % n])
    settle()
    if probe is not None:
        probe.restart(warmup, iters)
    times = []
    for i in range(warmup, warmup + iters):
        args = inputs[i % n]
        begin()
        fn(*args)
        times.append(end())
    out = summarize(times, unit)
    if probe is not None:
        out["inner"] = probe.summary(expected=iters)
    return out


# ---- the clocks ----------------------------------------------------------------

def time_cpu(fn, inputs=None, *, warmup=1, iters=10, probe=None):
    """Milliseconds of ``fn(*inputs[i % len(inputs)])`` by ``time.perf_counter``.

    The NumPy path (the float64 reference runs synchronously on the CPU).

    Parameters
    ----------
    fn : callable
    inputs : list of tuple, optional
        Argument tuples, rotated call by call (default: one empty tuple).
    warmup, iters : int
        Untimed calls first, then timed calls.
    probe : Probe, optional
        Also summarize the probe's intervals of the timed calls (key ``"inner"``);
        the probe must record exactly one interval per call.

    Returns
    -------
    dict
        ``{"median_ms", "p10_ms", "p90_ms", "iters"}`` (and ``"inner"``).

    Examples
    --------
    >>> import time
    >>> from cpsparse.timing import time_cpu
    >>> t = time_cpu(time.sleep, [(0.002,)], warmup=0, iters=5)
    >>> 1.9 < t["median_ms"] < 50
    True
    """
    state = {}

    def begin():
        state["t0"] = time.perf_counter()

    def end():
        return (time.perf_counter() - state["t0"]) * 1e3

    return _measure(fn, inputs, warmup, iters, (begin, end, lambda: None), probe)


def time_cuda(fn, inputs=None, *, warmup=3, iters=30, probe=None):
    """Milliseconds of each ``fn(*args)`` between two CuPy CUDA events.

    The events are recorded on the current CuPy stream (enter ``with stream:``
    to time another one); the stream is synchronized after the warm-up and
    after every call, so each call starts on an idle stream. The time includes
    the gaps where the GPU waits for the host to launch (eager time).

    Parameters and result as :func:`time_cpu`.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.timing import time_op
    >>> time_op(np, np.sort, [(np.arange(10.0),)], warmup=0, iters=3)["iters"]
    3

    On a GPU (``time_op`` dispatches CuPy inputs here):

    >>> import cupy as cp                                   # doctest: +SKIP
    >>> x = [(cp.random.random(1 << 20),) for _ in range(3)]  # doctest: +SKIP
    >>> time_cuda(cp.sort, x)["median_ms"]                  # doctest: +SKIP
    0.09
    """
    cp = cupy()
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def begin():
        start.record()

    def end():
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop)

    def settle():
        cp.cuda.get_current_stream().synchronize()

    return _measure(fn, inputs, warmup, iters, (begin, end, settle), probe)


def time_torch(fn, inputs=None, *, warmup=3, iters=30, probe=None):
    """Like :func:`time_cuda` for torch callables (torch's events, its current stream).

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.timing import time_cpu
    >>> time_cpu(np.max, [(np.arange(5),)], warmup=0, iters=2)["iters"]
    2

    With torch and a GPU:

    >>> import torch                                          # doctest: +SKIP
    >>> a = torch.randn(4096, 4096, device="cuda")            # doctest: +SKIP
    >>> time_torch(lambda: a @ a)["median_ms"]                # doctest: +SKIP
    0.25
    """
    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("time_torch needs torch with a CUDA device")
    state = {}

    def begin():
        state["start"] = torch.cuda.Event(enable_timing=True)
        state["stop"] = torch.cuda.Event(enable_timing=True)
        state["start"].record()

    def end():
        state["stop"].record()
        state["stop"].synchronize()
        return state["start"].elapsed_time(state["stop"])

    return _measure(fn, inputs, warmup, iters, (begin, end, torch.cuda.synchronize), probe)


def time_op(xp, fn, inputs=None, *, warmup=3, iters=30, probe=None):
    """Time ``fn`` on the clock of the backend ``xp``: perf_counter (NumPy) or CUDA events.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.timing import time_op
    >>> inputs = [(np.full(64, float(i)),) for i in range(3)]
    >>> t = time_op(np, np.cumsum, inputs, warmup=2, iters=9)
    >>> t["iters"], t["p10_ms"] <= t["median_ms"] <= t["p90_ms"]
    (9, True)
    """
    if xp is numpy:
        return time_cpu(fn, inputs, warmup=warmup, iters=iters, probe=probe)
    return time_cuda(fn, inputs, warmup=warmup, iters=iters, probe=probe)


def _per_call(t, reps):
    out = {k: (v / reps if k.endswith(("_ms", "_us")) else v) for k, v in t.items()}
    out["reps"] = reps
    return out


def time_graph(fn, inputs=None, *, reps=10, warmup=2, iters=30):
    """Per-call milliseconds of ``reps`` calls captured once in a CUDA graph, replayed (CuPy).

    Each input is run once eagerly on a side stream (compilation, shared-memory
    limits, memory-pool blocks), then ``reps`` calls over the rotating inputs
    are captured on that stream into one graph; every replay is timed with
    CUDA events (:func:`time_cuda`) and divided by ``reps``. The result is the
    device time without Python launch overhead. What the captured calls
    return is kept alive until the timing ends (their memory is the graph's).

    Returns
    -------
    dict
        As :func:`time_cuda`, per call, plus ``"reps"``.

    Raises
    ------
    Exception
        Whatever the capture raised (an op that reads the device from the host
        cannot be captured); the stream leaves capture mode first.

    Examples
    --------
    >>> from cpsparse.timing import try_time_graph
    >>> import numpy as np
    >>> try_time_graph(np, np.sum, [(np.ones(3),)])
    (None, 'no CUDA graphs on the NumPy backend')

    On a GPU:

    >>> import cupy as cp                                      # doctest: +SKIP
    >>> x = [(cp.random.random(1 << 20),) for _ in range(3)]   # doctest: +SKIP
    >>> time_graph(cp.sum, x, reps=10)["median_ms"]            # doctest: +SKIP
    0.006
    """
    cp = cupy()
    inputs = _rotation(inputs)
    # The inputs were made on the caller's stream; the side stream does not wait for it
    # (non-blocking): without this the first calls could read them half written, and
    # the replays run beside the caller's unfinished work.
    cp.cuda.get_current_stream().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for args in inputs:
            fn(*args)
        stream.synchronize()
        stream.begin_capture()
        keep = []
        try:
            for i in range(reps):
                keep.append(fn(*inputs[i % len(inputs)]))
        except BaseException:
            with contextlib.suppress(Exception):
                stream.end_capture()
            raise
        graph = stream.end_capture()
        t = time_cuda(lambda: graph.launch(stream), warmup=warmup, iters=iters)
    del keep, graph
    return _per_call(t, reps)


def time_graph_torch(fn, inputs=None, *, reps=10, warmup=2, iters=30):
    """Like :func:`time_graph` for torch callables (``torch.cuda.CUDAGraph``).

    Examples
    --------
    >>> from cpsparse.timing import summarize
    >>> summarize([2.0, 4.0])["median_ms"]
    3.0

    With torch and a GPU:

    >>> import torch                                           # doctest: +SKIP
    >>> x = [(torch.randn(1 << 20, device="cuda"),)]           # doctest: +SKIP
    >>> time_graph_torch(torch.sum, x)["median_ms"]            # doctest: +SKIP
    0.006
    """
    torch = torch_or_none()
    if torch is None:
        raise RuntimeError("time_graph_torch needs torch with a CUDA device")
    inputs = _rotation(inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in inputs:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keep = [fn(*inputs[i % len(inputs)]) for i in range(reps)]
    t = time_torch(graph.replay, warmup=warmup, iters=iters)
    del keep, graph
    return _per_call(t, reps)


def try_time_graph(xp, fn, inputs=None, *, reps=10, warmup=2, iters=30):
    """``(time_graph(...), note)``, or ``(None, why)`` on NumPy or when capture fails.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.timing import try_time_graph
    >>> try_time_graph(np, np.sum, [(np.ones(3),)])
    (None, 'no CUDA graphs on the NumPy backend')
    """
    if xp is numpy:
        return None, "no CUDA graphs on the NumPy backend"
    try:
        t = time_graph(fn, inputs, reps=reps, warmup=warmup, iters=iters)
    except Exception as exc:  # noqa: BLE001 - report why capture is not possible
        return None, f"not capturable: {type(exc).__name__}: {str(exc)[:120]}"
    return t, f"captured: {reps} calls per graph"


def time_host(fn, inputs=None, *, xp=numpy, warmup=20, iters=200):
    """Host time of a call: microseconds until ``fn(*args)`` returns, on an idle device.

    Before each call the device is synchronized (nothing queued), then the call
    alone is timed with ``time.perf_counter_ns``: for asynchronous CuPy launches
    this is the Python + launch overhead, not the kernel time.

    Parameters
    ----------
    fn : callable
    inputs : list of tuple, optional
        Rotated as in :func:`time_cpu`.
    xp : module
        ``numpy`` (nothing to synchronize) or ``cupy``.
    warmup, iters : int

    Returns
    -------
    dict
        ``{"median_us", "p10_us", "p90_us", "iters"}``.

    Examples
    --------
    >>> import time
    >>> from cpsparse.timing import time_host
    >>> t = time_host(time.sleep, [(0.001,)], warmup=1, iters=5)
    >>> t["median_us"] > 900, sorted(t)
    (True, ['iters', 'median_us', 'p10_us', 'p90_us'])
    """
    state = {}

    def begin():
        synchronize(xp)
        state["t0"] = time.perf_counter_ns()

    def end():
        return (time.perf_counter_ns() - state["t0"]) / 1e3

    try:
        return _measure(fn, inputs, warmup, iters,
                        (begin, end, functools.partial(synchronize, xp)), None, unit="us")
    finally:
        synchronize(xp)


# ---- intervals inside a driver -----------------------------------------------------

class Probe:
    """Intervals inside a timed call, on the clock of the call around them.

    A driver (a layer forward, a draft round) is timed as a whole; a probe
    times a part of it: every call of a wrapped inner function
    (:meth:`wrap`, :meth:`patch`), or the span between :meth:`start` and
    :meth:`stop` marks placed in the driver's callbacks. On CuPy each mark
    is a CUDA event on the current stream (read after a synchronize, in
    :meth:`times_ms`); on NumPy it is ``time.perf_counter``. The events are
    kept and recorded again after :meth:`reset`, and :func:`time_op` makes the
    timed calls' events after the warm-up (:meth:`restart`, as many marks a call
    as the warm-up made), so a timed call creates none: what an interval holds on
    an idle GPU is the host time between two ``record()`` calls, not a
    ``cudaEventCreate``. A probe not handed to :func:`time_op` can
    :meth:`reserve` its events instead.

    A wrapped call is recorded only while :attr:`recording` is true (default):
    a driver's callbacks can switch it to time the calls of some of its steps.

    On CuPy an interval of an idle GPU holds host time: a call that launches
    nothing (a gated early return) measures the host's Python between its two
    ``record()`` calls, and one that launches kernels measures them plus the
    host's gaps between launches. ``hold_ms`` measures the GPU's side alone: each
    :meth:`start` first enqueues a kernel that keeps the stream busy for ``hold_ms``
    (``raw_kernels.quant.hold_stream``), so that the host enqueues the whole
    interval while the GPU is still behind it and the two events bound the
    interval's GPU busy span: its kernels and the GPU's own gaps between them
    (each launch's latency on the GPU; the first kernel also loses the overlap
    programmatic dependent launch would give it behind the start event), no host
    time. A profiler's kernel time, the sum of the kernels alone, is a little less.
    That holds only while the host enqueues an interval in well under ``hold_ms``:
    :meth:`unheld` counts the intervals whose host span (:meth:`host_times_ms`,
    recorded on both backends) exceeded half of it, and :func:`held_floor_ms`
    measures what two events with nothing between them read under a hold, to
    subtract (``times_ms(floor_ms=)``). The calls around the probe then include
    the holds: time them in another pass.

    Parameters
    ----------
    xp : module
        ``numpy`` or ``cupy``.
    hold_ms : float, optional
        CuPy only (NumPy intervals are host time): hold the stream this long
        before each interval.

    Examples
    --------
    >>> import time
    >>> import numpy as np
    >>> from cpsparse.timing import Probe, time_op
    >>> probe = Probe(np)
    >>> inner = probe.wrap(time.sleep)
    >>> def driver(x):
    ...     time.sleep(0.001)
    ...     inner(0.002)
    >>> t = time_op(np, driver, [(0,)], warmup=1, iters=5, probe=probe)
    >>> t["inner"]["iters"], t["inner"]["median_ms"] < t["median_ms"]
    (5, True)
    """

    def __init__(self, xp=numpy, *, hold_ms=None):
        if hold_ms is not None:
            if xp is numpy:
                raise ValueError("Invalid hold_ms: holding the stream needs the CuPy "
                                 "backend (NumPy intervals are host time), got "
                                 f"hold_ms={hold_ms!r} with NumPy")
            if isinstance(hold_ms, bool) or not isinstance(hold_ms, (int, float)) \
                    or not 0 < hold_ms < float("inf"):
                raise ValueError("Invalid hold_ms: expected a finite number > 0, got "
                                 f"{hold_ms!r}")
        self.xp = xp
        self.hold_ms = hold_ms
        self.recording = True
        self._events = []               # CUDA events made so far, reused after reset()
        self.reset()

    def reset(self):
        """Forget the recorded intervals (and an open start mark)."""
        self._intervals = []
        self._host = []                 # perf_counter at each interval's start and stop
        self._open = None
        self._used = 0

    def restart(self, warmup_calls, calls):
        """:meth:`reset` after ``warmup_calls`` warm-up calls of a driver, and make now
        the CUDA events of the next ``calls`` calls, as many marks a call as the warm-up
        made (its average, rounded up; none without a warm-up, whose events are then made
        as the marks need them): a timed interval then holds no event's creation
        (``cudaEventCreate``, host time of its own inside an interval of an idle GPU).
        :func:`time_op` calls it after the warm-up."""
        per_call = -(-self._used // warmup_calls) if warmup_calls else 0
        self.reset()
        self.reserve(per_call * calls)

    def reserve(self, marks):
        """Make the CUDA events of the next ``marks`` marks now (a probe that is not reset
        between the warm-up and the timed calls: none is created inside an interval)."""
        if self.xp is not numpy:
            while len(self._events) < self._used + marks:
                self._events.append(self.xp.cuda.Event())

    def _mark(self):
        if self.xp is numpy:
            return time.perf_counter()
        if self._used == len(self._events):
            self._events.append(self.xp.cuda.Event())
        event = self._events[self._used]
        self._used += 1
        event.record()
        return event

    def start(self):
        """Open an interval here (with ``hold_ms``: after enqueueing the hold)."""
        if self._open is not None:
            raise RuntimeError("Probe.start() twice without stop()")
        host = time.perf_counter()
        if self.hold_ms is not None:
            _hold_stream(self.xp, self.hold_ms)
        self._open = (host, self._mark())

    def stop(self):
        """Close the open interval here."""
        if self._open is None:
            raise RuntimeError("Probe.stop() without start()")
        host, mark = self._open
        self._intervals.append((mark, self._mark()))
        self._host.append((host, time.perf_counter()))
        self._open = None

    def wrap(self, fn):
        """``fn`` with every call recorded as one interval (while :attr:`recording`)."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.recording:
                return fn(*args, **kwargs)
            self.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop()
        return timed

    @contextlib.contextmanager
    def patch(self, owner, name):
        """Within the block, ``owner.name`` is :meth:`wrap`-ped (restored after).

        Use it on the module attribute a driver looks up at call time (for
        instance ``cpsparse.mla.sparse_attn_indexer``); :meth:`summary` with
        ``expected=`` then proves that the driver really called it.
        """
        original = getattr(owner, name)
        setattr(owner, name, self.wrap(original))
        try:
            yield self
        finally:
            setattr(owner, name, original)

    def times_ms(self, floor_ms=0.0):
        """Milliseconds of every closed interval, in order, each less ``floor_ms``
        (:func:`held_floor_ms`; not below 0)."""
        if self.xp is numpy:
            times = [(b - a) * 1e3 for a, b in self._intervals]
        else:
            if self._intervals:
                self._intervals[-1][1].synchronize()
            times = [self.xp.cuda.get_elapsed_time(a, b) for a, b in self._intervals]
        return [max(t - floor_ms, 0.0) for t in times] if floor_ms else times

    def host_times_ms(self):
        """Host milliseconds (``perf_counter``) from each interval's :meth:`start` to its
        :meth:`stop`, hold launch included, in order."""
        return [(b - a) * 1e3 for a, b in self._host]

    def unheld(self, last=None):
        """How many intervals (of the ``last`` ones, when given) the host took more than
        half of ``hold_ms`` to enqueue: their figures may hold host time. 0 without a
        hold."""
        if self.hold_ms is None:
            return 0
        spans = self.host_times_ms()
        if last is not None:
            spans = spans[len(spans) - last:] if last else []
        return sum(t > 0.5 * self.hold_ms for t in spans)

    def summary(self, expected=None, floor_ms=0.0):
        """:func:`summarize` of :meth:`times_ms` (less ``floor_ms``); RuntimeError unless
        there are ``expected`` intervals (when given). With ``hold_ms`` it also says
        ``hold_ms``, ``floor_ms`` and :meth:`unheld`."""
        times = self.times_ms(floor_ms)
        if expected is not None and len(times) != expected:
            raise RuntimeError(f"Probe recorded {len(times)} intervals, expected {expected} "
                               "(one per timed call): the driver did not call what was "
                               "probed as expected")
        out = summarize(times)
        if self.hold_ms is not None:
            out.update(hold_ms=self.hold_ms, floor_ms=floor_ms, unheld=self.unheld())
        return out


def _hold_stream(xp, ms):
    """Keep ``xp``'s current stream busy for ``ms`` of GPU time (Probe's hold)."""
    from cpsparse.raw_kernels import quant
    quant.hold_stream(xp, ms)


def hold_for(host_ms, least_ms=1.0):
    """A :class:`Probe` ``hold_ms`` for intervals the host enqueues in ``host_ms``
    (their :meth:`Probe.host_times_ms`, or their largest): four times the largest, and
    at least ``least_ms``, so that :meth:`Probe.unheld` stays 0 through the host's
    slower calls.

    Examples
    --------
    >>> from cpsparse.timing import hold_for
    >>> hold_for([0.05, 0.2, 0.1]), hold_for(3.0)
    (1.0, 12.0)
    """
    largest = max(host_ms) if isinstance(host_ms, (list, tuple)) else host_ms
    return max(4.0 * float(largest), least_ms)


def held_floor_ms(xp, hold_ms=1.0, *, warmup=3, iters=30):
    """Median milliseconds two CUDA events read with nothing between them, recorded
    behind a hold (:class:`Probe` ``hold_ms``): what every held interval holds besides
    its GPU work, and what ``Probe.times_ms(floor_ms=)`` subtracts. 0.0 on NumPy.
    """
    if xp is numpy:
        return 0.0
    probe = Probe(xp, hold_ms=hold_ms)

    def empty():
        probe.start()
        probe.stop()

    return time_cuda(empty, warmup=warmup, iters=iters, probe=probe)["inner"]["median_ms"]


# ---- ceilings -----------------------------------------------------------------------

def copy_bandwidth_tbs(nbytes=2 << 30):
    """Device-to-device copy rate (CuPy), TB/s counting bytes read + bytes written.

    Examples
    --------
    >>> from cpsparse.timing import measure_ceilings
    >>> import numpy as np
    >>> measure_ceilings(np)
    {}

    On a GPU:

    >>> copy_bandwidth_tbs()                                   # doctest: +SKIP
    4.2
    """
    cp = cupy()
    a = cp.random.random(nbytes // 4, dtype=cp.float32)
    b = cp.empty_like(a)
    t = time_cuda(lambda: b.__setitem__(slice(None), a), warmup=2, iters=10)
    del a, b
    return 2 * nbytes / (t["median_ms"] * 1e-3) / 1e12


def bf16_gemm_tflops(n=8192):
    """bf16 ``n x n`` GEMM rate of torch (TFLOP/s), or None without torch.

    Examples
    --------
    >>> from cpsparse.timing import bf16_gemm_tflops, torch_or_none
    >>> torch_or_none() is not None or bf16_gemm_tflops() is None
    True
    """
    torch = torch_or_none()
    if torch is None:
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_torch(lambda: a @ b, warmup=3, iters=10)
    return 2 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12


def fp8_gemm_tflops(n=8192):
    """``torch._scaled_mm`` e4m3 -> bf16 rate (TFLOP/s), or None without it.

    Examples
    --------
    >>> from cpsparse.timing import fp8_gemm_tflops, torch_or_none
    >>> torch_or_none() is not None or fp8_gemm_tflops() is None
    True
    """
    torch = torch_or_none()
    if torch is None or not hasattr(torch, "_scaled_mm"):
        return None
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    t = time_torch(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                            out_dtype=torch.bfloat16), warmup=3, iters=10)
    return 2 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12


def measure_ceilings(xp=None):
    """The ceilings of this device: ``copy_tbs``, ``bf16_tflops``, ``fp8_tflops``.

    Keys whose peer is missing (torch) are left out; NumPy has none (``{}``).

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.timing import measure_ceilings
    >>> measure_ceilings(np)
    {}
    """
    if xp is numpy:
        return {}
    out = {"copy_tbs": copy_bandwidth_tbs()}
    for key, fn in (("bf16_tflops", bf16_gemm_tflops), ("fp8_tflops", fp8_gemm_tflops)):
        try:
            value = fn()
        except Exception:  # noqa: BLE001 - torch is an optional peer
            value = None
        if value is not None:
            out[key] = value
    return out
