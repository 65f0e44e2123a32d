"""The search replayed over stored measurements (no GPU): TPE against the grid on a large space.

The space is bench/experiments/tpe_vs_grid.py's synthetic landscape (a split-KV kernel with four knobs beside
three fixed backends, ~400 points per bucket, 2% sample noise), stored in a real results DB.
"""

from pathlib import Path

import pytest
from bench_support import load_bench

from mla_tune.families.base import Candidate
from mla_tune.tune.sweep.replay import replay_sweep
from mla_tune.tune.search import Evaluation, SearchPolicy, search
from mla_tune.tune.search_space import SearchSpace
from mla_tune.tune.sweep.config import SweepConfig


def bench_module():
    return load_bench("tpe_vs_grid")


@pytest.fixture(scope="module")
def landscape(tmp_path_factory):
    bench = bench_module()
    db = tmp_path_factory.mktemp("land") / "landscape.db"
    sizes = bench.build_landscape_db(db, buckets=[(1, 8192), (64, 32768)])
    return bench, db, sizes


def test_tpe_reaches_the_grid_winner_with_far_fewer_trials(landscape, capsys):
    bench, db, sizes = landscape
    rows = bench.compare(db, seeds=(0, 1))
    s = bench.summarize(rows)
    with capsys.disabled():
        print(f"\nTPE vs grid on a synthetic space of {min(sizes.values())}-{max(sizes.values())} "
              f"points: {s}")
    for r in rows:
        assert r["grid_trials"] == r["space"] > 300
        assert r["tpe_trials"] < r["grid_trials"] / 3
        assert r["best_excess_pct"] < 5.0                   # within noise-ish of the grid's best
    assert sum(r["trials_to_grid_best"] is not None for r in rows) >= len(rows) - 1
    assert s["chosen_excess_pct_max"] < 5.0


def test_replay_grid_is_the_stored_choice(landscape):
    from mla_tune.tune.choose import choose_from_store
    from mla_tune.store.results import ResultsStore
    bench, db, sizes = landscape
    out = replay_sweep(db, SweepConfig(buckets=[], mode="auto", emit=False))
    assert all(b.search.mode == "tpe" for b in out.buckets)        # auto: the space is large
    grid = replay_sweep(db, SweepConfig(buckets=[], mode="grid", emit=False))
    assert grid.measured == sum(sizes.values())
    with ResultsStore(db, create=False) as s:
        direct = choose_from_store(s)
    for a, b in zip(grid.choice.models[0].buckets, direct.models[0].buckets):
        assert {f: v.chosen.key for f, v in a.families.items()} == \
            {f: v.chosen.key for f, v in b.families.items()}
    # the default split rule loses to the tuned split count by more than noise
    tuned = [b.families["synth"] for b in direct.models[0].buckets]
    assert all(v.significant and v.gain > 1.05 for v in tuned)


def _space(n_splits=9, pages=(16, 64)):
    cands = [Candidate("k", "split", p, {"num_kv_splits": 2 ** i}) for i in range(n_splits) for p in pages]
    cands += [Candidate("k", "fixed", p) for p in pages]
    defaults = [Candidate("k", "split", p, {"num_kv_splits": 4}) for p in pages]
    return SearchSpace.build(cands, defaults)


def test_space_structure_and_constraints():
    sp = SearchSpace.build(
        [Candidate("t", "t", 16, {"num_kv_splits": s, "rule": "vllm"} if s == 8 else {"num_kv_splits": s})
         for s in (1, 2, 4, 8, 16)] + [Candidate("t", "t", 64, {"num_kv_splits": 2})],
        constraints=[lambda c: "too many" if c.params.get("num_kv_splits") == 16 else None])
    assert len(sp) == 5 and [c.params["num_kv_splits"] for c, _ in sp.dropped] == [16]
    # the rule=vllm label is not an axis: splits and page alone tell the points apart
    assert all(":rule" not in ax.name for axes in sp._axes.values() for ax in axes)
    c8 = next(c for c in sp.candidates if c.params.get("num_kv_splits") == 8)
    assert sp.params_of(c8) == {"t/t:page_size": 0, "t/t:num_kv_splits": 3}
    near = {n.key for n in sp.neighbours(c8)}
    assert near == {"t/t/p16/num_kv_splits=4"}     # 16 dropped; no p64 twin with 8 splits


@pytest.mark.parametrize("mode", ["grid", "tpe"])
def test_search_evaluates_defaults_first_and_respects_the_trial_budget(mode):
    sp = _space()
    asked = []

    def evaluate(cands):
        asked.extend(cands)
        return [Evaluation(c, 10.0 + abs(c.params.get("num_kv_splits", 3) - 32), trial_id=1) for c in cands]

    out = search(sp, evaluate, SearchPolicy(mode=mode, max_trials=8, patience=None, seed=3))
    assert set(asked[:2]) == set(sp.defaults)
    assert len({c.key for c in asked}) == len(asked)              # nothing evaluated twice
    assert len(asked) <= 8 + (2 if mode == "tpe" else 0)          # TPE adds the best's page twin
    assert out.mode == mode and out.stopped == "trial budget"


def test_invalid_candidates_never_win_and_time_budget_stops():
    sp = _space()
    out = search(sp, lambda cs: [Evaluation(c, None, reason="crash") if c.backend == "fixed"
                                 else Evaluation(c, 5.0) for c in cs],
                 SearchPolicy(mode="grid"))
    assert out.stopped == "complete" and out.best.candidate.backend == "split"
    out = search(sp, lambda cs: [Evaluation(c, 1.0) for c in cs], SearchPolicy(mode="tpe", deadline=0.0))
    assert out.stopped == "time budget" and not out.evaluations


# the DB bench/experiments/triton_vs_flashinfer.py wrote on the H200 (its .md/.json/.log in bench/results/)
H200_DB = Path(__file__).resolve().parent / "data" / "triton_vs_flashinfer_h200.db"


def test_replay_of_real_h200_measurements(tmp_path):
    """The search and the winner rules over measurements an H200 really took (24 shapes, fa3 and
    Triton num_kv_splits at page 64): the verdicts bench/results/triton_vs_flashinfer_h200.md reports come out again."""
    import shutil
    db = tmp_path / "h200.db"
    shutil.copy(H200_DB, db)
    out = replay_sweep(db, SweepConfig(buckets=[], emit=False))
    assert out.choice.device_name == "NVIDIA H200" and len(out.buckets) == 24
    assert all(b.search.mode == "grid" and b.search.stopped == "complete" for b in out.buckets)
    verdicts = [(m.num_heads, b, b.families["triton"]) for m in out.choice.models for b in m.buckets]
    assert sum(v.significant for _, _, v in verdicts) == 17        # "significant in 17 shapes"
    assert {(h, b.batch_size, b.context_len) for h, b, _ in verdicts if b.best_family == "triton"} \
        == {(16, 1, 1024)}                                          # "Triton beats fa3 ... at H16 B1 L1024"
    for m in out.choice.models:
        assert m.page_size == 64 and m.backend_order == ("FLASHINFER_MLA", "TRITON_MLA")


def test_grid_measures_the_default_page_first():
    sp = _space(n_splits=2, pages=(1, 16, 64))          # per page: 2 splits, fixed, the default
    order = sp.grid_order(first_page=64)
    assert [c.page_size for c in order] == [64] * 4 + [1] * 4 + [16] * 4
    assert order[0] in sp.defaults and order[4] in sp.defaults          # each group leads with it
    cut = sp.grid_order(by_page=False, first_page=64)
    assert set(cut[:3]) == set(sp.defaults) and cut[3].page_size == 64
