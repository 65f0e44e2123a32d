"""The target profile on the tuner's side: each family's search space limited by it, the sweep
planning and recording it, the results DB selecting by it, and the emitted config naming it
(`mla-tune sweep --profile`, `mla-tune emit --profile`). No GPU: spaces, plans and stored rows."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mla_tune.cli import app
from mla_tune.families import Candidate, CandidateInvalid, get_family
from mla_tune.problem.workload import Workload, model_preset, workload_for
from mla_tune.problem.roofline import workload_bytes, workload_flops
from mla_tune.store.results import ResultsStore
from mla_tune.store.selection import TrialFilter, profile_clause, run_profile
from mla_tune.tune import choose as choosing
from mla_tune.tune.emit import EmitError, build_tuned_config
from results_fixture import H200, METAX, build_fixture_db
from vllm_metax.core import profile
from vllm_metax.core import tuned_config as tc

V3 = model_preset("deepseek-v3")
runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture(autouse=True)
def _no_profile_variable(monkeypatch):
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)


# ---------------------------------------------------------------- each family's space

def test_families_take_the_profile_through_the_registry():
    assert get_family("split", "metax").profile.name == "metax"
    assert get_family("triton", "metax").profile.name == "metax"
    assert get_family("flashinfer", "metax").profile.name == "metax"
    assert get_family("split").profile.name == "nvidia"          # the active one: this CPU host
    assert get_family("reference", "metax").family == "reference"   # a family without the knob


def test_flashinfer_under_metax_is_fa2_through_the_flat_api_without_chunking(monkeypatch):
    from mla_tune.families import flashinfer as fam
    from vllm_metax.ops import flashinfer_mla as op
    monkeypatch.setattr(op, "concrete_backends", lambda: ("fa2", "fa3", "cutlass"))
    w = workload_for(V3, 8, 4, 1024)
    metax = fam.FlashInferFamily(profile="metax")
    assert metax.api == op.API_FLAT
    assert metax.backends() == ("fa2",)
    assert [c.key for c in metax.space(w, [16, 64])] == ["flashinfer/fa2/p16", "flashinfer/fa2/p64"]
    assert metax.default_candidate(w, 64).key == "flashinfer/fa2/p64"
    with pytest.raises(CandidateInvalid) as e:
        metax.prepare(w, Candidate("flashinfer", "fa3", 64), problem=None)
    assert e.value.reason == "unsupported" and "runs fa2 only" in e.value.message
    assert "profile metax" in e.value.message


def test_split_under_metax_offers_the_pointer_kernels_pipe_only():
    w = workload_for(V3, 8, 1, 1024)
    pipes = {c.params.get("pipe", "t64") for c in get_family("split", "nvidia").space(w, [64])}
    assert {"t64", "t32x4"} <= pipes
    metax = get_family("split", "metax")
    assert {c.params.get("pipe", "t64") for c in metax.space(w, [64])} == {"t64"}
    with pytest.raises(CandidateInvalid, match="tensor-memory accelerator"):
        metax.prepare(w, Candidate("split", "triton", 64, {"num_splits": 8, "partial": "bfloat16",
                                                           "pipe": "t32x4"}), problem=None)


def test_triton_under_metax_adds_the_vendor_launch_and_makes_it_the_default(monkeypatch):
    from mla_tune.families import triton_mla as fam
    monkeypatch.setattr(fam, "_sm_count", lambda: 132)
    monkeypatch.setattr(fam, "vllm_num_kv_splits", lambda n, sm=None: 2)
    w = Workload(16, 512, 64, 192 ** -0.5, 2, 2048)
    nv, mx = fam.TritonMLAFamily("nvidia"), fam.TritonMLAFamily("metax")
    assert {c.params.get("variant") for c in nv.space(w, [64])} == {None}
    space = mx.space(w, [64])
    assert {c.params.get("variant") for c in space} == {None, "metax"}
    assert len(space) == 2 * len(nv.space(w, [64]))
    d = mx.default_candidate(w, 64)
    assert d.key == "triton/triton/p64/num_kv_splits=2,rule=vllm,variant=metax" and d in space
    assert nv.default_candidate(w, 64).key == "triton/triton/p64/num_kv_splits=2,rule=vllm"
    # the candidate the sweep stores is a config the plugin reads back with its launch
    from vllm_metax.core import choices
    assert choices.candidate_choice("triton", d.backend, d.params, d.key).variant == "metax"


def test_the_sweep_resolves_the_profiles_families_and_skips_what_its_target_lacks():
    from mla_tune.tune.sweep.plan import resolve_families
    _, skipped = resolve_families(["fa3_mla", "reference"], "cpu", "metax")
    assert "does not run fa3_mla" in skipped["fa3_mla"]
    available, skipped = resolve_families(None, "cuda", "metax")
    assert sorted({**available, **skipped}) == sorted(profile.PROFILES["metax"].sweep_families)


# ---------------------------------------------------------------- the sweep records it

def test_the_plan_and_the_run_record_carry_the_profile(tmp_path):
    from mla_tune.measure.environment import capture_environment
    from mla_tune.tune.sweep.request import SweepRequest
    from mla_tune.tune.sweep.plan import plan_sweep
    cfg = SweepRequest(batches="1", contexts="256", tp=[8], device="cpu",
                       db=tmp_path / "r.db", profile="metax").config()
    plan, _ = plan_sweep(cfg)
    assert plan.profile == "metax"
    assert capture_environment("cpu-reference", "", "metax")["profile"] == "metax"
    assert capture_environment("cpu-reference")["profile"] == "nvidia"


def test_sweep_dry_run_takes_the_profile_and_refuses_an_unknown_one(tmp_path):
    args = ["sweep", "--dry-run", "--db", str(tmp_path / "r.db"), "--batches", "1", "--contexts", "256"]
    assert runner.invoke(app, args + ["--profile", "metax"]).exit_code == 0
    bad = runner.invoke(app, args + ["--profile", "amd"])
    assert bad.exit_code == 2 and "amd" in bad.output


# ---------------------------------------------------------------- the store selects by it

def _two_profile_db(path):
    """The fixture DB plus a run of the H200 measured under the metax profile."""
    fx = build_fixture_db(path)
    with ResultsStore(path) as store:
        run = store.add_run({"kind": "gpu", "device_name": H200, "sm_count": 132, "profile": "metax"})
        for b in (1, 8):
            for c in (1024, 4096):
                wl = workload_for(V3, 8, b, c)
                wid = store.workload_id(wl, workload_bytes(wl), workload_flops(wl))
                for key, t in (("flashinfer/fa2/p64", 30.0), ("flashmla/flashmla/p64", 20.0)):
                    store.add_trial(run, wid, Candidate.parse(key), "ok",
                                    {"kernel_us": [t * (1 + i / 100) for i in range(12)]},
                                    is_default=key.startswith("flashinfer"))
    return fx, run


def test_runs_before_profiles_take_the_profile_their_device_implies(tmp_path):
    fx, metax_run = _two_profile_db(tmp_path / "r.db")
    assert run_profile({"device_name": METAX}) == "metax"
    assert run_profile({"device_name": H200}) == "nvidia"
    assert run_profile({"device_name": H200, "profile": "metax"}) == "metax"
    with ResultsStore(fx.path) as store:
        def runs_of(name):
            return {r["run_id"] for r in store.trials(*profile_clause(name))}
        assert runs_of("metax") == {fx.runs["metax"], metax_run}
        assert runs_of("nvidia") == {fx.runs["gpu"], fx.runs["gpu2"], fx.runs["cpu"]}


def test_emit_names_the_profile_and_refuses_to_mix_two(tmp_path):
    fx, metax_run = _two_profile_db(tmp_path / "r.db")
    with ResultsStore(fx.path) as store:
        with pytest.raises(EmitError, match=r"several profiles \(metax, nvidia\): name one with --profile"):
            build_tuned_config(store, TrialFilter(H200))
        nv = build_tuned_config(store, TrialFilter(H200, profile="nvidia"))
        mx = build_tuned_config(store, TrialFilter(H200, profile="metax"))
        metax_device = build_tuned_config(store, TrialFilter(METAX))
    assert nv.provenance["profile"] == "nvidia" and fx.runs["gpu"] in nv.provenance["runs"]
    assert mx.provenance["profile"] == "metax" and mx.provenance["runs"] == [metax_run]
    assert metax_device.provenance["profile"] == "metax"          # a legacy MetaX run
    (e,) = mx.models
    # FlashMLA measured fastest at page 64: first in the backend order, a family of each bucket
    assert e.backend_order == ["FLASHMLA", "FLASHINFER_MLA"] and e.page_size == 64
    assert all(b.best_family == "flashmla" and "flashmla" in b.families for b in e.buckets)
    assert tc.parse_tuned_config(mx.to_json(), "x").models[0].backend_order[0] == "FLASHMLA"


def test_emit_cli_takes_the_profile(tmp_path):
    fx, _ = _two_profile_db(tmp_path / "r.db")
    out = tmp_path / "configs"
    res = runner.invoke(app, ["emit", "--db", str(fx.path), "--device", H200, "--profile", "metax",
                              "--configs-dir", str(out)])
    assert res.exit_code == 0, res.output
    cfg = tc.read_tuned_config(out / "device_name=NVIDIA_H200.json")
    assert cfg.provenance["profile"] == "metax"
    res = runner.invoke(app, ["emit", "--db", str(fx.path), "--device", H200, "--configs-dir", str(out)])
    assert res.exit_code == 2 and "--profile" in res.output


def test_flashmla_is_in_the_backend_order_at_page_64_only():
    assert choosing.backend_order(("flashmla", "flashinfer", "split", "triton"), 64) == (
        "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA")
    assert choosing.backend_order(("flashmla", "flashinfer", "triton"), 16) == (
        "FLASHINFER_MLA", "TRITON_MLA")


def test_bench_measures_and_records_under_its_profile(tmp_path):
    from mla_tune.measure.trial import MeasureSettings
    from mla_tune.tune.bench import run_bench
    w = Workload(16, 512, 64, 192 ** -0.5, 1, 64)
    settings = MeasureSettings(device="cpu", samples=2, warmup=0, profile="metax")
    out = run_bench([Candidate.parse("reference/torch/p16")], [w], settings, 1, str(tmp_path / "b.db"), None)
    assert [r["status"] for r in out.rows] == ["ok"]
    with ResultsStore(tmp_path / "b.db") as store:
        assert [run_profile(r) for r in store.runs()] == ["metax"]
