"""`mla-tune doctor` through the CLI runner: what the plugin sees and would do, on this GPU-less
host and on a simulated MetaX host (a pymxsml stand-in reporting "MetaX C500")."""

from __future__ import annotations

import json
import sys
import types

import pytest
from typer.testing import CliRunner

import flashinfer_fakes
from mla_tune.cli import app
from vllm_metax.core import device as device_mod
from vllm_metax.core import tuned_config as tc

runner = CliRunner()
_detect_device = device_mod.detect_device


def _doctor(*args):
    prefix = ["doctor"] if len(app.registered_commands) > 1 else []
    return runner.invoke(app, prefix + list(args))


@pytest.fixture
def host(monkeypatch):
    """A host without a MetaX device, FlashInfer replaced by the keyword-API fake."""
    monkeypatch.delenv(device_mod.FORCE_ENV, raising=False)
    monkeypatch.delenv(tc.FOLDER_ENV, raising=False)
    monkeypatch.delenv(tc.STRICT_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "pymxsml", None)
    monkeypatch.setattr(device_mod, "_torch_props", lambda: (None, None))
    flashinfer_fakes.install(monkeypatch, flashinfer_fakes.keyword_module())
    _detect_device.cache_clear()
    tc.clear_cache()
    yield monkeypatch
    _detect_device.cache_clear()
    tc.clear_cache()


@pytest.fixture
def metax(host, tmp_path):
    mod = types.ModuleType("pymxsml")
    mod.mxSmlInit = lambda: None
    mod.mxSmlGetDeviceCount = lambda: 1
    mod.mxSmlGetDeviceInfo = lambda i: types.SimpleNamespace(deviceName=b"MetaX C500")
    host.setitem(sys.modules, "pymxsml", mod)
    _detect_device.cache_clear()
    split = {"flashinfer": tc.FamilyChoice({"backend": "fa2"}, time_us=30.0),
             "split": tc.FamilyChoice({"backend": "triton", "num_splits": 64, "partial": "bfloat16"},
                                      time_us=20.0)}
    entry = tc.ModelEntry(tc.ModelDims(16, 512, 64), 32, ["TRITON_MLA", "FLASHINFER_MLA"],
                          [tc.Bucket(8, 4096, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa2"})}, "flashinfer"),
                           tc.Bucket(1, 4096, 1, split, "split")],
                          "deepseek-v3", 8)
    tc.write_tuned_config(tc.TunedConfig("MetaX C500", {}, [entry]), tmp_path)
    host.setenv(tc.FOLDER_ENV, str(tmp_path))
    return tmp_path


def _json(res):
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_doctor_on_a_host_without_metax(host):
    rep = _json(_doctor("--format", "json"))
    assert rep["plugin"]["status"] == "no" and "VLLM_METAX_FORCE" in rep["plugin"]["detail"]
    assert rep["tuned_config"]["path"] is None
    assert "device_name=cpu.json" in rep["tuned_config"]["reason"]
    checks = {c["what"]: c for c in rep["checks"]}
    assert checks["flashinfer"]["status"] == "ok"
    assert checks["vLLM entry point"]["status"] == "ok"


def test_doctor_forced(host):
    host.setenv(device_mod.FORCE_ENV, "1")
    rep = _json(_doctor("--format", "json"))
    assert rep["plugin"]["status"] == "ok" and "forced" in rep["plugin"]["detail"]


def test_doctor_on_a_simulated_metax_host(metax):
    rep = _json(_doctor("--model", "deepseek-v3", "--tp", "8", "--format", "json"))
    assert rep["device"]["name"] == "MetaX C500" and rep["device"]["is_metax"]
    assert rep["plugin"]["status"] == "ok" and "MetaX C500" in rep["plugin"]["detail"]
    assert rep["tuned_config"]["path"] == str(metax / "device_name=MetaX_C500.json")
    assert rep["tuned_config"]["entries"][0]["page_size"] == 32
    assert (rep["tuned_config"]["entries"][0]["buckets"], rep["tuned_config"]["entries"][0]["split_buckets"]) == (2, 1)
    assert rep["tuned_config"]["entries"][0]["side_buckets"] == {"split-KV": 1, "FlashMLA": 0, "vLLM FA3": 0}
    # the tuned order decides for deepseek-v3 at TP 8 (16 heads per rank)
    assert [b["what"] for b in rep["attention_backends"]][:2] == ["TRITON_MLA", "FLASHINFER_MLA"]
    fi = {b["what"]: b for b in rep["flashinfer_backends"]}
    assert fi["fa2"]["status"] == "ok" and "default" in fi["fa2"]["detail"]
    assert fi["fa3"]["status"] == "no" and fi["auto"]["status"] == "no"
    # MetaX plans prefill with fa2 only: no fa3, no vLLM FA3
    prefill = {c["what"]: c for c in rep["checks"]}["MLA prefill"]
    assert prefill["status"] == "ok" and prefill["detail"].endswith("plans fa2 untuned; a tuned config may choose fa2")


def test_doctor_on_hopper_names_vllms_fa3_prefill_where_its_library_loads(host):
    from vllm_metax.core.device import DeviceInfo
    import vllm_metax.ops.fa3_mla as fa3_mla
    host.setattr(device_mod, "detect_device", lambda: DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0)))
    for loads, allowed in ((True, "fa3, fa2, vllm_fa3"), (False, "fa3, fa2")):
        host.setattr(fa3_mla, "fa3_available", lambda *a, loads=loads, **k: (loads, ""))
        rep = _json(_doctor("--format", "json"))
        detail = {c["what"]: c for c in rep["checks"]}["MLA prefill"]["detail"]
        assert detail.endswith(f"plans fa3 untuned; a tuned config may choose {allowed}"), detail


def test_doctor_table_and_markdown(metax):
    res = _doctor()
    assert res.exit_code == 0, res.output
    assert "MetaX C500" in res.output and "found in $VLLM_METAX_MLA_CONFIG_FOLDER" in res.output
    md = _doctor("--format", "markdown")
    assert md.exit_code == 0 and "| platform plugin | ok |" in md.output
    assert "device_name=MetaX_C500.json: found in" in md.output


def test_doctor_strict_mode_reports_a_bad_file_in_one_line(metax, monkeypatch):
    (metax / "device_name=MetaX_C500.json").write_text("{not json")
    rep = _json(_doctor("--format", "json"))
    assert rep["tuned_config"]["reason"].startswith("ignored (using defaults)")
    monkeypatch.setenv(tc.STRICT_ENV, "1")
    tc.clear_cache()
    res = _doctor()
    assert res.exit_code == 2
    assert "not valid JSON" in res.output and "Traceback" not in res.output


def test_doctor_unknown_model_is_a_user_error(host):
    res = _doctor("--model", "no-such-model")
    assert res.exit_code == 2 and "unknown model" in res.output


def test_doctor_shows_the_profile_and_a_config_tuned_under_another(metax, monkeypatch):
    from vllm_metax.core.profile import PROFILE_ENV
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    rep = _json(_doctor("--format", "json"))
    checks = {c["what"]: c for c in rep["checks"]}
    assert checks["profile"]["status"] == "ok" and checks["profile"]["detail"].startswith(
        "metax (detected: MetaX C500 is a MetaX device (via pymxsml))")
    # no config for the model: the profile's own order, FLASHMLA first
    assert [b["what"] for b in rep["attention_backends"]][0] == "FLASHMLA"
    cfg = tc.read_tuned_config(metax / "device_name=MetaX_C500.json")
    cfg.provenance["profile"] = "nvidia"
    tc.write_tuned_config(cfg, metax)
    monkeypatch.setenv(PROFILE_ENV, "metax")
    rep = _json(_doctor("--format", "json"))
    checks = {c["what"]: c for c in rep["checks"]}
    assert checks["profile"]["status"] == "warn"
    assert "'nvidia' profile" in checks["profile"]["detail"] and "$VLLM_METAX_PROFILE=metax" in checks["profile"]["detail"]
    assert rep["tuned_config"]["profile"] == "nvidia"
