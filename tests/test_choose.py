"""Winners and the global choice (mla_tune.tune.choose) from trial rows of a real results DB."""

import math

import pytest

from mla_tune.families.base import Candidate
from mla_tune.tune.choose import bucket_weights, choose, choose_from_store, latest_trials
from mla_tune.tune.verdict import NO_SIGNIFICANT_DIFFERENCE, compare, min_p_value
from mla_tune.problem.workload import WorkloadMix, model_preset, workload_for
from mla_tune.store.results import ResultsStore

V3 = model_preset("deepseek-v3")
SPREAD = [1.000, 1.004, 0.997, 1.008, 0.994, 1.002, 1.006, 0.998, 1.010, 0.992]   # +-1%


def samples(median, spread=SPREAD):
    return [median * s for s in spread]


class DB:
    """A results DB with one GPU run; put() stores one trial."""

    def __init__(self, path, device="NVIDIA H200"):
        self.store = ResultsStore(path)
        self.run = self.store.add_run({"kind": "gpu", "device_name": device})

    def put(self, batch, context, key, value, default=False, tp=8, q_len=1, run=None):
        w = workload_for(V3, tp, batch, context, q_len=q_len)
        wid = self.store.workload_id(w, 1, 1)
        c = Candidate.parse(key)
        if isinstance(value, str):
            return self.store.add_trial(run or self.run, wid, c, "invalid", invalid_reason=value,
                                        message="refused", is_default=default)
        vals = value if isinstance(value, list) else samples(value)
        return self.store.add_trial(run or self.run, wid, c, "ok", {"kernel_us": vals},
                                    is_default=default)

    def choice(self, mix=None, **kw):
        return choose_from_store(self.store, mix, **kw)


@pytest.fixture
def db(tmp_path):
    d = DB(tmp_path / "r.db")
    yield d
    d.store.close()


def verdict(choice, batch, context, family, page=None):
    m = choice.models[0]
    b = m.bucket(batch, context)
    return b.per_page[page][family] if page is not None else b.families[family]


def test_compare_exact_mann_whitney():
    sig, p, ratio = compare(samples(100.0), samples(80.0))
    assert sig and ratio == pytest.approx(1.25)
    assert p == pytest.approx(1 / math.comb(20, 10))       # disjoint samples: the exact floor
    assert min_p_value(4, 4) == pytest.approx(1 / 70)


def test_significant_challenger_displaces_default(db):
    db.put(1, 1024, "flashinfer/auto/p64", 20.0, default=True)
    db.put(1, 1024, "flashinfer/fa3/p64", 15.0)
    db.put(1, 1024, "flashinfer/fa2/p64", 25.0)
    v = verdict(db.choice(), 1, 1024, "flashinfer")
    assert v.chosen.key == "flashinfer/fa3/p64" and v.significant
    assert v.p_value < 0.002 and v.ratio == pytest.approx(20 / 15, rel=1e-3)
    assert v.chosen.plan_params == {"backend": "fa3"} and v.gain == pytest.approx(20 / 15, rel=1e-3)


def test_small_gain_is_no_significant_difference(db):
    # 3% faster with disjoint samples: significant by the test, but under the 1.05 ratio
    db.put(1, 1024, "flashinfer/auto/p64", samples(20.0, [1 + i / 1000 for i in range(10)]), default=True)
    db.put(1, 1024, "flashinfer/fa3/p64", samples(19.4, [1 + i / 1000 for i in range(10)]))
    v = verdict(db.choice(), 1, 1024, "flashinfer")
    assert v.chosen.key == "flashinfer/auto/p64" and not v.significant
    assert v.best.key == "flashinfer/fa3/p64" and v.p_value < 0.002
    assert v.reason.startswith(NO_SIGNIFICANT_DIFFERENCE)
    assert v.time_us == v.default_time_us


def test_noisy_gain_is_no_significant_difference(db):
    noisy = [0.7, 1.3, 0.8, 1.2, 0.9, 1.1, 1.0, 1.25, 0.75, 1.05]
    db.put(1, 1024, "flashinfer/auto/p64", samples(20.0, noisy), default=True)
    db.put(1, 1024, "flashinfer/fa3/p64", samples(18.0, noisy))     # 1.11x on medians, all overlap
    v = verdict(db.choice(), 1, 1024, "flashinfer")
    assert v.chosen.key == "flashinfer/auto/p64" and v.ratio > 1.05 and v.p_value >= 0.002
    assert v.reason.startswith(NO_SIGNIFICANT_DIFFERENCE)


def test_too_few_samples_cannot_be_significant(db):
    db.put(1, 1024, "flashinfer/auto/p64", [20.0, 20.1, 20.2, 20.3], default=True)
    db.put(1, 1024, "flashinfer/fa3/p64", [10.0, 10.1, 10.2, 10.3])
    ch = db.choice()
    v = verdict(ch, 1, 1024, "flashinfer")
    assert v.chosen.key == "flashinfer/auto/p64" and v.p_value == pytest.approx(1 / 70)
    assert "cannot reach" in v.reason and any("samples" in n for n in ch.notes)


def test_invalid_or_missing_default_gives_way(db):
    db.put(1, 1024, "flashinfer/auto/p64", "runtime", default=True)
    db.put(1, 1024, "flashinfer/fa3/p64", 15.0)
    db.put(1, 1024, "flashinfer/cutlass/p64", "unsupported")
    db.put(4, 1024, "flashinfer/fa2/p64", "unsupported", default=True)
    ch = db.choice()
    v = verdict(ch, 1, 1024, "flashinfer")
    assert v.chosen.key == "flashinfer/fa3/p64" and not v.significant
    assert "invalid" in v.reason and v.n_invalid == 2 and v.n_valid == 1
    v4 = verdict(ch, 4, 1024, "flashinfer", page=64)
    assert v4.chosen is None and v4.reason == "no valid candidate"


def test_page_size_default_kept_within_min_ratio(db):
    for b, ctx in ((1, 1024), (8, 4096)):
        for p, t in ((16, 98.0), (64, 100.0)):           # page 16 only 2% faster
            db.put(b, ctx, f"flashinfer/auto/p{p}", t, default=True)
    m = db.choice().models[0]
    assert m.page_size == 64 and "default" in m.page_reason and "kept" in m.page_reason


def test_page_size_minimises_weighted_total(db):
    # page 16 is much better at batch 1, much worse at batch 64
    db.put(1, 1024, "flashinfer/auto/p16", 10.0, default=True)
    db.put(1, 1024, "flashinfer/auto/p64", 20.0, default=True)
    db.put(64, 1024, "flashinfer/auto/p16", 60.0, default=True)
    db.put(64, 1024, "flashinfer/auto/p64", 40.0, default=True)
    # uniform: totals 70 (p16) vs 60 (p64)
    assert db.choice().models[0].page_size == 64
    # a mix of mostly batch-1 traffic: 10*10 + 1*60 = 160 vs 10*20 + 40 = 240
    m = db.choice(WorkloadMix.from_rows([(1, 1024, 10.0), (64, 1024, 1.0)])).models[0]
    assert m.page_size == 16
    assert m.total("flashinfer", 16).total_us == pytest.approx(160.0, rel=1e-2)
    assert m.bucket(1, 1024).weight == 10.0


def test_backend_order_follows_weighted_totals(db):
    # flashinfer wins at large batch by a lot, triton wins at batch 1 by a little
    for b, fi, tr in ((1, 12.0, 10.0), (64, 100.0, 300.0)):
        db.put(b, 4096, "flashinfer/auto/p64", fi, default=True)
        db.put(b, 4096, "triton/triton/p64/num_kv_splits=8,rule=vllm", tr, default=True)
    m = db.choice().models[0]
    assert m.family_order == ("flashinfer", "triton")
    assert m.backend_order == ("FLASHINFER_MLA", "TRITON_MLA")
    assert m.bucket(1, 4096).best_family == "triton" and m.bucket(64, 4096).best_family == "flashinfer"
    m = db.choice(WorkloadMix.from_rows([(1, 4096, 200.0), (64, 4096, 1.0)])).models[0]
    assert m.backend_order == ("TRITON_MLA", "FLASHINFER_MLA")


def test_per_family_chunking_winner(db):
    db.put(1, 32768, "triton/triton/p64/num_kv_splits=64,rule=vllm", 80.0, default=True)
    db.put(1, 32768, "triton/triton/p64/num_kv_splits=128", 40.0)
    db.put(1, 32768, "triton/triton/p64/num_kv_splits=256", 41.0)
    v = verdict(db.choice(), 1, 32768, "triton")
    assert v.chosen.params == {"num_kv_splits": 128} and v.significant
    assert v.chosen.plan_params == {"backend": "triton", "num_kv_splits": 128}


def test_mix_snaps_to_nearest_bucket():
    keys = [(1, 1024, 1), (4, 1024, 1), (4, 8192, 1), (4, 8192, 2)]
    w = bucket_weights(WorkloadMix.from_rows([(3, 1500, 2.0), (5, 6000, 1.0), (1, 100, 0.5)]), keys)
    assert w == {(1, 1024, 1): 0.5, (4, 1024, 1): 2.0, (4, 8192, 1): 1.0, (4, 8192, 2): 1.0}
    assert bucket_weights(None, keys) == {k: 1.0 for k in keys}


def test_latest_trial_wins(db):
    db.put(1, 1024, "flashinfer/auto/p64", 20.0, default=True)
    db.put(1, 1024, "flashinfer/fa3/p64", 10.0)
    db.put(1, 1024, "flashinfer/fa3/p64", 30.0)            # re-measured: slower now
    rows = db.store.trials()
    assert len(latest_trials(rows)) == 2
    v = verdict(db.choice(), 1, 1024, "flashinfer")
    assert v.chosen.key == "flashinfer/auto/p64" and v.best.key == "flashinfer/auto/p64"


def test_default_named_by_backend_when_unmarked(db, monkeypatch):
    # rows written without the is_default mark (older DBs, `mla-tune bench` on the GPU host): the
    # family names its default, for FlashInfer what the plugin plans untuned on this device
    from vllm_metax.core import device as device_mod
    monkeypatch.setattr(device_mod, "detect_device",
                        lambda: device_mod.DeviceInfo("NVIDIA H200", "torch", False, 132, (9, 0)))
    w = workload_for(V3, 8, 1, 1024)
    wid = db.store.workload_id(w, 1, 1)
    db.store.add_trial(db.run, wid, Candidate("reference", "torch", 16), "ok", {"kernel_us": samples(5.0)})
    db.store.add_trial(db.run, wid, Candidate("flashinfer", "fa3", 16), "ok", {"kernel_us": samples(9.0)})
    db.store.add_trial(db.run, wid, Candidate("flashinfer", "fa2", 16), "ok", {"kernel_us": samples(6.0)})
    ch = db.choice()
    assert verdict(ch, 1, 1024, "reference").default.key == "reference/torch/p16"
    fi = verdict(ch, 1, 1024, "flashinfer")
    assert fi.default.key == "flashinfer/fa3/p16" and fi.chosen.key == "flashinfer/fa2/p16"
    assert verdict(db.choice(default_of=None), 1, 1024, "flashinfer").default is None


def test_several_devices_need_a_name(db):
    other = db.store.add_run({"kind": "gpu", "device_name": "MetaX C500"})
    db.put(1, 1024, "flashinfer/auto/p64", 20.0, default=True)
    db.put(1, 1024, "flashinfer/auto/p64", 50.0, default=True, run=other)
    with pytest.raises(ValueError, match="several devices"):
        db.choice()
    ch = db.choice(device_name="MetaX C500")
    assert ch.device_name == "MetaX C500" and verdict(ch, 1, 1024, "flashinfer").time_us == pytest.approx(50.0, rel=1e-2)


def test_model_entries_split_by_heads_and_carry_tp(db):
    db.put(1, 1024, "flashinfer/auto/p64", 20.0, default=True, tp=1)
    db.put(1, 1024, "flashinfer/auto/p64", 10.0, default=True, tp=8)
    ch = db.choice()
    assert [(m.num_heads, m.tp_size) for m in ch.models] == [(128, 1), (16, 8)]
    assert ch.kind == "gpu" and ch.n_trials == 2


def test_trials_rows_and_records_choose_alike(db):
    # the sweep (and the prefill choice) still hand `ResultsStore.trials()` rows to choose
    db.put(1, 1024, "flashinfer/fa2/p64", 20.0, default=True)
    db.put(1, 1024, "flashinfer/fa3/p64", 15.0)
    db.put(4, 1024, "flashinfer/fa2/p64", 30.0, default=True)
    from_rows, from_records = choose(db.store.trials()), choose(db.store.records())
    assert from_rows == from_records
    assert [r["id"] for r in latest_trials(db.store.trials())] == [r.id for r in latest_trials(db.store.records())]


def test_a_split_pipe_that_wins_is_what_the_config_serves(db, tmp_path):
    # the split family's pipe knob, stored, chosen, emitted and read back as the plugin reads it
    from mla_tune.tune.emit import build_tuned_config
    from vllm_metax.core import choices, decisions, tuned_config as tc
    db.put(1, 8192, "flashinfer/fa3/p64", 26.0, default=True)
    db.put(1, 8192, "split/triton/p64/num_splits=128,partial=bfloat16", 16.4, default=True)
    db.put(1, 8192, "split/triton/p64/num_splits=64,partial=bfloat16", 19.0)
    db.put(1, 8192, "split/triton/p64/num_splits=128,partial=bfloat16,pipe=t32x4", 12.0)
    db.put(1, 8192, "split/triton/p64/num_splits=128,partial=bfloat16,pipe=t32x4-pdl", "unsupported")
    db.put(1, 1024, "flashinfer/fa3/p64", 15.0, default=True)
    db.put(1, 1024, "split/triton/p64/num_splits=16,partial=bfloat16", 12.6, default=True)
    db.put(1, 1024, "split/triton/p64/num_splits=16,partial=bfloat16,pipe=t64-pdl", 12.5)   # noise
    v = verdict(db.choice(), 1, 8192, "split")
    assert v.chosen.params == {"num_splits": 128, "partial": "bfloat16", "pipe": "t32x4"} and v.significant
    path = tc.write_tuned_config(build_tuned_config(db.store), tmp_path)
    (entry,) = tc.read_tuned_config(path).models
    long, short = entry.lookup(1, 8192).bucket, entry.lookup(1, 1024).bucket
    assert decisions.split_serves(long) == choices.SplitChoice(128, "bfloat16", "t32x4")
    assert long.families["split"].params["pipe"] == "t32x4"
    # a gain within noise keeps the default: the measured pipe, written without the knob
    assert decisions.split_serves(short) == choices.SplitChoice(16, "bfloat16")
    assert "pipe" not in short.families["split"].params
