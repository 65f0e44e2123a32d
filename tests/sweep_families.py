"""Test-only kernel families for the sweep and worker tests; never registered outside tests.

* "faulty": the torch reference under backend names that misbehave on purpose: "abort"
  (os.abort, SIGABRT), "segv" (a real segmentation fault), "hang" (sleeps for an hour), "poison"
  (raises the error an illegal memory access gives, and from then on every preparation in that
  process fails the same way, as a poisoned CUDA context does), "refuse" (unsupported, cleanly).
  "torch" behaves. The default is "torch".
* "sleepy": the torch reference with a pause in every preparation, so a test can kill a sweep
  while it runs.
* "slowstart": the torch reference whose first run in a sweep pauses (a worker's one-time
  start-up costs: first CUDA use, first capture), the later ones do not (`each`: every
  candidate's first run pauses).
* "gpufault" (GPU only): "oob" makes a real illegal memory access from a Triton kernel.

`register()` adds both to mla_tune.families' registry in this process; a worker process gets
them through WorkerRunner's copy of the registry (this module must be importable there, which
it is: tests/ is on sys.path under pytest, and a subprocess puts it there itself).
"""

from __future__ import annotations

import ctypes
import os
import time

from mla_tune.families import register_family
from mla_tune.families.base import Candidate, CandidateInvalid
from mla_tune.families.reference import ReferenceFamily

FAULTY_BACKENDS = ("torch", "abort", "segv", "hang", "poison", "refuse")
_poisoned = False


class FaultyBackend(ReferenceFamily):
    family = "faulty"
    backends = FAULTY_BACKENDS

    def space(self, workload, page_sizes):
        return [Candidate(self.family, b, p) for b in self.backends for p in page_sizes]

    def default_candidate(self, workload, page_size):
        return Candidate(self.family, "torch", page_size)

    def prepare(self, workload, candidate, problem):
        global _poisoned
        if _poisoned:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        b = candidate.backend
        if b == "abort":
            os.abort()
        if b == "segv":
            ctypes.string_at(0)
        if b == "hang":
            time.sleep(3600)
        if b == "poison":
            _poisoned = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if b == "refuse":
            raise CandidateInvalid("unsupported", "this kernel refuses the device")
        return super().prepare(workload, candidate, problem)


class RefusingBackend(FaultyBackend):
    """The torch reference and one backend that refuses cleanly, every time it is asked."""

    family = "refusing"
    backends = ("torch", "refuse")
    prepared: list = []          # (backend, batch) of every preparation in this process

    def prepare(self, workload, candidate, problem):
        RefusingBackend.prepared.append((candidate.backend, workload.batch_size))
        return super().prepare(workload, candidate, problem)


class SleepyBackend(ReferenceFamily):
    family = "sleepy"
    pause_s = float(os.environ.get("MLA_TUNE_TEST_PAUSE", "0.15"))

    def space(self, workload, page_sizes):
        return [Candidate(self.family, "torch", p) for p in page_sizes]

    def default_candidate(self, workload, page_size):
        return Candidate(self.family, "torch", page_size)

    def prepare(self, workload, candidate, problem):
        time.sleep(self.pause_s)
        return super().prepare(workload, candidate, problem)


class SlowStartBackend(ReferenceFamily):
    family = "slowstart"
    first_pause_s = 2.0
    each = False        # True: every candidate's first run pauses (its own cost, not start-up)
    pause = staticmethod(time.sleep)   # a test's virtual clock replaces it (tests/test_sweep.py)

    def __init__(self):
        super().__init__()
        self.started = False

    def space(self, workload, page_sizes):
        return [Candidate(self.family, "torch", p) for p in page_sizes]

    def default_candidate(self, workload, page_size):
        return Candidate(self.family, "torch", page_size)

    def prepare(self, workload, candidate, problem):
        prepared = super().prepare(workload, candidate, problem)
        run = prepared.run
        if self.each:
            self.started = False

        def first_slow():
            if not self.started:      # after preparation, as a first capture or clock ramp is
                self.started = True
                self.pause(self.first_pause_s)
            return run()
        prepared.run = first_slow
        return prepared


class GpuFaultBackend(ReferenceFamily):
    """On a GPU: "oob" launches a Triton kernel that stores far out of bounds, a real illegal
    memory access that poisons the CUDA context (reported at the next synchronisation)."""

    family = "gpufault"

    def space(self, workload, page_sizes):
        return [Candidate(self.family, b, p) for b in ("torch", "oob") for p in page_sizes]

    def default_candidate(self, workload, page_size):
        return Candidate(self.family, "torch", page_size)

    def prepare(self, workload, candidate, problem):
        if candidate.backend == "oob":
            _store_out_of_bounds(problem.q_nope)
        return super().prepare(workload, candidate, problem)


def _store_out_of_bounds(t):
    import triton
    import triton.language as tl

    @triton.jit
    def oob(x_ptr):
        tl.store(x_ptr + (1 << 40) + tl.program_id(0), 1.0)

    oob[(1,)](t)


def register() -> None:
    register_family("faulty", f"{__name__}:FaultyBackend")
    register_family("sleepy", f"{__name__}:SleepyBackend")
    register_family("slowstart", f"{__name__}:SlowStartBackend")
    register_family("refusing", f"{__name__}:RefusingBackend")
    register_family("gpufault", f"{__name__}:GpuFaultBackend")
