"""Timing harness logic on the CPU: sample counts, plan timing, interleaving order, failures as data."""

import time

import pytest

from mla_tune.measure import timing, trial
from mla_tune.families import Candidate, CandidateInvalid, Prepared
from mla_tune.families.reference import ReferenceFamily
from mla_tune.measure.trial import MeasureSettings
from mla_tune.problem.workload import custom_model, workload_for
from mla_tune.store.stats import stats_of


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


def test_sampling_in_rounds_rotates_stops_early_and_keeps_a_failure():
    from mla_tune.measure.sampling import sample_in_rounds
    order = []

    class Timer:
        def __init__(self, key, value, fail_at=None):
            self.key, self.value, self.fail_at, self.calls = key, value, fail_at, 0

        def sample(self, n):
            order.append(self.key)
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError(f"{self.key} lost its context")
            return [self.value] * n

    timers = {"a": Timer("a", 1.0), "b": Timer("b", 2.0, fail_at=2), "c": Timer("c", 5.0)}
    # c knows its median after one round; b fails in its second; a takes all 7 (3 + 3 + 1)
    got, errors = sample_in_rounds(timers, samples=7, rounds=3, enough=lambda xs: xs[0] == 5.0)
    assert "".join(order) == "abc" + "ba" + "a"         # the order rotated by one per round
    assert got == {"a": [1.0] * 7, "b": [2.0] * 3, "c": [5.0] * 3}
    assert list(errors) == ["b"] and "lost its context" in str(errors["b"])


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
    class Wrong(ReferenceFamily):
        family = "wrong"

        def prepare(self, workload, candidate, problem):
            p = super().prepare(workload, candidate, problem)
            inner = p.run
            p.run = lambda: inner() * 2
            return p

    entries = [(ReferenceFamily(), Candidate("reference", "torch", 4)), (Wrong(), Candidate("wrong", "torch", 4))]
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


# ---------------------------------------------------------------- the sweep's wall time

def test_reference_and_problems_are_made_once_per_workload_and_page():
    cache = trial.ProblemCache()
    entries = [(ReferenceFamily(), Candidate("reference", "torch", p)) for p in (4, 4, 8)]
    s = MeasureSettings(samples=2)
    res = trial.measure_interleaved(entries[:2], _wl(), s, rounds=1, problems=cache)
    assert all(r.status == "ok" for r in res)
    # one instance per page size: checked and timed on, with its reference computed once
    assert cache.references == 1 and cache.made == 1
    trial.measure_interleaved(entries, _wl(), s, rounds=1, problems=cache)   # same workload again
    assert cache.references == 2 and cache.made == 2          # only page 8 is new
    other = workload_for(custom_model(2, 32, 16), 1, 3, 8)
    trial.measure_interleaved(entries[:1], other, s, rounds=1, problems=cache)
    assert cache.references == 3 and cache.workload == other and set(cache._reference) == {4}


class Timed:
    """A family whose samples come from a list: steady (every sample the same) or noisy."""

    family = "timed"

    def prepare(self, workload, candidate, problem):
        return Prepared(run=lambda: None, plan=None, out=None, graphable=False)


def test_sampling_stops_early_only_where_the_median_is_known(monkeypatch):
    from mla_tune.measure import sampling
    assert sampling.median_interval(list(range(1, 11))) == (2, 9)      # x(2), x(9) of 10
    assert sampling.median_interval(list(range(1, 21))) == (6, 15)
    assert not sampling.enough_samples([10.0] * 9) and sampling.enough_samples([10.0] * 10)
    assert not sampling.enough_samples([10.0, 10.5] * 5)               # 5% wide: go on
    noisy = iter([10.0, 11.0, 9.0, 12.0, 8.0] * 100)

    def sample(self, n):
        return [10.0] * n if self.prepared.steady else [next(noisy) for _ in range(n)]

    monkeypatch.setattr(timing.KernelTimer, "sample", sample)

    class Fam(Timed):
        def prepare(self, workload, candidate, problem):
            p = super().prepare(workload, candidate, problem)
            p.steady = candidate.backend == "steady"
            return p

    entries = [(Fam(), Candidate("timed", b, 1)) for b in ("steady", "noisy")]
    s = MeasureSettings(samples=20, min_samples=10, check=False, plan_samples=0)
    steady, noisy_r = trial.measure_interleaved(entries, _wl(), s, rounds=4)
    assert len(steady.samples["kernel_us"]) == 10 and len(noisy_r.samples["kernel_us"]) == 20
    # without min_samples every candidate gets all its samples, as before
    full = trial.measure_interleaved(entries, _wl(), MeasureSettings(samples=20, check=False), rounds=4)
    assert [len(r.samples["kernel_us"]) for r in full] == [20, 20]


def test_gpu_warm_up_is_once_per_batch(monkeypatch):
    fills, syncs = [], []

    class FakeTimer:
        cuda = True

        def __init__(self, name):
            self.name = name

        def launch(self):           # the clock warm-up must not replay the candidates' graphs
            raise AssertionError("warm_up launched a candidate")

        def _sync(self):
            syncs.append(1)

    n = timing.warm_up([FakeTimer("a"), FakeTimer("b"), None], min_s=0.0, fill=lambda: fills.append(1))
    # one round of fills between two synchronisations, whatever the batch holds
    assert n == timing.WARM_FILLS == len(fills) and len(syncs) == 1
    fills.clear()
    assert timing.warm_up([FakeTimer(x) for x in "abcdefg"], min_s=0.0,
                          fill=lambda: fills.append(1)) == timing.WARM_FILLS
    # until the asked-for time has passed: more rounds, each one synchronised
    syncs.clear()
    clock = [0.0]                            # a fake clock: each fill takes 1 ms, whatever the load

    def fill():
        clock[0] += 0.001
    with monkeypatch.context() as m:
        m.setattr(timing.time, "perf_counter", lambda: clock[0])
        # 16 fills (16 ms) do not reach 20 ms: a second synchronised round, then done
        n = timing.warm_up([FakeTimer("a")], min_s=0.02, fill=fill)
    assert n == 2 * timing.WARM_FILLS and len(syncs) == 2
    assert timing.warm_up([]) == 0
    # the interleaved batch builds its timers without the per-candidate warm-up
    made = []
    real = timing.KernelTimer.__init__

    def init(self, *a, **k):
        made.append(k.get("warm", True))
        real(self, *a, **k)

    monkeypatch.setattr(timing.KernelTimer, "__init__", init)
    entries = [(Timed(), Candidate("timed", b, 1)) for b in "ab"]
    trial.measure_interleaved(entries, _wl(), MeasureSettings(samples=2, check=False), rounds=1)
    assert made == [False, False]
