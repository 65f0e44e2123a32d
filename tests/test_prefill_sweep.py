"""The tuner's side of the prefill backend (issue #12) on the CPU: the prefill problem and its
reference, the `flashinfer_prefill` family run through the plugin's own op (FlashInfer's ragged
wrapper replaced by tests/prefill_support.py's recording stand-in, which computes from exactly the
planned index pointers), the prefill sweep storing every trial in results.db apart from decode,
emit's prefill section under the decode rule, and the emit -> plugin contract: what emit writes
is what the plugin's prefill backend plans, bucket for bucket."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import plugin_support as ps
from mla_tune.families.base import Candidate
from mla_tune.measure.trial import MeasureSettings
from mla_tune.problem.prefill import (PrefillWorkload, check_rows, make_prefill_problem,
                                      prefill_reference, prefill_workload)
from mla_tune.problem.workload import ProblemError, custom_model, model_preset, workload_for
from mla_tune.store.results import ResultsStore
from prefill_support import RecordingFA3Fwd, RecordingRaggedWrapper, reference
from vllm_metax.core import decisions, tuned_config as tc
from vllm_metax.core.device import DeviceInfo

DEVICE = "NVIDIA H200"
H200 = DeviceInfo(DEVICE, "torch", False, 132, (9, 0))
HOPPER = decisions.prefill_backends(False, (9, 0))
METAX = decisions.prefill_backends(True, (8, 0))


def _model():
    return custom_model(16)


# ---------------------------------------------------------------- the problem

def test_prefill_workloads_are_the_plugins_lookup_statistic():
    m = model_preset("deepseek-v3")
    w = prefill_workload(m, 8, True, 256, 64)
    assert (w.num_heads, w.requests, w.q_lens, w.kv_lens) == (16, 4, [64] * 4, [64] * 4)
    assert decisions.prefill_statistic(w.query_tokens, w.total_kv_tokens, w.requests) == (256, 64)
    c = prefill_workload(m, 1, False, 256, 16384)
    assert (c.num_heads, c.requests, c.causal, c.softmax_scale) == (128, 1, False, m.softmax_scale)
    assert PrefillWorkload.from_row({**c.key, "q_len": c.key["q_len"]}) == c
    assert PrefillWorkload.from_row(w.key) == w
    with pytest.raises(ProblemError, match="do not split into requests of 100"):
        prefill_workload(m, 8, True, 256, 100)
    with pytest.raises(ProblemError, match="kv_len .* x requests"):
        PrefillWorkload(16, 512, 64, 0.1, True, 256, 128, 1)
    with pytest.raises(ProblemError, match="context-chunk bucket needs"):
        prefill_workload(m, 8, False, 256)
    with pytest.raises(ProblemError, match="not a prefill workload"):
        PrefillWorkload.from_row({**w.key, "ragged": "uniform"})


@pytest.mark.parametrize("causal, q, kv, n", [(True, 96, 32, 3), (False, 64, 200, 2)])
def test_the_tuners_reference_matches_the_tests_float64_one(causal, q, kv, n):
    w = PrefillWorkload(4, 512, 64, 192 ** -0.5, causal, q, kv, n)
    p = make_prefill_problem(w, seed=3)
    rows = check_rows(w, seed=1)
    assert {0, q // n - 1, q - 1} <= set(rows)
    out, lse = prefill_reference(p, rows, head_block=3)
    ro, rl = reference(p.q, p.k, p.v, w.q_lens, w.kv_lens, w.softmax_scale, causal)
    assert torch.allclose(out.double(), ro[rows], atol=1e-5)
    assert torch.allclose(lse.double(), rl.T[rows], atol=1e-5)
    # the plugin plans new tokens from host index pointers; a context chunk's are vLLM's device ones
    assert p.qo_indptr.tolist() == [0] + [q // n * (i + 1) for i in range(n)]


# ---------------------------------------------------------------- the family through the op

@pytest.fixture
def family(monkeypatch):
    """The prefill family on a pretend Hopper, FlashInfer's wrapper the recording stand-in."""
    import mla_tune.families.flashinfer_prefill as fp
    RecordingRaggedWrapper.instances, RecordingRaggedWrapper.refuse = [], set()
    monkeypatch.setattr(fp, "device_backends", lambda: HOPPER)
    return fp.FlashInferPrefillFamily(wrapper_cls=RecordingRaggedWrapper)


def test_the_family_declares_what_the_plugin_may_plan(family, monkeypatch):
    import mla_tune.families.flashinfer_prefill as fp
    w = prefill_workload(_model(), 1, True, 64, 32)
    assert [c.key for c in family.space(w)] == ["flashinfer_prefill/fa3/p1", "flashinfer_prefill/fa2/p1"]
    assert family.default_candidate(w).key == "flashinfer_prefill/fa3/p1"
    monkeypatch.setattr(fp, "device_backends", lambda: METAX)
    assert [c.key for c in family.space(w)] == ["flashinfer_prefill/fa2/p1"]
    assert family.default_candidate(w).backend == "fa2"
    assert not fp.FlashInferPrefillFamily().available("cpu").ok


def test_candidates_are_measured_gated_and_refusals_are_data(family):
    from mla_tune.measure.prefill_trial import measure_prefill
    w = PrefillWorkload(4, 512, 64, 192 ** -0.5, False, 32, 80, 2)
    RecordingRaggedWrapper.refuse = {"fa2"}
    settings = MeasureSettings(device="cpu", warmup=1, samples=4, plan_samples=2)
    fa3, fa2 = family.space(w)
    res = measure_prefill([(family, fa3), (family, fa2)], w, settings, rounds=2)
    assert res[0].status == "ok" and len(res[0].samples["kernel_us"]) == 4 and res[0].max_rel_error < 1e-2
    assert res[1].status == "invalid" and res[1].invalid_reason == "unsupported"
    plan = RecordingRaggedWrapper.instances[0].plans[-1]
    assert (plan["heads"], plan["qk"], plan["vo"], plan["causal"]) == (4, 192, 128, False)
    assert plan["scale"] == w.softmax_scale and plan["kv"].tolist() == [0, 80, 160]


def test_a_wrong_kernel_never_passes_the_gate(family):
    from mla_tune.measure.prefill_trial import measure_prefill

    class NotCausal(RecordingRaggedWrapper):       # forgets the mask
        def plan(self, *a, causal=False, **kw):
            super().plan(*a, causal=False, **kw)

    class Unwritten(RecordingRaggedWrapper):        # leaves the poisoned output as it is
        def run(self, q, k, v, out=None, lse=None, return_lse=False):
            return out

    w = PrefillWorkload(4, 512, 64, 192 ** -0.5, True, 64, 32, 2)
    settings = MeasureSettings(device="cpu", warmup=1, samples=2, plan_samples=0)
    for wrapper, why in ((NotCausal, "relative error"), (Unwritten, "not fully written")):
        family.wrapper_cls = wrapper
        r = measure_prefill([(family, family.default_candidate(w))], w, settings)[0]
        assert r.status == "invalid" and r.invalid_reason == "wrong_result" and why in r.message


def test_vllm_fa3_is_a_candidate_where_its_library_loads_and_passes_the_gate(family, monkeypatch):
    """vLLM's FA3 varlen prefill (the op's forward replaced by the recording stand-in, which
    returns FA3's LSE form: [heads, tokens], natural log) is measured beside FlashInfer's values,
    planned from the device index pointers and the workload's longest spans."""
    import mla_tune.families.flashinfer_prefill as fp
    from mla_tune.measure.prefill_trial import measure_prefill
    monkeypatch.setattr(fp, "device_backends", lambda: decisions.prefill_backends(False, (9, 0), True))
    fwd = RecordingFA3Fwd()
    family.fa3_fwd = fwd
    w = PrefillWorkload(4, 512, 64, 192 ** -0.5, False, 32, 80, 2)     # a context chunk: LSE checked
    space = family.space(w)
    assert [c.backend for c in space] == ["fa3", "fa2", "vllm_fa3"]
    assert family.default_candidate(w).backend == "fa3"               # untuned stays FlashInfer's
    settings = MeasureSettings(device="cpu", warmup=1, samples=3, plan_samples=1)
    res = measure_prefill([(family, c) for c in space], w, settings, rounds=1)
    assert [r.status for r in res] == ["ok"] * 3 and res[2].max_rel_error < 1e-2
    call = fwd.calls[-1]
    assert call["cu_q"].tolist() == [0, 16, 32] and call["cu_k"].tolist() == [0, 80, 160]
    assert (call["max_q"], call["max_k"], call["causal"]) == (16, 80, False)

    class WrongLse(RecordingFA3Fwd):                # an LSE in base 2 where FA3's is natural
        def __call__(self, *a):
            o, lse, _, _ = super().__call__(*a)
            return o, lse / 0.6931471805599453, None, None

    family.fa3_fwd = WrongLse()
    r = measure_prefill([(family, space[2])], w, settings)[0]
    assert r.status == "invalid" and r.invalid_reason == "wrong_result"
    # MetaX and every non-Hopper GPU never offer it
    monkeypatch.setattr(fp, "device_backends", lambda: decisions.prefill_backends(True, (9, 0), True))
    assert [c.backend for c in family.space(w)] == ["fa2"]


# ---------------------------------------------------------------- the sweep and the store

def test_the_sweep_stores_prefill_trials_apart_and_resumes(family, tmp_path):
    from mla_tune.tune.prefill import PrefillSweepConfig, run_prefill_sweep
    m = _model()
    buckets = [prefill_workload(m, 1, True, 64, 32), prefill_workload(m, 1, False, 32, 96)]
    db = tmp_path / "results.db"
    settings = MeasureSettings(device="cpu", warmup=1, samples=3, plan_samples=0)
    cfg = PrefillSweepConfig(buckets, db, "cpu", settings, rounds=1, family=family)
    out = run_prefill_sweep(cfg)
    assert (out.measured, out.invalid, out.cached) == (4, 0, 0)
    with ResultsStore(db, create=False) as store:
        pre = store.trials(prefill=True)
        assert len(pre) == 4 and store.trials() == []          # decode readers never see them
        assert {r["sweep"] for r in pre} == {"prefill"}
        assert sorted((r["candidate"], bool(r["is_default"])) for r in pre)[:2] == [
            ("flashinfer_prefill/fa2/p1", False), ("flashinfer_prefill/fa2/p1", False)]
        assert {PrefillWorkload.from_row(r) for r in pre} == set(buckets)
    again = run_prefill_sweep(cfg)                             # a rerun measures nothing
    assert (again.measured, again.cached, again.run_id) == (0, 4, None)


def test_no_kernel_here_is_a_clear_error_before_anything_is_written(tmp_path):
    from mla_tune.tune.prefill import PrefillSweepConfig, PrefillSweepError, run_prefill_sweep
    db = tmp_path / "results.db"
    with pytest.raises(PrefillSweepError, match="cannot run on cpu"):
        run_prefill_sweep(PrefillSweepConfig([prefill_workload(_model(), 1, True, 64)], db, "cpu"))
    assert not db.exists()


def test_the_cli_refuses_bad_input_in_one_line(tmp_path):
    from mla_tune.cli import app
    r = CliRunner().invoke(app, ["prefill-sweep", "--new-tokens", "300", "--new-requests", "7",
                                 "--db", str(tmp_path / "r.db")])
    assert r.exit_code == 2 and "300 new tokens do not split over 7 requests" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "r.db").exists()
    r = CliRunner().invoke(app, ["prefill-sweep", "--chunk-kv", "lots"])
    assert r.exit_code == 2 and "--chunk-kv" in r.output and "Traceback" not in r.output
    if not torch.cuda.is_available():
        r = CliRunner().invoke(app, ["prefill-sweep", "--db", str(tmp_path / "r.db")])
        assert r.exit_code == 2 and "no CUDA device" in r.output and not (tmp_path / "r.db").exists()


# ---------------------------------------------------------------- emit and the contract

def _samples(base: float, n: int = 12) -> list[float]:
    pattern = [1.00, 1.01, 0.99, 1.02, 0.98, 1.00, 1.03, 0.995, 1.005, 1.01, 0.99, 1.06]
    return [round(base * p, 4) for p in pattern[:n]]


# bucket -> (fa3 = the Hopper default, fa2) median times in us; None: the candidate was invalid
PREFILL_TIMES = {
    (True, 256, 256): (12.6, 25.4),       # fa3 2x faster: the default stays
    (True, 256, 64): (10.8, 9.9),         # fa2 1.09x faster beyond noise: fa2
    (True, 2048, 2048): (58.6, 57.0),     # fa2 1.03x: within the 1.05x rule, the default stays
    (False, 256, 16384): (204.1, 133.4),  # fa2 1.53x: fa2
    (False, 2048, 16384): (None, 1040.0), # the default invalid: the valid one
}


def _store_sweep(db, decode: bool = True):
    """A decode bucket (unless `decode` is false) and the prefill buckets above, stored as a sweep
    stores them."""
    m = model_preset("deepseek-v2-lite")       # 16 heads, the dims of plugin_support's model
    with ResultsStore(db) as store:
        run = store.add_run({"kind": "gpu", "device_name": DEVICE, "sm_count": 132, "capability": "9.0"})
        if decode:
            wid = store.workload_id(workload_for(m, 1, 8, 4096), 0, 0)
            store.add_trial(run, wid, Candidate.parse("flashinfer/fa3/p64"), "ok",
                            {"kernel_us": _samples(20.0)}, is_default=True)
        for (causal, q, kv), (fa3, fa2) in PREFILL_TIMES.items():
            w = prefill_workload(m, 1, causal, q, kv)
            pid = store.workload_id(w, w.bytes(), w.flops())
            for backend, t in (("fa3", fa3), ("fa2", fa2)):
                c = Candidate("flashinfer_prefill", backend, 1)
                if t is None:
                    store.add_trial(run, pid, c, "invalid", invalid_reason="runtime",
                                    message="illegal instruction", is_default=backend == "fa3")
                else:
                    store.add_trial(run, pid, c, "ok", {"kernel_us": _samples(t)},
                                    is_default=backend == "fa3", sweep="prefill")
    return m


def test_emit_writes_the_prefill_section_by_the_decode_rule(tmp_path):
    from mla_tune.tune.emit import config_summary, emit_config
    db = tmp_path / "results.db"
    m = _store_sweep(db)
    with ResultsStore(db, create=False) as store:
        path = emit_config(store, tmp_path / "configs")
    cfg = tc.read_tuned_config(path)
    (entry,) = cfg.models
    assert entry.dims == decisions.model_key(16, 512, 64, "bfloat16") and entry.model == m.name
    got = {(p.causal, p.query_tokens, p.kv_len): (p.backend, p.significant) for p in entry.prefill}
    assert got == {(True, 256, 256): ("fa3", False), (True, 256, 64): ("fa2", True),
                   (True, 2048, 2048): ("fa3", False), (False, 256, 16384): ("fa2", True),
                   (False, 2048, 16384): ("fa2", False)}
    assert cfg.provenance["prefill_trials"] == 10
    assert any("5 prefill buckets" in line for line in config_summary(cfg))
    # decode stayed what it was: the one decode bucket, fa3
    assert [b.families["flashinfer"].params for b in entry.buckets] == [{"backend": "fa3"}]


def test_prefill_without_a_decode_entry_is_noted_not_written(tmp_path):
    from mla_tune.tune.emit import emit_config
    db = tmp_path / "results.db"
    _store_sweep(db)
    with ResultsStore(db) as store:          # prefill trials of another head count
        run = store.add_run({"kind": "gpu", "device_name": DEVICE})
        w = prefill_workload(model_preset("deepseek-v3"), 1, True, 256)
        pid = store.workload_id(w, 0, 0)
        store.add_trial(run, pid, Candidate("flashinfer_prefill", "fa3", 1), "ok",
                        {"kernel_us": _samples(20.0)}, is_default=True)
    with ResultsStore(db, create=False) as store:
        cfg = tc.read_tuned_config(emit_config(store, tmp_path / "configs"))
    assert len(cfg.models) == 1 and cfg.models[0].dims.num_heads == 16
    assert any("prefill measured for H128" in n for n in cfg.provenance["notes"])


@pytest.mark.vllm
def test_what_emit_writes_is_what_the_plugin_plans(tmp_path, monkeypatch):
    """The contract: the emitted file, loaded by the plugin as vLLM would (device file in the
    config folder, model key from the vLLM config), plans every stored bucket's chosen backend
    for a plan of that bucket's shape, the new tokens and a context chunk alike."""
    import vllm_metax.backend as backend_pkg
    import vllm_metax.backend.flashinfer_prefill as fp
    import vllm_metax.ops.flashinfer_prefill as op
    import vllm_metax.platform as P
    from mla_tune.tune.emit import emit_config
    from vllm_metax.core import device as device_mod
    from prefill_support import prefill_metadata

    db = tmp_path / "results.db"
    _store_sweep(db)
    with ResultsStore(db, create=False) as store:
        path = emit_config(store, tmp_path / "configs")
    ps.ensure_metax_platform()
    for mod in (device_mod, backend_pkg, P):
        monkeypatch.setattr(mod, "detect_device", lambda: H200)
    RecordingRaggedWrapper.instances, RecordingRaggedWrapper.refuse = [], set()
    monkeypatch.setattr(op, "ragged_wrapper_cls", lambda: RecordingRaggedWrapper)
    monkeypatch.setattr(fp, "_workspace", lambda device: torch.empty(16, dtype=torch.uint8))
    monkeypatch.setenv(tc.FOLDER_ENV, str(path.parent))
    tc.clear_cache()
    try:
        cfg = ps.make_vllm_config(tmp_path / "model", block_size=64)
        b = fp.FlashInferMLAPrefillBackend(num_heads=16, scale=ps.softmax_scale(), kv_lora_rank=512,
                                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                           vllm_config=cfg)
        assert b.entry is not None
        written = json.loads(path.read_text())["models"][0]["prefill"]["buckets"]
        assert len(written) == len(PREFILL_TIMES)
        for wb in written:
            q, kv, causal = wb["query_tokens"], wb["kv_len"], wb["causal"]
            if causal:                 # q tokens as q / kv requests of kv tokens each
                md = prefill_metadata([kv] * (q // kv), "cpu")
                b.prepare_metadata(md)
                assert b._main.wrapper.backend == wb["params"]["backend"], wb
            else:                      # one request's q new tokens against kv context tokens
                md = prefill_metadata([q], "cpu", chunk_kv_lens=[kv])
                b.prepare_metadata(md)
                assert b._chunks[0].wrapper.backend == wb["params"]["backend"], wb
    finally:
        tc.clear_cache()


def test_show_prints_the_prefill_section_and_merge_carries_prefill_trials(tmp_path):
    from mla_tune.cli import app
    from mla_tune.store.merge import merge_into
    from mla_tune.tune.emit import emit_config
    db = tmp_path / "results.db"
    _store_sweep(db)
    with ResultsStore(db, create=False) as store:
        path = emit_config(store, tmp_path / "configs")
    r = CliRunner().invoke(app, ["show", str(path), "--format", "markdown"])
    assert r.exit_code == 0, r.output
    assert "MLA prefill backend per plan" in r.output and "context chunk" in r.output
    merged = tmp_path / "merged.db"
    merge_into(merged, [db])
    merge_into(merged, [db])                 # idempotent: nothing twice
    with ResultsStore(merged, create=False) as store:
        assert len(store.trials(prefill=True)) == 10 and len(store.trials()) == 1


def test_report_shows_the_prefill_buckets_and_their_verdicts(tmp_path):
    """`mla-tune report` shows what prefill-sweep measured: the table lists every bucket's time
    per backend value and what emit serves (the one-screen summary: only the winners), JSON has
    the same verdicts as emit, CSV a line per prefill trial beside the decode ones."""
    import csv
    import io
    from mla_tune.cli import app
    db = tmp_path / "results.db"
    _store_sweep(db)
    run = CliRunner().invoke(app, ["report", "--db", str(db), "--format", "json"])
    assert run.exit_code == 0, run.output
    rep = json.loads(run.stdout)
    got = {(p["causal"], p["query_tokens"], p["kv_len"]): (p["chosen"], p["significant"])
           for p in rep["prefill"]}
    assert got == {(True, 256, 256): ("fa3", False), (True, 256, 64): ("fa2", True),
                   (True, 2048, 2048): ("fa3", False), (False, 256, 16384): ("fa2", True),
                   (False, 2048, 16384): ("fa2", False)}
    assert all(set(p["times_us"]) | set(p["invalid"]) == {"fa2", "fa3"} for p in rep["prefill"])
    (bad,) = [p for p in rep["prefill"] if p["invalid"]]
    assert (bad["query_tokens"], bad["invalid"]) == (2048, {"fa3": "runtime"})
    rows = list(csv.DictReader(io.StringIO(
        CliRunner().invoke(app, ["report", "--db", str(db), "--format", "csv"]).stdout)))
    pre = [r for r in rows if r["family"] == "flashinfer_prefill"]
    assert len(pre) == 10 and {r["ragged"] for r in pre} == {"prefill-causal", "prefill-context"}
    assert len(rows) > len(pre)                       # the decode bucket's lines are there too
    summary = CliRunner().invoke(app, ["report", "--db", str(db), "--format", "markdown"]).stdout
    full = CliRunner().invoke(app, ["report", "--db", str(db), "--format", "markdown",
                                    "--full"]).stdout
    assert "MLA prefill backend" in summary and "5 prefill buckets; 3 keep the device default" in summary
    # the backend served in each row's `served` cell (the header names each backend once too)
    assert summary.count("| fa2 |") - 1 == 2 and full.count("| fa3 |") - 1 == 2
    assert full.count("| fa2 |") - 1 == 3


def test_a_db_of_the_prefill_sweep_alone_reports_and_refuses_emit(tmp_path):
    """`mla-tune prefill-sweep --db new.db` then `mla-tune report --db new.db` (how the H100's
    prefill sweep came back from the device): the report shows the prefill section; emit, which
    needs decode buckets, says so in one line and writes nothing."""
    from mla_tune.cli import app
    db = tmp_path / "prefill.db"
    _store_sweep(db, decode=False)
    run = CliRunner().invoke(app, ["report", "--db", str(db), "--format", "json"])
    assert run.exit_code == 0, run.output
    rep = json.loads(run.stdout)
    assert rep["devices"] == [] and len(rep["prefill"]) == 5
    for fmt in ("table", "markdown", "csv"):
        out = CliRunner().invoke(app, ["report", "--db", str(db), "--format", fmt])
        assert out.exit_code == 0 and "Traceback" not in out.output, out.output
    assert "5 prefill buckets; 3 keep the device default" in CliRunner().invoke(
        app, ["report", "--db", str(db), "--format", "markdown"]).stdout
    out = CliRunner().invoke(app, ["emit", "--db", str(db), "--out", str(tmp_path / "cfg")])
    assert out.exit_code == 2 and "prefill trials only" in out.output
    assert not (tmp_path / "cfg").exists() or not list((tmp_path / "cfg").iterdir())
    # a filter that matches nothing still names what the DB holds
    out = CliRunner().invoke(app, ["report", "--db", str(db), "--device", "NVIDIA B200"])
    assert out.exit_code == 2 and "prefill trials only" in out.output
