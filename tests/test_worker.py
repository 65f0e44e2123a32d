"""Crash isolation: faults of test-only kernel families are recorded and survived."""

import time

import pytest

import sweep_families
from mla_tune.families.base import Candidate
from mla_tune.measure.trial import MeasureSettings
from mla_tune.problem.workload import Workload
from mla_tune.measure.worker import InlineRunner, WorkerRunner, make_runner
from mla_tune.measure.worker_main import is_sticky_cuda_error

W = Workload(16, 512, 64, 0.1, batch_size=1, context_len=64)
SETTINGS = MeasureSettings(samples=4, warmup=1)


@pytest.fixture(autouse=True)
def families():
    sweep_families.register()


def test_every_fault_is_recorded_and_the_worker_replaced():
    cands = [Candidate("faulty", b, 16) for b in sweep_families.FAULTY_BACKENDS] + \
        [Candidate("faulty", "torch", 64)]
    runner = WorkerRunner(SETTINGS, timeout_s=2.0)
    seen = []
    try:
        t0 = time.monotonic()
        res = runner.measure(W, cands, lambda c, ok: seen.append((c.key, ok)))
        took = time.monotonic() - t0
    finally:
        runner.close()
    by = {c.backend + str(c.page_size): r for c, r in zip(cands, res)}
    assert [r.candidate for r in res] == cands
    assert by["torch16"].status == "ok" and by["torch64"].status == "ok"   # measured after the faults
    assert by["torch64"].samples["kernel_us"] and len(by["torch64"].samples["kernel_us"]) == 4
    assert (by["abort16"].invalid_reason, by["segv16"].invalid_reason) == ("crash", "crash")
    assert "SIGABRT" in by["abort16"].message and "SIGSEGV" in by["segv16"].message
    assert "Fatal Python error" in by["segv16"].message      # the worker's faulthandler report
    assert by["hang16"].invalid_reason == "timeout" and "2 s" in by["hang16"].message
    # every start (the first and each replacement) is timed, for the sweep's budget to leave out
    assert runner.restarts >= 3 and 0 < runner.startup_s < took
    assert by["poison16"].invalid_reason == "crash" and "poisoned" in by["poison16"].message
    assert by["refuse16"].invalid_reason == "unsupported"    # an ordinary refusal is not a fault
    assert runner.faults == 4 and runner.restarts == 4
    assert ("faulty/segv/p16", False) in seen and took < 30


def test_fault_while_sampling_is_pinned_down_one_by_one():
    # a poisoned context found after every candidate was prepared has no known culprit
    from mla_tune.measure.worker import _Fault
    runner = WorkerRunner(SETTINGS, timeout_s=5.0)
    calls = []
    real = runner._attempt

    def attempt(workload, cands, on_progress):
        calls.append([c.key for c in cands])
        if len(cands) > 1:
            return _Fault("crash", None, "CUDA context poisoned: an illegal memory access")
        return real(workload, cands, on_progress)

    runner._attempt = attempt
    cands = [Candidate("faulty", "torch", p) for p in (16, 64)]
    try:
        res = runner.measure(W, cands)
    finally:
        runner.close()
    assert calls == [[c.key for c in cands], [cands[0].key], [cands[1].key]]
    assert all(r.status == "ok" for r in res)


def test_inline_runner_and_choice_of_runner():
    r = InlineRunner(SETTINGS)
    (res,) = r.measure(W, [Candidate("reference", "torch", 16)])
    assert res.status == "ok" and len(res.samples["kernel_us"]) == 4
    assert isinstance(make_runner(SETTINGS, "inline"), InlineRunner)
    assert isinstance(make_runner(SETTINGS, "auto", families=["reference"]), InlineRunner)
    assert isinstance(make_runner(SETTINGS, "auto", families=["reference", "faulty"]), WorkerRunner)
    assert isinstance(make_runner(SETTINGS, "auto", families=["flashinfer"]), WorkerRunner)
    with pytest.raises(ValueError):
        make_runner(SETTINGS, "threads")


def test_sticky_cuda_errors():
    assert is_sticky_cuda_error("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert is_sticky_cuda_error("Triton Error [CUDA]: unspecified launch failure")
    assert not is_sticky_cuda_error("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not is_sticky_cuda_error("")


@pytest.mark.gpu
def test_illegal_memory_access_poisons_only_its_own_trial():
    settings = MeasureSettings(device="cuda", samples=6, warmup=1)
    cands = [Candidate("gpufault", b, p) for b, p in (("torch", 16), ("oob", 16), ("torch", 64))]
    runner = WorkerRunner(settings, timeout_s=120.0)
    try:
        res = runner.measure(W, cands)
    finally:
        runner.close()
    assert [r.status for r in res] == ["ok", "invalid", "ok"]
    assert res[1].invalid_reason == "crash" and "poisoned" in res[1].message
    assert runner.restarts >= 1
