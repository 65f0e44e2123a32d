"""A tuned config served under another profile than it was tuned in (real vllm==0.33.0, CPU):
an NVIDIA-profile config on a MetaX device, or a metax-profile config on an NVIDIA GPU, is one
warning naming both profiles, and each bucket naming something the device cannot run is served
with the device default; nothing crashes. And TRITON_MLA's launch variant, tuned or the profile's
default, reaches the kernel call."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import plugin_support as ps
from vllm_metax.core import profile
from vllm_metax.core import tuned_config as tc
from vllm_metax.core.device import DeviceInfo

pytestmark = pytest.mark.vllm

PAGE = 64
METAX = DeviceInfo("MetaX C500", "pymxsml", True, 104, (8, 0))
HOPPER = DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0))
DIMS = tc.ModelDims(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM, "bfloat16", "bfloat16")
SPLIT_T32 = {"backend": "triton", "num_splits": 16, "partial": "bfloat16", "pipe": "t32x4"}


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    return ps.make_vllm_config(tmp_path_factory.mktemp("model"), block_size=PAGE)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)
    tc.clear_cache()
    yield
    tc.clear_cache()


def _write(tmp_path, monkeypatch, device, tuned_profile, buckets, order=("FLASHINFER_MLA", "TRITON_MLA")):
    entry = tc.ModelEntry(DIMS, PAGE, list(order), buckets)
    tc.write_tuned_config(tc.TunedConfig(device, {"profile": tuned_profile}, [entry]), tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()


def _decode(builder, seq_lens):
    return ps.build_decode(builder, seq_lens, PAGE)[0]


def _mismatch_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and "profile" in r.getMessage() and "tuned under" in r.getMessage()]


def test_an_nvidia_config_on_a_metax_device(base_config, tmp_path, monkeypatch, caplog):
    """fa3 (no FlashInfer fa3 on MetaX) and a TMA split pipe are served with the device default:
    FlashInfer fa2; the split bucket the NVIDIA sweep won runs FlashInfer too."""
    import vllm_metax.backend.triton_mla as tm
    ps.install_recording_plugin(monkeypatch, METAX, tm)
    buckets = [tc.Bucket(1, 4096, 1, {"split": tc.FamilyChoice(SPLIT_T32, 10.0),
                                      "flashinfer": tc.FamilyChoice({"backend": "fa3"}, 20.0)}, "split"),
               tc.Bucket(8, 1024, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa3"}, 15.0),
                                      "triton": tc.FamilyChoice({"num_kv_splits": 8}, 40.0)}, "flashinfer")]
    _write(tmp_path, monkeypatch, METAX.name, "nvidia", buckets)
    with caplog.at_level(logging.INFO):
        builder = ps.make_builder(base_config)
        ps.make_builder(base_config)                       # another layer group: no new warning
        steps = [_decode(builder, lens) for lens in ([4000], [1000] * 8)]
        launch = tm.TunedSplits.load(DIMS, METAX.name).launch(8, 1024)
    said = _mismatch_warnings(caplog)
    assert len(said) == 1, said
    assert "'nvidia' profile" in said[0] and "'metax' profile" in said[0]
    assert [s.backend for s in steps] == ["fa2", "fa2"]
    assert builder.choice.split_choices() == []           # t32x4 never made on MetaX
    info = [r.getMessage() for r in caplog.records if "cannot run are served" in r.getMessage()]
    assert len(info) == 1 and "3 bucket choices" in info[0] and "runs fa2 only (2 buckets)" in info[0]
    # the untuned Triton launch on MetaX is the vendor's; a bucket without a variant is vLLM's
    assert launch == "vllm" and tm.TunedSplits(None).launch(1, 1) == "metax"


def test_a_metax_config_on_an_nvidia_gpu(base_config, tmp_path, monkeypatch, caplog):
    """Everything of a metax config runs on Hopper (fa2, the vendor's Triton launch): served as
    tuned, with the one warning."""
    import vllm_metax.backend.triton_mla as tm
    ps.install_recording_plugin(monkeypatch, HOPPER, tm)
    buckets = [tc.Bucket(1, 4096, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa2"}, 20.0),
                                      "triton": tc.FamilyChoice({"num_kv_splits": 16, "variant": "metax"}, 30.0)},
                         "flashinfer")]
    _write(tmp_path, monkeypatch, HOPPER.name, "metax", buckets, order=("TRITON_MLA", "FLASHINFER_MLA"))
    with caplog.at_level(logging.INFO):
        builder = ps.make_builder(base_config)
        step = _decode(builder, [4000])
        tuned = tm.TunedSplits.load(DIMS, HOPPER.name)
    said = _mismatch_warnings(caplog)
    assert len(said) == 1 and "'metax' profile" in said[0] and "'nvidia' profile" in said[0]
    assert step.backend == "fa2"
    assert (tuned.choose(1, 4096), tuned.launch(1, 4096)) == (16, "metax")
    assert tm.TunedSplits(None).launch(1, 1) == "vllm"        # untuned on NVIDIA: vLLM's launch


def test_the_triton_builder_records_the_buckets_launch(tmp_path, monkeypatch):
    import vllm_metax.backend.triton_mla as tm
    from vllm_metax.core import device as device_mod
    monkeypatch.setattr(device_mod, "detect_device", lambda: HOPPER)
    buckets = [tc.Bucket(1, 1024, 1, {"triton": tc.FamilyChoice({"num_kv_splits": 4, "variant": "metax"})}),
               tc.Bucket(1, 16384, 1, {"triton": tc.FamilyChoice({"num_kv_splits": 32})})]
    _write(tmp_path, monkeypatch, HOPPER.name, "nvidia", buckets, order=("TRITON_MLA",))
    builder = object.__new__(tm.MetaxTritonMLAMetadataBuilder)
    builder.tuned_splits = tm.TunedSplits.load(DIMS, HOPPER.name)
    builder._common = None
    builder.dcp_world_size = 1

    def build(length):
        return builder._build_decode(
            block_table_tensor=torch.zeros(1, 4, dtype=torch.int32),
            seq_lens_device=torch.tensor([length], dtype=torch.int32), max_seq_len=length,
            query_start_loc_cpu=torch.tensor([0, 1], dtype=torch.int32),
            query_start_loc_device=torch.tensor([0, 1], dtype=torch.int32),
            num_decode_tokens=1, max_query_len=1, dcp_tot_seq_lens_device=None)

    assert (build(1000).num_kv_splits, build(1000).variant) == (4, "metax")
    assert (build(16000).num_kv_splits, build(16000).variant) == (32, "vllm")


def test_the_impl_launches_the_metadatas_variant(monkeypatch):
    """forward_mqa (vLLM's body) calls the `decode_attention_fwd` of vLLM's TRITON_MLA module,
    which the plugin routes to the vendor's launch for the call's variant only."""
    import vllm_metax.ops.triton_launch as tl
    import vllm_metax.backend.triton_mla as tm
    seen = []

    def vendor(*args, variant, **kw):
        seen.append((variant, args[8], tuple(args[7].shape), kw.get("is_mla")))

    monkeypatch.setattr(tl, "decode_attention_fwd", vendor)
    impl = object.__new__(tm.MetaxTritonMLAImpl)
    impl.kv_lora_rank, impl._sm_count, impl.scale, impl.dcp_world_size = 512, 132, 0.07, 1
    decode = tm.MetaxTritonMLADecodeMetadata(
        block_table=torch.zeros(2, 8, dtype=torch.int32), seq_lens=torch.full((2,), 1024, dtype=torch.int32),
        dcp_tot_seq_lens=None, num_kv_splits=8, variant="metax")
    md = SimpleNamespace(decode=decode, max_seq_len=1024, causal=True)
    o, _ = impl.forward_mqa(torch.zeros(2, 16, 576, dtype=torch.bfloat16),
                            torch.zeros(4, 64, 576, dtype=torch.bfloat16), md,
                            SimpleNamespace(_k_scale=torch.ones(())))
    assert o.shape == (2, 16, 512)
    assert seen == [("metax", 8, (2, 16, 8, 513), True)]
    assert tm._VARIANT.get() == "vllm"                        # nothing leaks past the call


def test_an_entry_of_one_launch_runs_it_everywhere_even_with_vllms_split_rule(tmp_path, monkeypatch):
    import vllm_metax.backend.triton_mla as tm
    from vllm_metax.core import device as device_mod
    monkeypatch.setattr(device_mod, "detect_device", lambda: HOPPER)
    rule = {"num_kv_splits": 2, "rule": "vllm", "variant": "metax"}
    _write(tmp_path, monkeypatch, HOPPER.name, "metax", [tc.Bucket(1, 1024, 1, {"triton": tc.FamilyChoice(rule)})],
           order=("TRITON_MLA",))
    tuned = tm.TunedSplits.load(DIMS, HOPPER.name)
    assert tuned.max_splits is None                          # vLLM's split rule everywhere
    assert tuned.launch(64, 100_000) == tuned.launch(1, 1024) == "metax"
