"""Timing harness logic on the CPU: sample counts, plan timing, interleaving order, failures as data."""

import pytest

from mla_tune.measure import timing, trial
from mla_tune.families import Candidate, CandidateInvalid, Prepared
from mla_tune.families.reference import ReferenceBackend
from mla_tune.measure.trial import MeasureSettings
from mla_tune.problem.workload import custom_model, workload_for
from mla_tune.store.results import stats_of


def _wl():
    return workload_for(custom_model(2, 32, 16), 1, 2, 8)


class Recording:
    """A family whose runs log their candidate, to see the order samples are taken in."""

    family = "rec"

    def __init__(self, log, fail=None):
        self.log, self.fail = log, fail or {}

    def available(self, device):
        return True

    def prepare(self, workload, candidate, problem):
        if candidate.backend in self.fail:
            raise self.fail[candidate.backend]
        plans = []
        return Prepared(run=lambda: self.log.append(candidate.backend),
                        plan=lambda: plans.append(1), out=None, graphable=False)


def test_kernel_timer_cpu_counts_and_method():
    runs, plans = [], []
    p = Prepared(run=lambda: runs.append(1), plan=lambda: plans.append(1), out=None)
    t = timing.KernelTimer(p, "cpu", warmup=2, plan_samples=7)
    assert t.method == timing.METHOD_WALL
    assert len(t.plan_us) == 7 and len(plans) == 7 + 3   # 2 warm-up plans, 7 timed, 1 final
    s = t.sample(5)
    assert len(s) == 5 and all(x >= 0 for x in s)
    assert len(runs) == 2 + 5
    assert t.sample(0) == []


def test_time_prepared_returns_timed_samples():
    p = Prepared(run=lambda: None, plan=None, out=None)
    out = timing.time_prepared(p, MeasureSettings(samples=4, warmup=1))
    assert isinstance(out, dict) and set(out) == {"kernel_us"} and len(out["kernel_us"]) == 4
    assert out.method == timing.METHOD_WALL


def test_interleaved_rotates_order_and_splits_samples():
    log = []
    fam = Recording(log)
    entries = [(fam, Candidate("rec", b, 1)) for b in "abc"]
    settings = MeasureSettings(samples=6, warmup=1, plan_samples=0, check=False)
    res = trial.measure_interleaved(entries, _wl(), settings, rounds=3)
    assert [r.candidate.backend for r in res] == ["a", "b", "c"]
    assert all(r.status == "ok" and len(r.samples["kernel_us"]) == 6 for r in res)
    sampling = log[3:]                    # after one warm-up run each
    blocks = ["".join(dict.fromkeys(sampling[i:i + 6])) for i in range(0, 18, 6)]
    assert blocks == ["abc", "bca", "cab"]


def test_interleaved_keeps_failures_as_data_and_goes_on():
    log = []
    fam = Recording(log, fail={"b": CandidateInvalid("unsupported", "b refuses this device"),
                               "c": RuntimeError("kernel blew up")})
    entries = [(fam, Candidate("rec", x, 1)) for x in "abc"]
    res = trial.measure_interleaved(entries, _wl(), MeasureSettings(samples=3, check=False), rounds=2)
    assert res[0].status == "ok" and len(res[0].samples["kernel_us"]) == 3
    assert (res[1].status, res[1].invalid_reason, res[1].message) == ("invalid", "unsupported", "b refuses this device")
    assert (res[2].status, res[2].invalid_reason) == ("invalid", "runtime")
    assert "kernel blew up" in res[2].message


def test_interleaved_runs_the_correctness_gate():
    class Wrong(ReferenceBackend):
        family = "wrong"

        def prepare(self, workload, candidate, problem):
            p = super().prepare(workload, candidate, problem)
            inner = p.run
            p.run = lambda: inner() * 2
            return p

    entries = [(ReferenceBackend(), Candidate("reference", "torch", 4)), (Wrong(), Candidate("wrong", "torch", 4))]
    res = trial.measure_interleaved(entries, _wl(), MeasureSettings(samples=2), rounds=1)
    assert res[0].status == "ok" and res[0].max_rel_error < 1e-6
    assert (res[1].status, res[1].invalid_reason) == ("invalid", "wrong_result")


def test_pool_is_larger_than_l2_without_a_gpu():
    assert timing.default_pool_bytes("cpu") >= 4 * timing.l2_bytes("cpu")
    assert timing.default_pool_bytes("cpu") >= 256 << 20


def test_stats_of_spread_and_median():
    s = stats_of([10.0, 11.0, 12.0, 13.0, 100.0])
    assert s.median == 12.0 and s.minimum == 10.0
    assert s.spread == pytest.approx((13.0 - 11.0) / 12.0)
