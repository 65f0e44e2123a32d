"""Prefill candidates on one prefill workload -> trial results: correctness gate, then interleaved
timing, as `mla_tune.measure.trial.measure_interleaved` does for decode.

The gate runs each candidate on fresh random inputs with a poisoned output and compares sampled
query rows (each request's first and last, then spread) with the float32 torch reference,
output and (for a context chunk) the natural-log LSE; a wrong or unwritten result makes the trial
invalid("wrong_result"). Timing is `KernelTimer`'s (CUDA graphs, events inside the graph, a cold
L2 on the GPU; wall clock on the CPU), candidates round-robin with the order rotated per round.
Every failure is data: an invalid TrialResult with its reason.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from mla_tune.families.base import Candidate, CandidateInvalid
from mla_tune.measure.sampling import sample_in_rounds
from mla_tune.measure.timing import KernelTimer, TimedSamples
from mla_tune.measure.trial import TOLERANCE, MeasureSettings, TrialResult, invalid_result
from mla_tune.problem.defaults import KERNEL_METRIC, PLAN_METRIC
from mla_tune.problem.prefill import (PrefillWorkload, check_rows, make_prefill_problem,
                                      prefill_reference, relative_error)
from vllm_metax.ops.flashinfer_prefill import LSE_FLASHINFER, LSE_VLLM

LN2 = math.log(2.0)
LSE_TOL = 2e-2            # natural-log LSE, absolute (bf16 operands)


def check_prefill(backend, w: PrefillWorkload, candidate: Candidate, settings: MeasureSettings,
                  seed: int) -> float:
    """Relative error of the candidate against the reference on fresh inputs; raises
    CandidateInvalid("wrong_result")."""
    problem = make_prefill_problem(w, settings.device, seed=seed)
    prepared = backend.prepare(w, candidate, problem)
    prepared.out.fill_(float("nan"))           # poison: every element must be written
    got = prepared.run()
    if str(settings.device).startswith("cuda"):
        torch.cuda.synchronize()
    out, lse = got if isinstance(got, tuple) else (got, None)
    if not bool(out.isfinite().all()):
        raise CandidateInvalid("wrong_result", "output not fully written (NaN or inf left)")
    rows = check_rows(w, seed=seed)
    ref_o, ref_l = prefill_reference(problem, rows)
    err = relative_error(out[rows], ref_o)
    tol = TOLERANCE[w.q_dtype]
    if not err <= tol:
        raise CandidateInvalid("wrong_result", f"relative error {err:.3g} > {tol:g} against the "
                               "torch reference")
    if lse is not None:
        if getattr(getattr(prepared, "kernel", None), "LSE_FORM", LSE_FLASHINFER) == LSE_VLLM:
            got_l = lse[:, rows].float().transpose(0, 1)       # vLLM's FA3: [heads, tokens], ln
        else:
            got_l = lse[rows].float() * LN2                    # FlashInfer's: [tokens, heads], base 2
        lerr = float((got_l - ref_l).abs().max())
        if not lerr <= LSE_TOL:
            raise CandidateInvalid("wrong_result", f"LSE off by {lerr:.3g} > {LSE_TOL:g} (natural "
                                   "log) against the torch reference")
    return err


def measure_prefill(entries: Sequence[tuple[object, Candidate]], w: PrefillWorkload,
                    settings: MeasureSettings, rounds: int = 5,
                    on_prepared: Callable | None = None) -> list[TrialResult]:
    """One TrialResult per (backend, candidate) entry, in order: each prepared on one shared
    problem, gated, captured; then `rounds` rounds of ceil(samples / rounds) samples each."""
    problem = None
    timers: dict[int, KernelTimer] = {}
    results: dict[int, TrialResult] = {}
    meta: dict[int, tuple] = {}
    for i, (backend, c) in enumerate(entries):
        try:
            t0 = time.perf_counter()
            if problem is None:
                problem = make_prefill_problem(w, settings.device, seed=settings.seed)
            prepared = backend.prepare(w, c, problem)
            compile_s = prepared.compile_s or (time.perf_counter() - t0)
            err = check_prefill(backend, w, c, settings, settings.seed + 1000) if settings.check else None
            timers[i] = KernelTimer(prepared, settings.device, settings.warmup, settings.plan_samples)
            meta[i] = (compile_s, err)
        except Exception as exc:  # noqa: BLE001 - every failure is data
            results[i] = invalid_result(c, exc)
        if on_prepared is not None:
            on_prepared(c, i not in results)
    samples, errors = sample_in_rounds(timers, settings.samples, rounds)
    results.update({i: invalid_result(entries[i][1], exc) for i, exc in errors.items()})
    out = []
    for i, (_, c) in enumerate(entries):
        if i not in results:
            t = timers[i]
            s = {KERNEL_METRIC: samples[i]}
            if t.plan_us:
                s[PLAN_METRIC] = t.plan_us
            results[i] = TrialResult(c, "ok", TimedSamples(s, t.method, t.note), message=t.note,
                                     compile_s=meta[i][0], max_rel_error=meta[i][1])
        if i in timers:
            timers[i].close()
        out.append(results[i])
    return out


__all__ = ["check_prefill", "measure_prefill"]
