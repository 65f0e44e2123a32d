"""The target profiles (vllm_metax.core.profile): each profile's decisions, which profile is active
(the variable, a bad value, device detection through a simulated pymxsml), what a profile cannot
serve, and the decisions that tuner and plugin take from it (FlashInfer backends, split pipes, the
split kernel's TMA, the MLA order, the Triton launch)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from vllm_metax.core import choices, decisions, device, profile, serving
from vllm_metax.ops import device_backends
from vllm_metax.core import tuned_config as tc
from vllm_metax.core.device import DeviceInfo
from vllm_metax.core.split_facts import PIPES

METAX_DEV = DeviceInfo("MetaX C500", "pymxsml", True, 104, (8, 0))
HOPPER = DeviceInfo("NVIDIA H100 80GB HBM3", "torch", False, 132, (9, 0))
AMPERE = DeviceInfo("NVIDIA A100", "torch", False, 108, (8, 0))


@pytest.fixture
def on(monkeypatch):
    """Pretend this process sees `dev` (vllm_metax.core.device.detect_device), no profile set."""
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)

    def use(dev):
        monkeypatch.setattr(device, "detect_device", lambda: dev)
    return use


# ---------------------------------------------------------------- the profiles' decisions

def test_the_metax_profile_limits_every_family_to_what_the_vendor_target_runs():
    m = profile.PROFILES["metax"]
    assert m.flashinfer_backends == ("fa2",) and m.flashinfer_api == "flat"
    # pipes without TMA or PDL, read from the kernel's own facts
    assert m.split_pipes == tuple(n for n, p in PIPES.items() if not p.group_pages and not p.pdl)
    assert m.split_pipes == ("t64",) and not m.split_tma
    assert m.triton_variants == ("vllm", "metax") and m.triton_default == "metax"
    assert choices.SPECS[choices.FLASHMLA].page.only == 64 and not choices.SPECS[choices.FLASHMLA].page.allows(16)
    assert m.mla_order[:2] == ("FLASHMLA", "TRITON_MLA")
    assert m.sweep_families[0] == "flashmla" and "fa3_mla" not in m.families


def test_the_nvidia_profile_limits_nothing_the_device_rule_allows():
    n = profile.PROFILES["nvidia"]
    assert n.flashinfer_backends is None and n.flashinfer_api is None
    assert n.split_pipes == choices.SPLIT_PIPES and n.split_tma
    assert n.triton_variants == ("vllm",) and n.triton_default == "vllm"
    assert n.mla_order == serving.DEFAULT_MLA_ORDER == ("FLASHINFER_MLA", "FLASHMLA", "TRITON_MLA")
    assert set(n.families) == set(choices.KNOBS)


def test_get_profile_refuses_an_unknown_name():
    assert profile.get_profile("metax") is profile.PROFILES["metax"]
    assert profile.get_profile(profile.PROFILES["nvidia"]).name == "nvidia"
    with pytest.raises(ValueError, match="unknown profile 'amd'; known: nvidia, metax"):
        profile.get_profile("amd")


# ---------------------------------------------------------------- which profile is active

def test_the_variable_decides(on, monkeypatch):
    on(HOPPER)
    monkeypatch.setenv(profile.PROFILE_ENV, "metax")
    prof, why = profile.profile_source()
    assert prof.name == "metax" and why == "$VLLM_METAX_PROFILE=metax"
    on(METAX_DEV)
    monkeypatch.setenv(profile.PROFILE_ENV, "NVIDIA")
    assert profile.active_profile().name == "nvidia"


def test_without_the_variable_the_device_decides(on):
    on(METAX_DEV)
    prof, why = profile.profile_source()
    assert prof.name == "metax" and "MetaX C500" in why and "pymxsml" in why
    on(HOPPER)
    assert profile.active_profile().name == "nvidia"


def test_a_bad_value_is_one_warning_then_detection(on, monkeypatch, caplog):
    on(METAX_DEV)
    monkeypatch.setenv(profile.PROFILE_ENV, "amd-mi300")
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_metax.core.profile"):
        assert profile.active_profile().name == "metax"
        assert profile.active_profile().name == "metax"
    said = [r.getMessage() for r in caplog.records if "amd-mi300" in r.getMessage()]
    assert len(said) == 1 and "nvidia, metax" in said[0] and "detecting the device" in said[0]


def _fake_pymxsml(name, count=1):
    mod = types.ModuleType("pymxsml")
    mod.mxSmlInit = lambda: None
    mod.mxSmlGetDeviceCount = lambda: count
    mod.mxSmlGetDeviceInfo = lambda i: types.SimpleNamespace(deviceName=name)
    return mod


@pytest.mark.parametrize("name", [b"MetaX C500", "MetaX C500 "])
def test_a_metax_device_found_through_pymxsml_is_the_metax_profile(monkeypatch, name):
    """The real detection (device.detect_device) with a simulated pymxsml: MetaX's management
    library answering one device; torch sees no GPU here."""
    monkeypatch.setitem(sys.modules, "pymxsml", _fake_pymxsml(name))
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)
    device.detect_device.cache_clear()
    try:
        dev = device.detect_device()
        assert (dev.name, dev.source, dev.is_metax) == ("MetaX C500", "pymxsml", True)
        prof, why = profile.profile_source()
        assert prof.name == "metax" and "via pymxsml" in why
        assert device_backends.device_flashinfer_backends().allowed == ("fa2",)
    finally:
        device.detect_device.cache_clear()


def test_pymxsml_without_a_device_is_not_metax(monkeypatch):
    monkeypatch.setitem(sys.modules, "pymxsml", _fake_pymxsml("MetaX C500", count=0))
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)
    device.detect_device.cache_clear()
    try:
        assert not device.detect_device().is_metax
        assert profile.active_profile().name == "nvidia"
    finally:
        device.detect_device.cache_clear()


# ---------------------------------------------------------------- decisions under a profile

def test_flashinfer_backends_are_the_device_rule_within_the_profile(on):
    on(HOPPER)
    assert device_backends.device_flashinfer_backends().allowed == ("fa3", "fa2")
    assert device_backends.device_flashinfer_backends().default == "fa3"
    metax = device_backends.device_flashinfer_backends("metax")
    assert metax.allowed == ("fa2",) and metax.default == "fa2"
    assert device_backends.device_prefill_backends("metax").allowed == ("fa2",)
    assert metax.serve(choices.FlashInferChoice("fa3")) == "fa2"      # the device default
    on(METAX_DEV)          # a MetaX device under a forced nvidia profile still runs fa2 only
    assert device_backends.device_flashinfer_backends("nvidia").allowed == ("fa2",)
    on(AMPERE)
    assert device_backends.device_flashinfer_backends("metax").allowed == ("fa2",)


def _bucket(pipe=None, split_us=10.0, fi_us=20.0):
    params = {"backend": "triton", "num_splits": 16, "partial": "bfloat16"}
    if pipe:
        params["pipe"] = pipe
    return tc.Bucket(1, 4096, 1, {"split": tc.FamilyChoice(params, split_us),
                                  "flashinfer": tc.FamilyChoice({"backend": "fa3"}, fi_us)}, "split")


def test_a_split_pipe_the_profile_cannot_run_is_not_served(on):
    on(HOPPER)
    assert decisions.split_serves(_bucket("t32x4")).pipe == "t32x4"
    assert decisions.split_serves(_bucket("t32x4"), "metax") is None           # FlashInfer decodes
    assert decisions.split_serves(_bucket("t64-pdl"), "metax") is None
    assert decisions.split_serves(_bucket(), "metax") == choices.SplitChoice(16, "bfloat16")
    on(METAX_DEV)                                                              # the active profile
    assert decisions.split_serves(_bucket("t32x4")) is None


def test_why_unservable_names_what_the_target_lacks():
    m, n = profile.PROFILES["metax"], profile.PROFILES["nvidia"]
    assert "runs fa2 only" in profile.why_unservable("flashinfer", {"backend": "fa3"}, m)
    assert profile.why_unservable("flashinfer", {"backend": "fa2", "kv_chunk": "x2"}, m) is None
    assert "tensor-memory accelerator" in profile.why_unservable(
        "split", {"backend": "triton", "num_splits": 8, "partial": "bfloat16", "pipe": "t32x4"}, m)
    assert profile.why_unservable("split", {"backend": "triton", "num_splits": 8, "partial": "bfloat16"},
                                  m) is None
    assert "does not run on the metax target" in profile.why_unservable("fa3_mla", {"num_splits": 0}, m)
    # vendor's Triton launch runs on NVIDIA too: a metax config's Triton choices stay servable
    assert profile.why_unservable("triton", {"num_kv_splits": 4, "variant": "metax"}, n) is None
    for fam, params in (("flashinfer", {"backend": "fa3"}), ("fa3_mla", {"num_splits": 0})):
        assert profile.why_unservable(fam, params, n) is None


def test_a_config_names_its_profile_and_a_mismatch_is_one_line():
    cfg = tc.TunedConfig("MetaX C500", {"profile": "nvidia"}, [])
    cfg.path = "configs/device_name=MetaX_C500.json"
    line = profile.config_mismatch(cfg, profile.PROFILES["metax"])
    assert "'nvidia' profile" in line and "'metax' profile" in line and cfg.path in line
    assert profile.config_mismatch(cfg, profile.PROFILES["nvidia"]) is None
    assert profile.config_mismatch(tc.TunedConfig("x", {}, []), profile.PROFILES["metax"]) is None


def test_unservable_choices_of_an_entry():
    entry = tc.ModelEntry(tc.ModelDims(16, 512, 64), 64, ["FLASHINFER_MLA"],
                          [_bucket("t32x4"), tc.Bucket(8, 1024, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa2"})})])
    found = profile.unservable_choices(entry, profile.PROFILES["metax"])
    assert [(b.batch_size, fam) for b, fam, _ in found] == [(1, "split"), (1, "flashinfer")]
    assert profile.unservable_choices(entry, profile.PROFILES["nvidia"]) == []
    assert profile.unservable_choices(None, profile.PROFILES["metax"]) == []


def test_the_mla_order_is_the_profiles_without_a_tuned_one(on):
    on(METAX_DEV)
    assert serving.mla_backend_order(None) == (["FLASHMLA", "TRITON_MLA", "FLASHINFER_MLA"],
                                               "default MLA order (metax profile)")
    order, why = serving.mla_backend_order(["FLASHINFER_MLA"])
    assert order == ["FLASHINFER_MLA", "FLASHMLA", "TRITON_MLA"] and why == "tuned config"
    assert serving.mla_backend_order(None, "nvidia")[0] == list(serving.DEFAULT_MLA_ORDER)


def test_the_split_kernel_never_takes_the_tma_kernel_under_the_metax_profile(on):
    from vllm_metax.ops import split_decode as sd
    on(HOPPER)
    assert sd.tma_supported("cpu") == (sd._TensorDescriptor is not None)   # the interpreter
    assert sd.tma_supported("cpu", "metax") is False
    with pytest.raises(ValueError, match="TMA kernel only"):
        sd.served(8, "bfloat16", 16, 64, 1, "cpu", pipe="t32x4", profile="metax")
    assert sd.served(8, "bfloat16", 16, 64, 1, "cpu", profile="metax").load == "gather"


# ---------------------------------------------------------------- the Triton launch knob

def test_the_triton_variant_is_a_knob_of_the_config_and_the_candidate():
    typed = choices.check_params("triton", {"num_kv_splits": 4, "variant": "metax"}, "b")
    assert typed == choices.TritonChoice(4, False, "metax")
    assert typed.to_params() == {"backend": "triton", "num_kv_splits": 4, "variant": "metax"}
    assert choices.TritonChoice(4).to_params() == {"backend": "triton", "num_kv_splits": 4}
    assert choices.family_choice("triton", {"num_kv_splits": 4, "rule": "vllm", "variant": "metax"}) \
        == choices.TritonChoice(4, True, "metax")
    assert choices.family_choice("triton", {"num_kv_splits": 4, "variant": "rocm"}) is None
    with pytest.raises(choices.ChoiceError, match="variant must be one of vllm, metax, got 'rocm'"):
        choices.check_params("triton", {"num_kv_splits": 4, "variant": "rocm"}, "b")
    with pytest.raises(choices.ChoiceError, match=r"variant=<vllm\|metax>"):
        choices.candidate_choice("triton", "triton", {"num_kv_splits": 4, "variant": "x"}, "c")


def test_the_vendor_launch_facts():
    from vllm_metax.core.triton_facts import LAUNCHES, head_tiles
    m = LAUNCHES["metax"]
    assert (m.block_n, m.num_stages, m.num_warps, m.named_head_split) == (16, 1, 4, False)
    assert head_tiles(m, 576, 512) == (512, 64) == head_tiles(None, 576, 512)
    assert head_tiles(None, 288, 256) == (256, 32)
    assert head_tiles(m, 320, 256) == (256, 64) and head_tiles(None, 320, 256) == (256, 64)
    assert head_tiles(m, 400, 320) == (512, 128)           # the general rule: powers of two


def test_vllms_fa3_is_not_served_on_the_metax_target(on):
    bucket = tc.Bucket(1, 4096, 1, {"fa3_mla": tc.FamilyChoice({"backend": "fa3", "num_splits": 0}, 10.0),
                                    "flashinfer": tc.FamilyChoice({"backend": "fa3"}, 12.0)}, "fa3_mla")
    on(HOPPER)
    assert decisions.fa3_serves(bucket) == choices.FA3Choice(0)
    assert decisions.fa3_serves(bucket, "metax") is None          # FlashInfer fa2 decodes it
    on(METAX_DEV)
    assert decisions.fa3_serves(bucket) is None
