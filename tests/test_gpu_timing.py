"""The GPU timer on real CUDA graphs, with torch-only candidates (no kernel family needed): the
timed graph is replayed for its check only once, on its first sampling replay, whose times are
kept as samples; a graph that does not reproduce the eager output is never sampled."""

from __future__ import annotations

import pytest
import torch

from mla_tune.families.base import Prepared
from mla_tune.measure import timing

pytestmark = pytest.mark.gpu


def _count_replays(monkeypatch) -> list:
    replays = []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay",
                        lambda self: replays.append(1) or original(self))
    return replays


def test_the_timed_graph_is_checked_on_its_first_sampling_replay(monkeypatch):
    x = torch.randn(1 << 16, device="cuda")
    out = torch.empty_like(x)
    runs = []

    def run():
        runs.append(1)
        return torch.mul(x, 2.0, out=out)

    replays = _count_replays(monkeypatch)
    timer = timing.KernelTimer(Prepared(run, None, out), "cuda", warmup=1, plan_samples=0,
                               warm=False)
    assert timer.method == timing.METHOD_GRAPH_EVENTS, timer.note
    # one warm-up run (its output is the eager output), one on the capture stream, the captured ones
    assert len(runs) == 2 + timing.KernelTimer.LEAD_RUNS + timing.KernelTimer.RUNS_PER_GRAPH and not replays
    first = timer.sample(4)
    assert len(replays) == 1 and len(first) == 4 and min(first) > 0
    # the check's replay left a correct output behind (it was poisoned before)
    torch.testing.assert_close(out, x * 2.0)
    more = timer.sample(timing.KernelTimer.RUNS_PER_GRAPH + 2)
    assert len(more) == timing.KernelTimer.RUNS_PER_GRAPH + 2 and len(replays) == 3
    assert timer.method == timing.METHOD_GRAPH_EVENTS and not timer.note
    timer.close()


def test_a_graph_that_differs_from_the_eager_run_is_never_sampled(monkeypatch):
    out = torch.empty(1024, device="cuda")
    calls = [0]

    def run():          # a host value baked into the graph at capture: replays are stale
        calls[0] += 1
        return out.fill_(float(calls[0]))

    timer = timing.KernelTimer(Prepared(run, None, out), "cuda", warmup=1, plan_samples=0,
                               warm=False)
    assert timer.method == timing.METHOD_GRAPH_EVENTS     # captured; not yet replayed
    xs = timer.sample(6)
    # the timed graph's first replay differed, so did the one-run graph's: eager events
    assert timer.method == timing.METHOD_EVENTS, timer.note
    assert "differs from the eager output" in timer.note
    assert len(xs) == 6 and min(xs) > 0
    assert timer.timed_graph is None and timer.graph is None
    timer.close()


def test_measure_interleaved_keeps_the_first_replay_samples():
    from mla_tune.families.base import Candidate
    from mla_tune.measure.trial import MeasureSettings, ProblemCache, measure_interleaved
    from mla_tune.problem.workload import Workload

    class Doubling:
        family = "doubling"

        def prepare(self, workload, candidate, problem):
            x = torch.randn(1 << 14, device="cuda")
            out = torch.empty_like(x)
            return Prepared(lambda: torch.mul(x, 2.0, out=out), None, out)

    w = Workload(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, softmax_scale=0.1,
                 batch_size=1, context_len=64)
    s = MeasureSettings(device="cuda", samples=7, plan_samples=0, check=False, warmup=1)
    results = measure_interleaved([(Doubling(), Candidate("doubling", b, 64)) for b in "ab"],
                                  w, s, rounds=2, problems=ProblemCache())
    for r in results:
        assert r.status == "ok", r.message
        assert r.samples.method == timing.METHOD_GRAPH_EVENTS
        assert len(r.samples["kernel_us"]) == 7 and min(r.samples["kernel_us"]) > 0
