"""mla_tune.tune.emit and `mla-tune emit`: results.db -> the tuned config the plugin reads."""

import datetime
from pathlib import Path
import json
import statistics

import pytest
from typer.testing import CliRunner

from mla_tune.tune import choose as choosing
from mla_tune.families.base import Candidate
from mla_tune.cli import app
from mla_tune.tune.emit import EmitError, build_tuned_config, emit_all, emit_config
from mla_tune.problem.workload import model_preset, workload_for
from mla_tune.store.selection import SelectionError, TrialFilter
from mla_tune.problem.roofline import workload_bytes, workload_flops
from mla_tune.store.results import ResultsStore
from results_fixture import BATCHES, CONTEXTS, H200, METAX, MODEL, TP, build_fixture_db
from vllm_metax.core import device as vdevice
from vllm_metax.core import tuned_config as tc

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture()
def fx(tmp_path):
    return build_fixture_db(tmp_path / "results.db")


def _median(fx, run, b, c, key):
    return statistics.median(fx.samples[fx.trials[(run, b, c, key)]])


def _detected(monkeypatch, name):
    info = vdevice.DeviceInfo(name, "torch" if name != "cpu" else "none", False, 132, (9, 0))
    monkeypatch.setattr(vdevice, "detect_device", lambda: info)


def test_h200_config_from_the_db(fx, tmp_path):
    with ResultsStore(fx.path) as s:
        path = emit_config(s, tmp_path / "configs", device="NVIDIA_H200")
    assert path.name == "device_name=NVIDIA_H200.json"
    cfg = tc.read_tuned_config(path)                 # the plugin's reader accepts it
    assert cfg.device_name == H200
    p = cfg.provenance
    assert p["device_name"] == H200 and p["sm_count"] == 132 and p["kind"] == "gpu"
    assert p["flashinfer"] == "0.7.2.post1" and p["torch"] == "2.11.0+cu130"
    assert p["runs"] == [fx.runs["gpu"], fx.runs["gpu2"]] and p["results_db"] == "results.db"
    assert p["date"][:10] == datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    (e,) = cfg.models
    assert e.dims == tc.ModelDims(16, 512, 64, "bfloat16", "bfloat16")
    assert (e.model, e.tp_size, e.page_size) == (MODEL, TP, 64)
    assert e.backend_order == ["FLASHINFER_MLA", "TRITON_MLA"] and "weighted total" in e.reason
    assert len(e.buckets) == len(BATCHES) * len(CONTEXTS) + 1
    for b in BATCHES:
        for c in CONTEXTS:
            hit = e.lookup(b, c)
            assert hit.exact and hit.in_range
            fi, tr = hit.bucket.families["flashinfer"], hit.bucket.families["triton"]
            assert hit.bucket.best_family == "flashinfer"
            assert fi.params == {"backend": "fa3"} and fi.significant
            assert fi.time_us == _median(fx, "gpu", b, c, "flashinfer/fa3/p64")
            assert fi.default_time_us == _median(fx, "gpu", b, c, "flashinfer/auto/p64")
            assert tr.params["num_kv_splits"] == 16 and tr.significant
    far = e.lookup(512, 131072)
    assert not far.in_range and (far.bucket.batch_size, far.bucket.context_len) == (64, 4096)


def test_default_stays_without_a_significant_gain(fx, tmp_path):
    with ResultsStore(fx.path) as s:
        cfg = tc.read_tuned_config(emit_config(s, tmp_path, device="MetaX C500"))
    (b,) = cfg.models[0].buckets
    fi = b.families["flashinfer"]
    assert fi.params == {"backend": "auto"} and not fi.significant and fi.gain == 1.0
    assert cfg.models[0].backend_order == ["FLASHINFER_MLA"]


def test_device_choice_when_the_db_holds_several(fx, tmp_path, monkeypatch):
    _detected(monkeypatch, "NVIDIA B200")
    with ResultsStore(fx.path) as s:
        with pytest.raises(EmitError, match="several devices .* --device"):
            emit_config(s, tmp_path)
        with pytest.raises(SelectionError, match="match device 'NVIDIA B200'; it holds devices"):
            emit_config(s, tmp_path, device="NVIDIA B200")
        _detected(monkeypatch, METAX)
        assert emit_config(s, tmp_path).name == "device_name=MetaX_C500.json"
        paths = emit_all(s, tmp_path / "all")
    assert sorted(p.name for p in paths) == ["device_name=MetaX_C500.json",
                                             "device_name=NVIDIA_H200.json", "device_name=cpu.json"]


def test_cpu_reference_config_is_valid_and_labelled(fx, tmp_path):
    with ResultsStore(fx.path) as s:
        cfg = tc.read_tuned_config(emit_config(s, tmp_path, device="cpu"))
    assert cfg.provenance["kind"] == "cpu-reference"
    assert any("CPU torch reference" in n for n in cfg.provenance["notes"])
    (e,) = cfg.models
    assert e.page_size == 64 and all(not b.families for b in e.buckets)   # no GPU family choices
    assert "not tuned" in e.reason


def test_filters_restrict_the_runs(fx, tmp_path):
    with ResultsStore(fx.path) as s:
        cfg = build_tuned_config(s, TrialFilter(device=H200, runs=(fx.runs["gpu2"],)))
    assert cfg.provenance["runs"] == [fx.runs["gpu2"]]
    assert [(b.batch_size, b.context_len) for b in cfg.models[0].buckets] == [(64, 4096)]


def test_the_sweeps_choice(fx, tmp_path):
    """The sweep hands over its Choice: with the store, the device's file keeps what earlier
    sweeps measured; without one, the choice is written as is."""
    with ResultsStore(fx.path) as s:
        rows = s.trials("r.device_name = ? and t.run_id = ?", [H200, fx.runs["gpu2"]])
        choice = choosing.choose(rows, device_name=H200, min_ratio=1.2)
        with_store = tc.read_tuned_config(emit_config(choice, tmp_path / "a", store=s))
    alone = tc.read_tuned_config(emit_config(choice, tmp_path / "b"))
    assert with_store.provenance["runs"] == [fx.runs["gpu"], fx.runs["gpu2"]]
    assert with_store.provenance["rules"]["min_ratio"] == 1.2
    assert len(with_store.models[0].buckets) == len(BATCHES) * len(CONTEXTS) + 1
    assert with_store.models[0].lookup(8, 4096).bucket.families["flashinfer"].params == {"backend": "fa3"}
    assert alone.provenance["runs"] == [] and len(alone.models[0].buckets) == 1


def test_one_entry_per_dims(fx, tmp_path):
    """uniform and lognormal lengths share dims: the config can hold one; the uniform one stays."""
    wl = workload_for(model_preset(MODEL), TP, 8, 4096, ragged="lognormal")
    with ResultsStore(fx.path) as s:
        wid = s.workload_id(wl, workload_bytes(wl), workload_flops(wl))
        s.add_trial(fx.runs["gpu"], wid, Candidate.parse("flashinfer/fa2/p16"), "ok",
                    {"kernel_us": [9.0, 9.1, 8.9]}, is_default=True)
        cfg = tc.read_tuned_config(emit_config(s, tmp_path, device=H200))
    (e,) = cfg.models
    assert e.page_size == 64
    assert any("lognormal" in n and "not written" in n for n in cfg.provenance["notes"])


def test_written_config_is_what_the_plugin_resolves(fx, tmp_path, monkeypatch):
    with ResultsStore(fx.path) as s:
        emit_config(s, tmp_path, device=H200)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    res = tc.resolve_tuned_config(H200)
    assert res.config is not None and res.config.models[0].page_size == 64


# ---------------------------------------------------------------- CLI

def test_cli_emit(fx, tmp_path, monkeypatch):
    _detected(monkeypatch, "cpu")
    out = tmp_path / "configs"
    res = runner.invoke(app, ["emit", "--db", str(fx.path), "--out", str(out), "--device", "NVIDIA H200"])
    assert res.exit_code == 0, res.output
    assert "device_name=NVIDIA_H200.json" in res.stdout and "page 64, FLASHINFER_MLA > TRITON_MLA" in res.stdout
    data = json.loads((out / "device_name=NVIDIA_H200.json").read_text())
    assert data["schema_version"] == tc.SCHEMA_VERSION
    res = runner.invoke(app, ["emit", "--db", str(fx.path), "--out", str(out), "--all-devices"])
    assert res.exit_code == 0, res.output
    assert len(list(out.glob("device_name=*.json"))) == 3
    res = runner.invoke(app, ["emit", "--db", str(fx.path), "--out", str(out)])   # this machine: cpu
    assert res.exit_code == 0 and "device_name=cpu.json" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--device", "NVIDIA B200"], "no trials"),
    (["--device", "cpu", "--all-devices"], "exclude each other"),
    (["--model", "kimi-k2"], "no trials"),
])
def test_cli_emit_bad_input(fx, tmp_path, args, message):
    res = runner.invoke(app, ["emit", "--db", str(fx.path), "--out", str(tmp_path / "c"), *args])
    assert res.exit_code == 2 and message in res.stderr
    assert res.stderr.strip().count("\n") == 0
    assert not (tmp_path / "c").exists()


def test_flashinfer_mla_ranks_by_what_its_decode_serves_per_bucket(tmp_path, monkeypatch):
    """The MetaX-profile sweep of the lent H100 (bench/results/metax_sweep_h100.db): FlashMLA alone
    has the smallest weighted total, but FLASHINFER_MLA's decode serves the split kernel at batch
    1-4 and FlashMLA where it wins, so FLASHINFER_MLA goes first (a FLASHMLA-first server would run
    FlashMLA in every bucket and lose the split kernel's 1.1-2.3x)."""
    import shutil
    from pathlib import Path

    from vllm_metax.core import choices, decisions
    monkeypatch.setenv("VLLM_METAX_PROFILE", "metax")
    db = tmp_path / "metax.db"
    shutil.copy(Path(__file__).resolve().parents[1] / "bench" / "results" / "metax_sweep_h100.db", db)
    with ResultsStore(db, create=False) as s:
        choice = choosing.choose_from_store(s)
        cfg = build_tuned_config(s)
    (m,) = [m for m in choice.models if m.ragged == "uniform"]
    assert m.backend_order[0] == "FLASHMLA"                  # the families' own ranking
    (entry,) = cfg.models
    assert entry.backend_order == ["FLASHINFER_MLA", "FLASHMLA", "TRITON_MLA"]
    assert "FLASHINFER_MLA ahead of FLASHMLA" in entry.reason
    served = [decisions.side_kernel(b, page_size=entry.page_size) for b in entry.buckets]
    kinds = {s[0] if s else choices.FLASHINFER for s in served}
    assert kinds == {choices.SPLIT, choices.FLASHMLA, choices.FLASHINFER}


def test_the_served_order_counts_the_side_kernels_of_the_target_profile_not_this_machines(
        tmp_path, monkeypatch):
    """A MetaX-target entry emitted on an NVIDIA host: vLLM's FA3 (which the metax target does not
    run) must not count in what FLASHINFER_MLA's decode serves, however fast it measured."""
    import dataclasses
    import shutil

    from mla_tune.tune.emit import _bucket, served_order
    monkeypatch.setenv("VLLM_METAX_PROFILE", "nvidia")           # this machine's profile
    db = tmp_path / "metax.db"
    shutil.copy(Path(__file__).resolve().parents[1] / "bench" / "results" / "metax_sweep_h100.db", db)
    with ResultsStore(db, create=False) as s:
        (m,) = [m for m in choosing.choose_from_store(s).models if m.ragged == "uniform"]
    buckets = [_bucket(b) for b in m.buckets]
    fast_fa3 = tc.FamilyChoice({"backend": "fa3", "num_splits": 0}, 1.0, 1.0, False)
    with_fa3 = [dataclasses.replace(b, families={**b.families, "fa3_mla": fast_fa3}) for b in buckets]
    assert served_order(m, with_fa3, "nvidia") != served_order(m, buckets, "nvidia")
    assert served_order(m, with_fa3, "metax") == served_order(m, buckets, "metax")
    assert "FLASHINFER_MLA ahead of FLASHMLA" in served_order(m, buckets, "metax")[1]


def test_an_order_flashinfer_mla_already_leads_is_kept(fx):
    from mla_tune.tune.emit import _bucket, served_order
    with ResultsStore(fx.path) as s:
        choice = choosing.choose_from_store(s, device_name="NVIDIA H200")
    led = [m for m in choice.models if m.backend_order and m.backend_order[0] == "FLASHINFER_MLA"]
    assert led
    for m in led:
        assert served_order(m, [_bucket(b) for b in m.buckets], "nvidia") == (list(m.backend_order), None)


@pytest.mark.parametrize("device, first", [("cpu", "FLASHINFER_MLA")])
def test_an_untuned_backend_order_is_the_profiles(fx, tmp_path, device, first):
    """With no vLLM attention-backend family measured, the entry's order is the target profile's
    untuned one (`Profile.mla_order`), not a listing of the schema's names."""
    from vllm_metax.core.profile import PROFILES
    with ResultsStore(fx.path) as s:
        (e,) = build_tuned_config(s, TrialFilter(device=device)).models
    assert e.backend_order == list(PROFILES["nvidia"].mla_order) and e.backend_order[0] == first


def test_a_metax_profile_choice_without_backend_families_puts_flashmla_first(fx):
    """A MetaX target's untuned order starts with FLASHMLA (the vendor plugin's first): the
    fallback of an entry whose sweep measured no attention-backend family follows it."""
    import dataclasses

    from mla_tune.tune.emit import model_entries
    from vllm_metax.core.profile import PROFILES
    with ResultsStore(fx.path) as s:
        choice = choosing.choose_from_store(s, device_name="cpu")
    assert choice.models and not any(m.backend_order for m in choice.models)
    for profile, order in (("metax", PROFILES["metax"].mla_order), ("nvidia", PROFILES["nvidia"].mla_order)):
        (e,) = model_entries(choice, [], profile)
        assert e.backend_order == list(order)
    assert model_entries(choice, [], "metax")[0].backend_order[0] == "FLASHMLA"
    metax = dataclasses.replace(choice, device_name="MetaX C500")   # no profile named: the device's
    assert model_entries(metax, [])[0].backend_order[0] == "FLASHMLA"


SHIPPED_CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("device_name=*.json"))


@pytest.mark.parametrize("shipped", SHIPPED_CONFIGS, ids=lambda p: p.stem)
def test_re_emitting_each_shipped_config_from_results_db_changes_nothing(shipped, tmp_path):
    """`mla-tune emit --db results.db --all-devices`, as the README says, rewrites every shipped
    config as it is (all of it: choices, reasons, provenance, the profile), but for the time it
    was written."""
    import shutil
    from cli_support import run_main
    shutil.copy(shipped.parent.parent / "results.db", tmp_path / "results.db")
    res = run_main(["emit", "--db", "results.db", "--all-devices", "--configs-dir", "out"],
                   cwd=tmp_path)
    assert res.code == 0, res.output
    old, new = json.loads(shipped.read_text()), json.loads((tmp_path / "out" / shipped.name).read_text())
    for cfg in (old, new):
        cfg["provenance"].pop("date")
    assert new == old
    assert new["provenance"]["profile"]
