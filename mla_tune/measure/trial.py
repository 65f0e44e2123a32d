"""One candidate on one workload -> a trial result: correctness gate first, then timing.

The correctness gate runs the candidate on fresh random data with a poisoned output buffer and
compares with the torch reference; a wrong or NaN result makes the trial invalid, so it can never
win. Timing on CUDA is in `mla_tune.measure.timing` (graphs, events, rotated data); on the CPU it is a
wall-clock loop, labelled as such in the run record.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import torch

from mla_tune.families.base import Candidate, CandidateInvalid
from mla_tune.problem.workload import Workload
from mla_tune.problem.instance import make_problem
from mla_tune.problem.reference import mla_decode_reference, relative_error

# bf16 operands with fp32 accumulation land between 1e-3 and 1e-2 relative error
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3}


@dataclass
class MeasureSettings:
    device: str = "cpu"
    warmup: int = 2
    samples: int = 10
    plan_samples: int = 20
    min_pool_bytes: int = 0          # > L2 on the GPU (see timing.default_pool_bytes)
    check: bool = True
    seed: int = 0


@dataclass
class TrialResult:
    candidate: Candidate
    status: str                      # ok | invalid
    samples: dict = field(default_factory=dict)   # metric -> list of microseconds
    invalid_reason: str | None = None
    message: str = ""
    compile_s: float | None = None
    max_rel_error: float | None = None


def check_correctness(backend, workload: Workload, candidate: Candidate, settings: MeasureSettings,
                      seed: int) -> float:
    """Relative error of the candidate against the reference on fresh data; raises CandidateInvalid."""
    problem = make_problem(workload, candidate.page_size, settings.device, seed=seed)
    prepared = backend.prepare(workload, candidate, problem)
    if prepared.out is not None:
        prepared.out.fill_(float("nan"))      # poison: every element must be written
    out = prepared.run()
    if settings.device != "cpu":
        torch.cuda.synchronize()
    ref = mla_decode_reference(problem.q_nope, problem.q_pe, problem.ckv_cache, problem.kpe_cache,
                               problem.block_table, problem.seq_lens_cpu, workload.softmax_scale,
                               workload.q_len)
    err = relative_error(out, ref)
    tol = TOLERANCE[workload.q_dtype]
    if not err <= tol:
        raise CandidateInvalid("wrong_result", f"relative error {err:.3g} > {tol:g} against the torch reference")
    return err


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
            samples = {"kernel_us": _cpu_samples(prepared.run, settings.warmup, settings.samples)}
            if prepared.plan is not None:
                samples["plan_us"] = _cpu_samples(prepared.plan, 1, settings.plan_samples)
        else:
            from mla_tune.measure.timing import time_prepared
            samples = time_prepared(prepared, settings)
        return TrialResult(candidate, "ok", samples, message=getattr(samples, "note", ""),
                           compile_s=compile_s, max_rel_error=err)
    except CandidateInvalid as e:
        return TrialResult(candidate, "invalid", invalid_reason=e.reason, message=e.message)
    except torch.cuda.OutOfMemoryError as e:
        return TrialResult(candidate, "invalid", invalid_reason="runtime", message=f"out of memory: {e}")
    except Exception as e:  # a kernel family's own error: data, not a crash of the sweep
        tb = traceback.format_exc(limit=3)
        return TrialResult(candidate, "invalid", invalid_reason="runtime",
                           message=f"{type(e).__name__}: {e}\n{tb}")


def _cpu_samples(fn, warmup: int, n: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out
