"""MetaxPlatform with the real vllm==0.33.0 on a GPU-less host: attention-backend selection
(explicit, automatic, invalid), the order and KV block size a tuned config sets, and what the
platform tells vLLM about itself."""

from __future__ import annotations

import pytest
import torch

import plugin_support as ps
from vllm_metax.platform import FLASHINFER_MLA_CLASS, TRITON_MLA_CLASS
from vllm_metax.core import tuned_config as tc
from vllm_metax.core.device import FORCE_ENV, DeviceInfo

pytestmark = pytest.mark.vllm

H200 = DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0))
DIMS = tc.ModelDims(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM, "bfloat16", "bfloat16")


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    return ps.make_vllm_config(tmp_path_factory.mktemp("model"))


@pytest.fixture
def platform(monkeypatch):
    """MetaxPlatform on a pretend Hopper GPU with FlashInfer importable; fresh config cache."""
    import vllm_metax.backend as backend_pkg
    import vllm_metax.backend.flashinfer_mla as fb
    import vllm_metax.platform as P
    from vllm.platforms.interface import DeviceCapability
    from vllm_metax.core import device as device_mod

    ps.ensure_metax_platform()
    for mod in (device_mod, backend_pkg, P):
        monkeypatch.setattr(mod, "detect_device", lambda: H200)
    monkeypatch.setattr(P, "_device_capability", lambda device_id: DeviceCapability(9, 0))
    monkeypatch.setattr(fb, "flashinfer_available", lambda: (True, "stand-in"))
    monkeypatch.delenv(tc.FOLDER_ENV, raising=False)
    tc.clear_cache()
    yield P.MetaxPlatform
    tc.clear_cache()


def _selector(kv_cache_dtype="auto", **kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype,
                                   block_size=kw.pop("block_size", None), use_mla=True, **kw)


def _select(platform, vllm_config, backend=None, **kw):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with set_current_vllm_config(vllm_config):
        chosen = AttentionBackendEnum[backend] if backend else None
        return platform.get_attn_backend_cls(chosen, _selector(**kw), num_heads=ps.NUM_HEADS)


def _tuned(tmp_path, monkeypatch, order, page_size=64, dims=DIMS, device=H200.name):
    entry = tc.ModelEntry(dims, page_size, order, [tc.Bucket(8, 4096, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa2"})}, "flashinfer")])
    tc.write_tuned_config(tc.TunedConfig(device, {"test": True}, [entry]), tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()


# ---------------------------------------------------------------- selection

def test_flashinfer_mla_is_chosen_by_default(platform, base_config):
    # regression: an earlier branch returned before FLASHINFER_MLA was ever tried
    assert _select(platform, base_config) == FLASHINFER_MLA_CLASS


def test_explicit_valid_choice(platform, base_config):
    assert _select(platform, base_config, "FLASHINFER_MLA") == FLASHINFER_MLA_CLASS
    assert _select(platform, base_config, "TRITON_MLA") == TRITON_MLA_CLASS


def test_explicit_invalid_choice_raises_with_reasons(platform, base_config):
    with pytest.raises(ValueError, match="FLASHINFER_MLA.*kv_cache_dtype not supported"):
        _select(platform, base_config, "FLASHINFER_MLA", kv_cache_dtype="fp8")


def test_default_skips_an_invalid_flashinfer_mla_silently(platform, base_config):
    assert _select(platform, base_config, kv_cache_dtype="fp8") == TRITON_MLA_CLASS


def test_no_flashinfer_falls_through(platform, base_config, monkeypatch):
    import vllm_metax.backend.flashinfer_mla as fb

    monkeypatch.setattr(fb, "flashinfer_available", lambda: (False, "cannot import flashinfer.mla"))
    assert _select(platform, base_config) == TRITON_MLA_CLASS
    with pytest.raises(ValueError, match="cannot import flashinfer.mla"):
        _select(platform, base_config, "FLASHINFER_MLA")


@pytest.mark.parametrize("patch, reason", [
    (lambda mc, mp: mp.setattr(mc.hf_text_config, "attn_logit_softcapping", 30.0, raising=False),
     "logits soft-cap not supported"),
    (lambda mc, mp: mp.setattr(mc.hf_text_config, "alibi", True, raising=False), "alibi not supported"),
    (lambda mc, mp: mp.setattr(type(mc), "get_sliding_window", lambda self: 4096),
     "sliding window not supported"),
])
def test_model_features_refused_with_reasons(platform, base_config, monkeypatch, patch, reason):
    patch(base_config.model_config, monkeypatch)
    with pytest.raises(ValueError, match=reason):
        _select(platform, base_config, "FLASHINFER_MLA")
    assert _select(platform, base_config) == TRITON_MLA_CLASS


def test_sliding_window_flag_and_old_gpu_refused(platform, base_config, monkeypatch):
    from vllm.platforms.interface import DeviceCapability
    import vllm_metax.platform as P

    with pytest.raises(ValueError, match="sliding window not supported"):
        _select(platform, base_config, "FLASHINFER_MLA", has_sliding_window=True)
    monkeypatch.setattr(P, "_device_capability", lambda device_id: DeviceCapability(7, 5))
    with pytest.raises(ValueError, match="compute capability not supported"):
        _select(platform, base_config, "FLASHINFER_MLA")


def test_nothing_valid_raises_with_every_reason(platform, base_config):
    with pytest.raises(ValueError, match="No valid attention backend.*FLASHINFER_MLA.*TRITON_MLA"):
        _select(platform, base_config, kv_cache_dtype="fp8", has_sink=True)


def test_tuned_backend_order_decides(platform, base_config, tmp_path, monkeypatch):
    _tuned(tmp_path, monkeypatch, ["TRITON_MLA", "FLASHINFER_MLA"])
    assert _select(platform, base_config) == TRITON_MLA_CLASS
    from vllm.config import set_current_vllm_config
    with set_current_vllm_config(base_config):
        order, why = platform.attention_priorities(_selector(), ps.NUM_HEADS)
    assert [b.name for b in order][:3] == ["TRITON_MLA", "FLASHINFER_MLA", "FLASHMLA"]
    assert "tuned config" in why


def test_tuned_order_for_other_dims_does_not_apply(platform, base_config, tmp_path, monkeypatch):
    _tuned(tmp_path, monkeypatch, ["TRITON_MLA"], dims=tc.ModelDims(128, 512, 64))
    assert _select(platform, base_config) == FLASHINFER_MLA_CLASS


# ---------------------------------------------------------------- block size

def _fresh_config(base_config, block_size=None):
    from vllm.config import CacheConfig, VllmConfig

    return VllmConfig(model_config=base_config.model_config,
                      cache_config=CacheConfig(block_size=block_size))


def test_block_size_from_the_tuned_config(platform, base_config, tmp_path, monkeypatch):
    _tuned(tmp_path, monkeypatch, ["FLASHINFER_MLA"], page_size=64)
    vc = _fresh_config(base_config)                  # VllmConfig calls check_and_update_config
    assert vc.cache_config.block_size == 64 and not vc.cache_config.user_specified_block_size
    assert vc.parallel_config.worker_cls == "vllm_metax.worker.MetaxWorker"   # vLLM's, ops-checked
    # vLLM re-picks the size after model load when the user did not set one; it must stay 64
    from vllm_metax.backend.flashinfer_mla import FlashInferMLABackend
    assert platform._preferred_block_size_for_backends([FlashInferMLABackend], 16, vc) == 64


def test_a_conflicting_block_size_serves_untuned_with_one_warning(platform, base_config, tmp_path,
                                                                 monkeypatch, caplog):
    """--block-size other than the tuned page size: the user's size stays, and nothing of the
    entry (measured at another page size) is served: default backend order, one warning."""
    _tuned(tmp_path, monkeypatch, ["TRITON_MLA"], page_size=64)
    with caplog.at_level("INFO"):
        vc = _fresh_config(base_config, block_size=16)
        assert vc.cache_config.block_size == 16
        assert platform.tuned_entry_for_config(vc) is None
        assert _select(platform, vc) == FLASHINFER_MLA_CLASS        # not the tuned TRITON_MLA
    said = [r.getMessage() for r in caplog.records if "--block-size 16" in r.getMessage()]
    assert len(said) == 1 and "page size 64" in said[0] and "serving untuned" in said[0], said


def test_a_block_size_equal_to_the_tuned_one_serves_tuned(platform, base_config, tmp_path,
                                                          monkeypatch):
    _tuned(tmp_path, monkeypatch, ["TRITON_MLA"], page_size=32)
    vc = _fresh_config(base_config, block_size=32)
    assert vc.cache_config.block_size == 32 and platform.tuned_entry_for_config(vc) is not None
    assert _select(platform, vc) == TRITON_MLA_CLASS


def test_no_tuned_config_keeps_vllms_default(platform, base_config):
    vc = _fresh_config(base_config)
    assert vc.cache_config.block_size == 16


def test_tuned_page_size_a_backend_cannot_take_falls_back(platform, base_config, tmp_path,
                                                          monkeypatch):
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    _tuned(tmp_path, monkeypatch, ["TRITON_MLA"], page_size=8)   # Triton MLA needs multiples of 16
    vc = _fresh_config(base_config)
    assert vc.cache_config.block_size == 8
    assert platform._preferred_block_size_for_backends([TritonMLABackend], 16, vc) == 16


# ---------------------------------------------------------------- platform facts

def test_platform_facts(platform):
    p = platform()
    assert p.is_cuda_alike() and p.is_out_of_tree() and p.device_type == "cuda"
    assert p.get_device_name() == H200.name
    assert platform.get_device_capability().to_int() == 90
    assert platform.get_device_communicator_cls().endswith("CudaCommunicator")
    assert platform.get_static_graph_wrapper_cls() == "vllm.compilation.cuda_graph.CUDAGraphWrapper"
    assert platform.opaque_attention_op() and platform.support_static_graph_mode()


def test_own_environment_variables_are_known(platform, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "1")
    monkeypatch.setenv(tc.FOLDER_ENV, "/nowhere")
    monkeypatch.setenv(tc.STRICT_ENV, "1")
    platform.validate_environ(hard_fail=True)
    monkeypatch.setenv("VLLM_SURELY_NOT_A_VARIABLE", "1")
    with pytest.raises(ValueError, match="VLLM_SURELY_NOT_A_VARIABLE"):
        platform.validate_environ(hard_fail=True)


def test_registration_points_both_enums_at_the_plugin(platform):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    import vllm_metax.platform as P

    P.register_backends()
    P.register_backends()                               # idempotent
    assert E.FLASHINFER_MLA.get_path() == FLASHINFER_MLA_CLASS
    assert E.TRITON_MLA.get_path() == TRITON_MLA_CLASS
    assert E.FLASHINFER_MLA.get_class().get_name() == "FLASHINFER_MLA"
    assert E.TRITON_MLA.get_class().get_name() == "TRITON_MLA"


def test_flashmla_is_the_plugins_and_refused_where_its_op_cannot_run(platform, base_config):
    """FLASHMLA is the plugin's backend over its FlashMLA op (vLLM's own loads vllm._flashmla_C
    only under vLLM's CUDA platform); on this GPU-less host the op cannot run, so an explicit
    FLASHMLA is refused with the op's reason and an automatic choice skips it
    (tests/test_flashmla_backend.py serves it)."""
    from vllm_metax.ops import flashmla as op
    from vllm_metax.platform import FLASHMLA_CLASS
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    assert op.library_path() is not None                 # the vllm extra ships the library
    with pytest.raises(ValueError, match="FLASHMLA.*FlashMLA needs a CUDA device"):
        _select(platform, base_config, "FLASHMLA")
    assert E.FLASHMLA.get_path() == FLASHMLA_CLASS
    assert _select(platform, base_config) == FLASHINFER_MLA_CLASS
