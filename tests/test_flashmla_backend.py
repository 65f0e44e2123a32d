"""FLASHMLA served by the plugin, with the real vllm==0.33.0 on the CPU: registered under vLLM's
name, chosen where the tuned config's (or the metax profile's) order names it and FlashMLA runs
here, refused (explicit) or skipped with one warning (tuned order) where it does not; its builder
plans at KV block 64 only and its impl runs the plugin's op with the step's tensors.

The op runs MetaX's `flash_mla` package on a MetaX device; here that package is simulated (a fake
`flash_mla` module whose two functions record their calls and compute with the torch reference),
so everything from vLLM's selection down to the op is the real code."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest
import torch

import plugin_support as ps
from plugin_support import FakeFlashMLA
from mla_tune.problem.reference import mla_decode_reference, relative_error
from vllm_metax.core import profile
from vllm_metax.core import tuned_config as tc
from vllm_metax.core.device import DeviceInfo
from vllm_metax.platform import FLASHINFER_MLA_CLASS, FLASHMLA_CLASS, TRITON_MLA_CLASS

pytestmark = pytest.mark.vllm

PAGE = 64
METAX = DeviceInfo("MetaX C500", "pymxsml", True, 104, (8, 0))
HOPPER = DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0))
DIMS = tc.ModelDims(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM, "bfloat16", "bfloat16")


@pytest.fixture
def flash_mla(monkeypatch):
    fake = FakeFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", fake.module)
    return fake


@pytest.fixture
def platform(monkeypatch):
    """MetaxPlatform on a pretend MetaX GPU (no profile variable: the device decides)."""
    import vllm_metax.backend as backend_pkg
    import vllm_metax.platform as P
    from vllm.platforms.interface import DeviceCapability
    from vllm_metax.core import device as device_mod

    ps.ensure_metax_platform()
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)
    monkeypatch.delenv(tc.FOLDER_ENV, raising=False)

    def on(dev):
        for mod in (device_mod, backend_pkg, P):
            monkeypatch.setattr(mod, "detect_device", lambda: dev)
        monkeypatch.setattr(P, "_device_capability", lambda device_id: DeviceCapability(*dev.capability))
    on(METAX)
    tc.clear_cache()
    P.MetaxPlatform.on = staticmethod(on)
    yield P.MetaxPlatform
    tc.clear_cache()


@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    return ps.make_vllm_config(tmp_path_factory.mktemp("model"), block_size=PAGE)


def _selector(**kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig
    return AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                   block_size=kw.pop("block_size", None), use_mla=True, **kw)


def _select(platform, vllm_config, backend=None):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with set_current_vllm_config(vllm_config):
        chosen = AttentionBackendEnum[backend] if backend else None
        return platform.get_attn_backend_cls(chosen, _selector(), num_heads=ps.NUM_HEADS)


def _tuned(tmp_path, monkeypatch, order, device, buckets=None, provenance=None):
    buckets = buckets or [tc.Bucket(8, 4096, 1, {"flashmla": tc.FamilyChoice({"backend": "flashmla"}, 10.0)},
                                    "flashmla")]
    entry = tc.ModelEntry(DIMS, PAGE, order, buckets)
    tc.write_tuned_config(tc.TunedConfig(device, provenance or {"test": True}, [entry]), tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()


# ---------------------------------------------------------------- registration and selection

def test_flashmla_is_registered_as_vllms_flashmla_over_the_plugins_op(platform):
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    import vllm_metax.backend.flashmla as fm

    platform.pre_register_and_update()
    assert E.FLASHMLA.get_path() == FLASHMLA_CLASS
    cls = E.FLASHMLA.get_class()
    assert issubclass(cls, FlashMLABackend) and cls.get_name() == "FLASHMLA"
    assert cls.get_supported_kernel_block_sizes() == [64]
    assert cls.get_builder_cls() is fm.MetaxFlashMLAMetadataBuilder
    assert cls.get_impl_cls() is fm.MetaxFlashMLAImpl


def test_on_metax_the_profiles_order_chooses_flashmla_where_flash_mla_runs(platform, base_config,
                                                                           flash_mla):
    assert profile.active_profile().name == "metax"
    assert _select(platform, base_config) == FLASHMLA_CLASS
    assert _select(platform, base_config, "FLASHMLA") == FLASHMLA_CLASS


def test_without_flash_mla_an_explicit_flashmla_is_refused_and_the_order_goes_on(
        platform, base_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)       # not installed
    with pytest.raises(ValueError, match="FLASHMLA.*flash_mla package is not importable"):
        _select(platform, base_config, "FLASHMLA")
    assert _select(platform, base_config) in (TRITON_MLA_CLASS, FLASHINFER_MLA_CLASS)


def test_a_tuned_flashmla_is_served_from_the_config(platform, base_config, flash_mla, tmp_path,
                                                    monkeypatch):
    _tuned(tmp_path, monkeypatch, ["FLASHMLA", "TRITON_MLA"], METAX.name)
    assert _select(platform, base_config) == FLASHMLA_CLASS
    from vllm.config import set_current_vllm_config
    with set_current_vllm_config(base_config):
        order, why = platform.attention_priorities(_selector(), ps.NUM_HEADS)
    assert [b.name for b in order][:2] == ["FLASHMLA", "TRITON_MLA"] and "tuned config" in why


def test_a_tuned_flashmla_that_cannot_run_falls_through_with_one_warning(platform, base_config,
                                                                         tmp_path, monkeypatch, caplog):
    """An NVIDIA host without a GPU (vLLM's FlashMLA library cannot load): the tuned FLASHMLA is
    skipped, the next backend of the order serves, and the log says so once."""
    platform.on(HOPPER)
    _tuned(tmp_path, monkeypatch, ["FLASHMLA", "TRITON_MLA"], HOPPER.name)
    with caplog.at_level(logging.WARNING):
        assert _select(platform, base_config) == TRITON_MLA_CLASS
        assert _select(platform, base_config) == TRITON_MLA_CLASS
    said = [r.getMessage() for r in caplog.records if "cannot run here" in r.getMessage()]
    assert len(said) == 1 and "FLASHMLA" in said[0] and "using TRITON_MLA" in said[0], said


# ---------------------------------------------------------------- builder and impl

def _builder(vllm_config, layer_name="model.layers.0.self_attn.attn"):
    from vllm.config import set_current_vllm_config
    from vllm_metax.backend.flashmla import MetaxFlashMLABackend

    vllm_config.compilation_config.static_forward_context[layer_name] = ps.stand_in_layer()
    with set_current_vllm_config(vllm_config):
        return MetaxFlashMLABackend.get_builder_cls()(ps.kv_cache_spec(vllm_config), [layer_name],
                                                      vllm_config, torch.device("cpu"))


def _impl(vllm_config, scale=None):
    from vllm.config import set_current_vllm_config
    from vllm_metax.backend.flashmla import MetaxFlashMLABackend

    args = dict(num_heads=ps.NUM_HEADS, head_size=ps.KV_LORA_RANK + ps.ROPE_DIM,
                scale=ps.softmax_scale() if scale is None else scale, num_kv_heads=1,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=None,
                kv_lora_rank=ps.KV_LORA_RANK, qk_nope_head_dim=ps.NOPE_DIM, qk_rope_head_dim=ps.ROPE_DIM,
                qk_head_dim=ps.NOPE_DIM + ps.ROPE_DIM, v_head_dim=ps.V_DIM, kv_b_proj=None)
    with set_current_vllm_config(vllm_config):
        return MetaxFlashMLABackend.get_impl_cls()(**args)


def _decode(builder, seq_lens, q_len=1):
    return ps.build_decode(builder, seq_lens, PAGE, q_len)


def _qkv(rows, num_pages, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, ps.NUM_HEADS, ps.KV_LORA_RANK + ps.ROPE_DIM, generator=g).to(torch.bfloat16)
    kv = torch.randn(num_pages, PAGE, ps.KV_LORA_RANK + ps.ROPE_DIM, generator=g).to(torch.bfloat16)
    return q, kv


def test_the_builder_plans_at_block_64_only(platform, base_config, flash_mla, tmp_path):
    builder = _builder(base_config)
    md, bt, lens, _ = _decode(builder, [5, 130, 64])
    assert md.kernel.library == "flash_mla" and md.q_len == 1
    assert md.kernel.softmax_scale == pytest.approx(ps.softmax_scale()) and md.kernel.causal
    assert md.block_table.data_ptr() == bt.data_ptr() and md.seq_lens.tolist() == [5, 130, 64]
    small = ps.make_vllm_config(tmp_path, block_size=16)
    with pytest.raises(ValueError, match="FLASHMLA needs KV block size 64, got 16"):
        _builder(small)


def test_the_impl_runs_the_op_with_the_steps_tensors(platform, base_config, flash_mla):
    builder, impl = _builder(base_config), _impl(base_config)
    seq_lens = [5, 130, 64, 1]
    md, bt, lens, num_pages = _decode(builder, seq_lens)
    q, kv = _qkv(len(seq_lens), num_pages)
    step = SimpleNamespace(decode=md, num_decodes=len(seq_lens))
    out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), kv, step, None)
    out2, _ = impl.forward_mqa(q, kv, step, None)            # the next layer, one packed tensor
    ref = mla_decode_reference(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], bt, lens,
                               ps.softmax_scale())
    assert out.shape == (4, ps.NUM_HEADS, ps.KV_LORA_RANK) and relative_error(out, ref) < 1e-2
    assert torch.equal(out, out2)
    # one schedule a step (the first layer), computed for q_len x heads query rows of one KV head
    assert flash_mla.metadata_calls == [(seq_lens, ps.NUM_HEADS, 1)]
    first, second = flash_mla.fwd_calls
    assert first["q_shape"] == (4, 1, ps.NUM_HEADS, 576) and first["k_shape"] == (num_pages, 64, 1, 576)
    assert first["head_dim_v"] == 512 and first["causal"] is True
    assert first["scale"] == pytest.approx(ps.softmax_scale()) and first["scale"] != 1.0
    assert first["block_table"].data_ptr() == bt.data_ptr() and first["seq_lens"] == seq_lens
    assert second["tsm"] == first["tsm"] == 1
    md2, *_ = _decode(builder, [7, 7])                       # the next step schedules again
    impl.forward_mqa(q[:2], kv, SimpleNamespace(decode=md2, num_decodes=2), None)
    assert flash_mla.metadata_calls[-1] == ([7, 7], ps.NUM_HEADS, 1)
    assert flash_mla.fwd_calls[-1]["tsm"] == 2


def test_multi_token_decode_is_causal_and_the_lse_is_per_token(platform, base_config, flash_mla):
    builder, impl = _builder(base_config), _impl(base_config)
    impl.need_to_return_lse_for_decode = True
    md, bt, lens, num_pages = _decode(builder, [40, 9], q_len=2)
    assert md.q_len == 2
    q, kv = _qkv(4, num_pages)
    out, lse = impl.forward_mqa(q, kv, SimpleNamespace(decode=md, num_decodes=2), None)
    ref, ref_lse = mla_decode_reference(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], bt,
                                        lens, ps.softmax_scale(), q_len=2, return_lse=True)
    assert flash_mla.metadata_calls[-1][1] == 2 * ps.NUM_HEADS
    assert relative_error(out, ref) < 1e-2 and lse.shape == (4, ps.NUM_HEADS)
    assert torch.allclose(lse.float(), ref_lse.float(), atol=1e-2)


def test_a_step_planned_with_another_scale_is_refused(platform, base_config, flash_mla):
    builder, impl = _builder(base_config), _impl(base_config, scale=1.0)
    md, _, _, num_pages = _decode(builder, [10])
    q, kv = _qkv(1, num_pages)
    with pytest.raises(ValueError, match="softmax scale"):
        impl.forward_mqa(q, kv, SimpleNamespace(decode=md, num_decodes=1), None)


def test_a_recording_server_counts_flashmlas_steps(platform, base_config, flash_mla, tmp_path,
                                                   monkeypatch):
    """VLLM_METAX_TRAFFIC: FLASHMLA's steps are counted by the key a tuned FLASHINFER_MLA would
    look them up by (batch, mean length, q_len); recording off, the builder holds None."""
    from vllm_metax.core import decisions, traffic as rec
    monkeypatch.setattr(rec, "_RECORDERS", {})
    monkeypatch.delenv(rec.TRAFFIC_ENV, raising=False)
    assert _builder(base_config).traffic is None
    monkeypatch.setenv(rec.TRAFFIC_ENV, str(tmp_path / "t.db"))
    builder = _builder(base_config)
    lens = [5, 130, 64]
    _decode(builder, lens)
    _decode(builder, [700, 900], q_len=2)
    assert builder.traffic.decode_counts == {
        (3, 1, rec.fine_bin(decisions.bucket_context(lens))): 1, (2, 2, rec.fine_bin(800)): 1}
    builder.traffic.close()
