"""GPU timing of prepared candidates: what a sample is, and how candidates share the GPU fairly.

One kernel sample = one `Prepared.run()` inside a captured CUDA graph, between two CUDA events
recorded in the same graph, after the L2 cache was flushed by writing a buffer twice its size
(outside the events); one replay of that graph holds RUNS_PER_GRAPH such (flush, event, run,
event) groups, so the graph's own launch latency stays outside every sample. Where events cannot
be recorded inside a graph, events around each replay of a one-run graph are used instead
(~3 us of launch latency more per sample on an H200), then eager launches.
A decode step runs after other layers have streamed GBs of weights through the cache, so a cold
L2 is the realistic state; the KV pool itself is larger than L2 (`default_pool_bytes()`, used as
`MeasureSettings.min_pool_bytes`) with each request's pages scattered through it.

Order per candidate: warm-up runs (JIT and first-launch costs stay out of every sample; the
compile time is `Prepared.compile_s`), then `plan()` timed on the host (a server plans every
decode step; samples in "plan_us"), then a final plan, then graph capture, then at least
MIN_WARM_S of GPU load so the clocks have ramped up (`warm_up`: once per interleaved batch).
Nothing replans after capture. The graph's first replay is checked against the last warm-up run's
output (its output buffer poisoned first) and, if it matches, gives the first samples (an untimed
run heads every replay: a replay's first run runs slow); if capture
fails or the replay differs, samples fall back to a one-run graph, then to events around eager
launches, and `TimedSamples.method` / `.note` say so (trial.py stores the note in the trial
message).

This module knows samples only: `mla_tune.measure.trial` turns them into trial results, and its
`measure_interleaved` shares the GPU between several candidates with the `KernelTimer`s made here.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch

from mla_tune.families.base import Prepared
from mla_tune.problem.defaults import KERNEL_METRIC, PLAN_METRIC

METHOD_GRAPH_EVENTS = "cuda_graph_events"   # events recorded inside the graph, around each run
METHOD_GRAPH = "cuda_graph"                 # events around each replay of a one-run graph
METHOD_EVENTS = "events"
METHOD_WALL = "wall_clock"
_FALLBACK_L2 = 64 << 20


class TimedSamples(dict):
    """metric -> list of microseconds ("kernel_us", "plan_us"), plus how they were taken."""

    def __init__(self, samples: dict, method: str, note: str = ""):
        super().__init__(samples)
        self.method = method
        self.note = note


def l2_bytes(device="cuda") -> int:
    """The device's L2 size (falls back to 64 MiB where torch does not report it)."""
    try:
        return int(getattr(torch.cuda.get_device_properties(torch.device(device)), "L2_cache_size", 0)
                   ) or _FALLBACK_L2
    except Exception:
        return _FALLBACK_L2


def default_pool_bytes(device="cuda") -> int:
    """KV pool size for timing: 4x L2 and at least 256 MiB, so the pool never fits in cache."""
    return max(4 * l2_bytes(device), 256 << 20)


_FLUSH: dict = {}


def flush_buffer(device: torch.device) -> torch.Tensor:
    """The buffer written between samples to evict L2 (twice its size, one per device)."""
    key = str(device)
    if key not in _FLUSH:
        _FLUSH[key] = torch.empty(max(2 * l2_bytes(device), 128 << 20), dtype=torch.uint8, device=device)
    return _FLUSH[key]


_CAPTURE_STREAMS: dict = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream graphs are captured on (one per device, as torch.cuda.graph keeps one)."""
    key = str(device)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[key]


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, device: torch.device):
    """`torch.cuda.graph(graph)` without its `torch.cuda.empty_cache()`: that hands every
    cached block back to the driver, so the next candidate's buffers are cudaMalloc'd again
    (profiled on the H200: 3.2 s in capture set-up and 3.3 s in torch.empty over 717 trials)."""
    torch.cuda.synchronize(device)
    with torch.cuda.stream(capture_stream(device)):
        graph.capture_begin()
        try:
            yield graph
        finally:
            graph.capture_end()


class KernelTimer:
    """One prepared candidate made ready for sampling: warmed, plan-timed, graph-captured.

    `sample(n)` returns n kernel times in microseconds and may be called repeatedly (that is
    how interleaving works); `plan_us` holds the host plan() times.
    """

    RUNS_PER_GRAPH = 10      # samples one replay of the timed graph yields
    # an untimed (flush, run) heads the timed graph: a replay's first run is slow (H200 default
    # sweep, 778 FlashInfer trials: run 0 of a replay +2.7-6.8% over the candidate's median, p90
    # +13-18%, the graph's first replay most; bench/results/replay_warmup_h200.txt: the leading
    # run takes it to within +-0.5%)
    LEAD_RUNS = 1
    MIN_WARM_S = 0.03        # GPU busy time before the first sample, so clocks have ramped up

    def __init__(self, prepared: Prepared, device="cuda", warmup: int = 3, plan_samples: int = 20,
                 use_graph: bool = True, flush: bool = True, graph_events: bool = True,
                 warm: bool = True):
        """`warm=False` leaves the clock warm-up to the caller (`warm_up` over a whole batch)."""
        self.prepared = prepared
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.flush = flush and self.cuda
        self.method = METHOD_GRAPH if self.cuda else METHOD_WALL
        self.note = ""
        self.graph = None
        self.timed_graph = None
        self._eager = None          # the eager output a graph's first replay is checked against
        self._unchecked = False     # the timed graph's first replay is still to be checked
        for _ in range(max(warmup, 1)):
            prepared.run()
        self._sync()
        if self.cuda and use_graph and prepared.graphable:
            # the last warm-up run's output is the eager output the graph must reproduce (the
            # re-plans below are of the same metadata, so the captured state must give it too)
            self._eager = prepared.out.clone() if isinstance(prepared.out, torch.Tensor) else None
        self.plan_us = self._time_plan(plan_samples)
        if self.cuda:
            if use_graph and prepared.graphable:
                # one capture per candidate: the timed graph, else a one-run graph
                if graph_events:
                    self._capture_timed()
                if self.timed_graph is None:
                    self._capture()
            else:
                self.method = METHOD_EVENTS
                self.note = "events around eager launches (candidate not graphable)"
            if warm:
                self._warm()

    def _warm(self) -> None:
        warm_up([self])

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _time_plan(self, n: int) -> list[float]:
        plan = self.prepared.plan
        if plan is None:
            return []
        # re-plans of the same metadata reach the state the plugin serves from its second step on
        # (for FlashInfer: the fast re-plan and its numpy schedule), whether or not timed
        plan()
        plan()
        self._sync()
        out = []
        for _ in range(max(n, 0)):
            t = time.perf_counter()
            plan()
            out.append((time.perf_counter() - t) * 1e6)
        plan()          # the state the graph captures is a fresh plan of the same metadata
        self._sync()
        return out

    def _side_stream_run(self) -> None:
        """One run on the capture stream before the first capture, as torch advises (lazy
        initialisations then happen outside the capture)."""
        side = capture_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.prepared.run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._sync()

    def _check_replay(self, graph, eager) -> None:
        """Replay `graph` into a poisoned output; raise where it differs from the eager output."""
        out = self.prepared.out
        if eager is None:
            return
        out.fill_(float("nan"))
        graph.replay()
        self._sync()
        if not torch.isfinite(out).all() or not torch.allclose(out.float(), eager.float(),
                                                               rtol=1e-2, atol=1e-2):
            raise RuntimeError("graph replay output differs from the eager output")

    def _capture(self) -> None:
        """A one-run graph, sampled with events around each replay."""
        try:
            self._side_stream_run()
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.device):
                self.prepared.run()
            self._check_replay(graph, self._eager)
            self.graph = graph
        except Exception as e:  # capture is an optimisation: fall back, and say so
            self.graph = None
            self.method = METHOD_EVENTS
            self.note = f"CUDA graph capture failed, events around eager launches: {type(e).__name__}: {e}"
            self._drain()

    def _drain(self) -> None:
        """Wait out what a refused capture left queued (a device that cannot even sync is
        reported by the next run, not here)."""
        try:
            torch.cuda.synchronize(self.device)
        except Exception:
            pass

    def _capture_timed(self) -> None:
        """A graph of LEAD_RUNS x (flush, run) and RUNS_PER_GRAPH x (flush, event, run, event):
        the launch latency of a replay falls outside the events, so a sample is the run alone. Its output is checked
        against the eager output on its first replay, which is also the first round of samples
        (`_first_replay`): checking it here would replay all its runs once more for nothing
        (the sum of one run of every candidate is ~2.2 s in the H200 default sweep). A refused
        capture falls back to a one-run graph here, a wrong first replay there."""
        try:
            self._side_stream_run()
            buf = flush_buffer(self.device) if self.flush else None
            events = [(torch.cuda.Event(enable_timing=True, external=True),
                       torch.cuda.Event(enable_timing=True, external=True))
                      for _ in range(self.RUNS_PER_GRAPH)]
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.device):
                for _ in range(self.LEAD_RUNS):     # untimed: a replay's first run is slow
                    if buf is not None:
                        buf.zero_()
                    self.prepared.run()
                for start, end in events:
                    if buf is not None:
                        buf.zero_()
                    start.record()
                    self.prepared.run()
                    end.record()
            self.timed_graph, self._timed_events = graph, events
            self._unchecked = True
            self.method = METHOD_GRAPH_EVENTS
        except Exception as e:  # noqa: BLE001 - a one-run graph with events around replays instead
            self._timed_refused(e)

    def _timed_refused(self, e: BaseException) -> None:
        self.timed_graph = None
        self._unchecked = False
        self.note = f"in-graph events unavailable ({type(e).__name__}: {e}); events around replays"
        self._drain()

    def _first_replay(self) -> list[float] | None:
        """The timed graph's first replay, into a poisoned output: checked against the eager
        output, its events must be finite and positive; then its times are samples. Where it
        fails, the timed graph is dropped for a one-run graph (or eager events) and None is
        returned."""
        self._unchecked = False
        try:
            self._check_replay(self.timed_graph, self._eager)
            times = [s.elapsed_time(e) for s, e in self._timed_events]
            if not all(math.isfinite(x) and x > 0 for x in times):
                raise RuntimeError(f"in-graph events gave {times}")
            return [x * 1e3 for x in times]
        except Exception as e:  # noqa: BLE001
            self._timed_refused(e)
            self.method = METHOD_GRAPH
            self._capture()
            return None

    def launch(self):
        """One timed unit: a replay of the timed graph (its events are read only by sample())
        or of the one-run graph, or an eager run where no graph was captured."""
        if self._unchecked:
            self._first_replay()
        if self.timed_graph is not None:
            self.timed_graph.replay()
        elif self.graph is not None:
            self.graph.replay()
        else:
            self.prepared.run()

    def _sample_in_graph(self, n: int, out: list[float]) -> list[float]:
        while len(out) < n:
            self.timed_graph.replay()
            self._sync()
            out.extend(s.elapsed_time(e) * 1e3 for s, e in self._timed_events)
        return out[:n]

    def sample(self, n: int) -> list[float]:
        if n <= 0:
            return []
        if not self.cuda:
            out = []
            for _ in range(n):
                t = time.perf_counter()
                self.prepared.run()
                out.append((time.perf_counter() - t) * 1e6)
            return out
        if self._unchecked:
            first = self._first_replay()
            if first is not None:
                return self._sample_in_graph(n, first)
        if self.timed_graph is not None:
            return self._sample_in_graph(n, [])
        buf = flush_buffer(self.device) if self.flush else None
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        for start, end in events:
            if buf is not None:
                buf.zero_()
            start.record()
            self.launch()
            end.record()
        self._sync()
        return [s.elapsed_time(e) * 1e3 for s, e in events]

    def close(self) -> None:
        self.graph = None
        self.timed_graph = None
        self._eager = None


def warm_up(timers, min_s: float | None = None, fill=None) -> int:
    """Keep the GPU busy for `min_s` (default KernelTimer.MIN_WARM_S) so its clocks have ramped
    up before the first sample: once per interleaved batch, not per candidate. The load is a
    memory-bound fill of the L2 flush buffer, not the candidates' own graphs: every candidate
    ran (JIT, first launch, its replay check) moments ago while it was captured, so only the
    clocks need the busy time, while one pass over the batch's timed graphs is 10 runs of every
    candidate (at H128 B128 L32K, 1.9 ms a run on the H200, 30 candidates make 0.6 s, 20x the
    30 ms asked for; the clock warm-up took 29 s of the 235 s default sweep that way). `fill` (tests) replaces the fill. Nothing to do off CUDA. Returns the
    fills launched."""
    timers = [t for t in timers if t is not None and t.cuda]
    if not timers:
        return 0
    min_s = KernelTimer.MIN_WARM_S if min_s is None else min_s
    if fill is None:
        buf = flush_buffer(timers[0].device)
        fill = buf.zero_
    # several fills between two synchronisations, so the GPU stays busy while the host waits
    # (about 40 us each for the H200's 128 MiB buffer)
    t0, n = time.perf_counter(), 0
    while True:
        for _ in range(WARM_FILLS):
            fill()
            n += 1
        timers[0]._sync()
        if time.perf_counter() - t0 >= min_s:
            return n


WARM_FILLS = 16      # fills queued between two synchronisations of the clock warm-up


def time_prepared(prepared: Prepared, settings) -> TimedSamples:
    """All samples of one candidate (used by measure.measure on CUDA): kernel_us and plan_us."""
    timer = KernelTimer(prepared, settings.device, settings.warmup, settings.plan_samples)
    try:
        kernel = timer.sample(settings.samples)
    finally:
        timer.close()
    samples = {KERNEL_METRIC: kernel}
    if timer.plan_us:
        samples[PLAN_METRIC] = timer.plan_us
    return TimedSamples(samples, timer.method, timer.note)
