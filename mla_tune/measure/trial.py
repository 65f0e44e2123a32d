"""One candidate on one workload -> a trial result: correctness gate first, then timing.

The correctness gate runs the candidate on fresh random data with a poisoned output buffer and
compares with the torch reference; a wrong or NaN result makes the trial invalid, so it can never
win. Timing on CUDA is in `mla_tune.measure.timing`, which knows samples only: results are made here (graphs, events, rotated data); on the CPU it is a
wall-clock loop, labelled as such in the run record.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from mla_tune.families.base import Candidate, CandidateInvalid
from mla_tune.measure.sampling import REL_WIDTH, enough_samples, sample_in_rounds
from mla_tune.measure.timing import KernelTimer, TimedSamples, time_prepared, warm_up
from mla_tune.problem.defaults import KERNEL_METRIC, PLAN_METRIC
from mla_tune.problem.workload import Workload
from mla_tune.problem.instance import make_problem
from mla_tune.problem.reference import mla_decode_reference, relative_error

# bf16 operands with fp32 accumulation land between 1e-3 and 1e-2 relative error
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3}


@dataclass
class MeasureSettings:
    """How candidates are measured. `samples` is the most kernel samples a candidate gets;
    `min_samples` (None: all of them) lets one stop earlier once its median is known to
    `mla_tune.measure.sampling`'s precision; `rounds` is how many interleaved rounds a batch's
    samples are split over."""

    device: str = "cpu"
    warmup: int = 2
    samples: int = 10
    plan_samples: int = 20
    min_pool_bytes: int = 0          # > L2 on the GPU (see timing.default_pool_bytes)
    check: bool = True
    seed: int = 0
    min_samples: int | None = None
    rounds: int = 5
    profile: str | None = None       # the target profile families measure under (None: active)


@dataclass
class TrialResult:
    candidate: Candidate
    status: str                      # ok | invalid
    samples: dict = field(default_factory=dict)   # metric -> list of microseconds
    invalid_reason: str | None = None
    message: str = ""
    compile_s: float | None = None
    max_rel_error: float | None = None
    # where its measuring time went (PHASES -> seconds; a batch's warm-up and sampling rounds are
    # shared evenly by the candidates sampled in them); for the sweep's `time:` split, not stored
    phase_s: dict = field(default_factory=dict)


# prepare (instance, plan, first-use JIT), check (the correctness run and, once per page size, the
# reference), timer (warm-up runs, plan timing, graph capture), warm (the batch's clock warm-up),
# sample (the interleaved sampling rounds, the timed samples' own GPU time included)
PHASES = ("prepare_s", "check_s", "timer_s", "warm_s", "sample_s")


def reference_output(problem, workload: Workload):
    """The torch reference's output for a problem instance (the correctness oracle)."""
    return mla_decode_reference(problem.q_nope, problem.q_pe, problem.ckv_cache, problem.kpe_cache,
                                problem.block_table, problem.seq_lens_cpu, workload.softmax_scale,
                                workload.q_len)


def check_output(prepared, ref, workload: Workload, settings: MeasureSettings) -> float:
    """Relative error of a prepared candidate's output against the reference output `ref` of
    the problem it was prepared on: its output buffer is poisoned first (every element must be
    written), then it runs once. Raises CandidateInvalid."""
    if prepared.out is not None:
        prepared.out.fill_(float("nan"))      # poison: every element must be written
    out = prepared.run()
    if settings.device != "cpu":
        torch.cuda.synchronize()
    err = relative_error(out, ref)
    tol = TOLERANCE[workload.q_dtype]
    if not err <= tol:
        raise CandidateInvalid("wrong_result", f"relative error {err:.3g} > {tol:g} against the torch reference")
    return err


def check_correctness(backend, workload: Workload, candidate: Candidate, settings: MeasureSettings,
                      seed: int) -> float:
    """Relative error of the candidate against the reference on a fresh problem made with
    `seed`; raises CandidateInvalid."""
    problem = make_problem(workload, candidate.page_size, settings.device, seed=seed)
    prepared = backend.prepare(workload, candidate, problem)
    return check_output(prepared, reference_output(problem, workload), workload, settings)


class ProblemCache:
    """The problem instances of the workload being measured: per page size the timing instance
    and its reference output, made once and shared by every candidate of that page size, across
    batches while the same workload comes back. Each candidate is checked on the instance it is
    then timed on (prepared once, not twice); the data is fresh to it, and its output buffer and
    workspace are its own. Only the page sizes of the latest batch are kept (grid batches go page
    size by page size), so the memory held is what one batch needs."""

    def __init__(self):
        self.workload = None
        self._timing: dict = {}
        self._reference: dict = {}
        self.made = 0                 # instances made (tests)
        self.references = 0           # reference outputs computed (tests)

    def keep_only(self, workload: Workload, page_sizes) -> None:
        if workload != self.workload:
            self.clear()
            self.workload = workload
        pages = set(page_sizes)
        for d in (self._timing, self._reference):
            for p in [p for p in d if p not in pages]:
                del d[p]

    def timing(self, workload: Workload, page_size: int, settings: MeasureSettings):
        if page_size not in self._timing:
            self._timing[page_size] = make_problem(workload, page_size, settings.device,
                                                   seed=settings.seed,
                                                   min_pool_bytes=settings.min_pool_bytes)
            self.made += 1
        return self._timing[page_size]

    def reference(self, workload: Workload, page_size: int, settings: MeasureSettings):
        """The reference output of the timing instance of `page_size`."""
        if page_size not in self._reference:
            self._reference[page_size] = reference_output(
                self.timing(workload, page_size, settings), workload)
            self.references += 1
        return self._reference[page_size]

    def clear(self) -> None:
        self.workload = None
        self._timing.clear()
        self._reference.clear()


PROBLEMS = ProblemCache()      # this process's; the worker measures one workload at a time


def measure(backend, workload: Workload, candidate: Candidate, settings: MeasureSettings) -> TrialResult:
    """Measure one candidate; every failure becomes an invalid TrialResult with its reason."""
    try:
        err = None
        t0 = time.perf_counter()
        problem = make_problem(workload, candidate.page_size, settings.device, seed=settings.seed,
                               min_pool_bytes=settings.min_pool_bytes)
        prepared = backend.prepare(workload, candidate, problem)
        compile_s = prepared.compile_s or (time.perf_counter() - t0)
        if settings.check:
            err = check_correctness(backend, workload, candidate, settings, seed=settings.seed + 1000)
        if settings.device == "cpu":
            samples = {KERNEL_METRIC: _cpu_samples(prepared.run, settings.warmup, settings.samples)}
            if prepared.plan is not None:
                samples[PLAN_METRIC] = _cpu_samples(prepared.plan, 1, settings.plan_samples)
        else:
            samples = time_prepared(prepared, settings)
        return TrialResult(candidate, "ok", samples, message=getattr(samples, "note", ""),
                           compile_s=compile_s, max_rel_error=err)
    except Exception as e:  # noqa: BLE001 - a kernel family's own error: data, not a crash of the sweep
        return invalid_result(candidate, e)


def _cpu_samples(fn, warmup: int, n: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


# ---------------------------------------------------------------- several candidates, interleaved

@dataclass
class _Entry:
    backend: object
    candidate: Candidate
    timer: KernelTimer | None = None
    compile_s: float | None = None
    max_rel_error: float | None = None
    kernel_us: list = field(default_factory=list)
    result: object = None      # a finished (invalid) TrialResult
    phase_s: dict = field(default_factory=dict)


def measure_interleaved(entries: Sequence[tuple[object, Candidate]], workload: Workload, settings,
                        rounds: int | None = None, on_prepared: Callable | None = None,
                        problems: ProblemCache | None = None) -> list:
    """Measure several candidates of one workload round-robin; one TrialResult per entry, in order.

    `entries` are (backend, candidate) pairs (families may differ); `settings` a
    measure.MeasureSettings (`samples` is the most per candidate, split over `rounds`, default
    settings.rounds). Each candidate is first prepared on a problem shared by all candidates of
    its page size, correctness-checked there (a run into a poisoned output buffer, against
    the reference output computed once per page size: check_output; `problems`: default this
    process's PROBLEMS) and captured; failures become invalid TrialResults with their reason, exactly as measure.measure
    makes them. The GPU is warmed once for the batch (timing.warm_up), then each round takes
    ceil(samples / rounds) samples from every live candidate, the order rotated by one per round;
    a candidate whose median is already known well enough (sampling.enough_samples, from
    settings.min_samples on) leaves the rounds early. `on_prepared(candidate, ok)` is called
    after each preparation (progress).
    """
    rounds = settings.rounds if rounds is None else rounds
    cache = PROBLEMS if problems is None else problems
    todo: list[_Entry] = [_Entry(b, c) for b, c in entries]
    cache.keep_only(workload, {e.candidate.page_size for e in todo})
    for e in todo:
        _prepare(e, workload, settings, cache)
        if on_prepared is not None:
            on_prepared(e.candidate, e.result is None)
    live = [e for e in todo if e.timer is not None]
    t = time.perf_counter()
    try:
        warm_up([e.timer for e in live])     # clocks up once for the batch, not per candidate
    except Exception as exc:  # noqa: BLE001 - a launch that fails here fails its sampling too
        for e in live:
            e.result = invalid_result(e.candidate, exc)
        live = []
    _share(live, "warm_s", time.perf_counter() - t)
    t = time.perf_counter()
    _sample_rounds(live, settings, rounds)
    _share(live, "sample_s", time.perf_counter() - t)
    return [_finished(e) for e in todo]


def _prepare(e: _Entry, workload: Workload, settings, cache: ProblemCache) -> None:
    """Prepare, check and capture one candidate (e.timer), or record why it failed (e.result)."""
    phase = "prepare_s"
    t = time.perf_counter()
    try:
        problem = cache.timing(workload, e.candidate.page_size, settings)
        prepared = e.backend.prepare(workload, e.candidate, problem)
        e.compile_s = prepared.compile_s or (time.perf_counter() - t)
        if settings.check:
            t = _phase_done(e, phase, t)
            phase = "check_s"
            e.max_rel_error = check_output(
                prepared, cache.reference(workload, e.candidate.page_size, settings),
                workload, settings)
        t = _phase_done(e, phase, t)
        phase = "timer_s"
        e.timer = KernelTimer(prepared, settings.device, settings.warmup, settings.plan_samples,
                              warm=False)
    except Exception as exc:  # noqa: BLE001 - every failure is data
        e.result = invalid_result(e.candidate, exc)
        e.timer = None
    _phase_done(e, phase, t)


def _sample_rounds(live: list[_Entry], settings, rounds: int) -> None:
    """`sample_in_rounds` over the live candidates, each leaving early once it knows its median
    well enough (from settings.min_samples on); a failed sampling is the candidate's result."""
    least = settings.samples if settings.min_samples is None else settings.min_samples
    got, errors = sample_in_rounds({i: e.timer for i, e in enumerate(live)}, settings.samples, rounds,
                                   lambda xs: enough_samples(xs, least, REL_WIDTH))
    for i, e in enumerate(live):
        e.kernel_us.extend(got[i])
        if i in errors:
            e.result = invalid_result(e.candidate, errors[i])


def _finished(e: _Entry) -> TrialResult:
    """The entry's TrialResult (its samples, or the failure recorded), its timer closed."""
    if e.result is None:
        samples = {KERNEL_METRIC: e.kernel_us}
        if e.timer.plan_us:
            samples[PLAN_METRIC] = e.timer.plan_us
        e.result = TrialResult(e.candidate, "ok", TimedSamples(samples, e.timer.method, e.timer.note),
                               message=e.timer.note, compile_s=e.compile_s,
                               max_rel_error=e.max_rel_error)
    e.result.phase_s = e.phase_s
    if e.timer is not None:
        e.timer.close()
    return e.result


def _phase_done(e: _Entry, phase: str, since: float) -> float:
    now = time.perf_counter()
    e.phase_s[phase] = e.phase_s.get(phase, 0.0) + now - since
    return now


def _share(entries: list, phase: str, seconds: float) -> None:
    for e in entries:
        e.phase_s[phase] = e.phase_s.get(phase, 0.0) + seconds / len(entries)


def invalid_result(candidate: Candidate, exc: BaseException) -> TrialResult:
    """The invalid TrialResult an exception stands for (CandidateInvalid keeps its reason)."""
    result_cls = TrialResult
    if isinstance(exc, CandidateInvalid):
        return result_cls(candidate, "invalid", invalid_reason=exc.reason, message=exc.message)
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return result_cls(candidate, "invalid", invalid_reason="runtime", message=f"out of memory: {exc}")
    tb = traceback.format_exc(limit=3)
    return result_cls(candidate, "invalid", invalid_reason="runtime",
                      message=f"{type(exc).__name__}: {exc}\n{tb}")
