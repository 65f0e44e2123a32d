"""What vLLM 0.33.0 asks the metax platform on the way to serving an MLA model, answered with the
real vllm on a GPU-less host: the MLA prefill backend, a real MLAAttention layer, the compiled ops,
the capability questions (query-lens mismatch, DCP, PCP), PCI bus ids, and the vendor-package clash.
The FlashInfer prefill runs against a recording stand-in here (FlashInfer plans on CUDA only; the
real kernel is tests/test_gpu_prefill.py); vLLM's torch prefill, the fallback, runs for real."""

from __future__ import annotations

import socket
import types

import pytest
import torch

import plugin_support as ps
from prefill_support import (HEADS, KV_LORA, NOPE, ROPE, V_DIM, RecordingRaggedWrapper,
                             prefill_metadata, ragged, reference, scale)
from vllm_metax.core.device import DeviceInfo

pytestmark = pytest.mark.vllm

HOPPER = DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0))
METAX = DeviceInfo("MetaX C500", "pymxsml", True, 104, (8, 0))
DS_DIMS = dict(qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM)


def _selector(**dims):
    from vllm.v1.attention.backends.mla.prefill.base import MLADimensions
    from vllm.v1.attention.backends.mla.prefill.selector import MLAPrefillSelectorConfig
    return MLAPrefillSelectorConfig(torch.bfloat16, MLADimensions(**(dims or DS_DIMS)))


@pytest.fixture
def gpu(monkeypatch):
    """The platform on a pretend GPU; returns a setter for the device it pretends to be."""
    import vllm_metax.backend as backend_pkg
    import vllm_metax.platform as P
    from vllm.platforms.interface import DeviceCapability
    from vllm_metax.core import device as device_mod

    ps.ensure_metax_platform()

    def pretend(dev: DeviceInfo):
        for mod in (device_mod, backend_pkg, P):
            monkeypatch.setattr(mod, "detect_device", lambda: dev)
        monkeypatch.setattr(P, "_device_capability", lambda device_id: DeviceCapability(*dev.capability))
        return P.MetaxPlatform

    return pretend


# ---------------------------------------------------------------------------- prefill selection

def test_platform_answers_the_prefill_question_with_the_flashinfer_prefill(gpu):
    from vllm_metax.backend.flashinfer_prefill import FlashInferMLAPrefillBackend, prefill_backend_value
    platform = gpu(HOPPER)
    assert platform.get_mla_prefill_backend_cls(_selector()) is FlashInferMLAPrefillBackend
    assert prefill_backend_value() == "fa3"           # Hopper: fa3
    gpu(METAX)
    assert prefill_backend_value() == "fa2"           # MetaX's FlashInfer build: fa2 only


def test_vllms_own_selector_reaches_the_platform_and_the_flashinfer_name(gpu):
    """vLLM's get_mla_prefill_backend (what MLAAttention calls), automatic and explicit."""
    from vllm.config import AttentionConfig, VllmConfig
    from vllm.v1.attention.backends.mla.prefill import selector
    from vllm_metax.backend.flashinfer_prefill import FlashInferMLAPrefillBackend
    gpu(HOPPER)
    selector._auto_select_mla_prefill_backend.cache_clear()
    cfg = ps.make_vllm_config(ps.Path(__import__("tempfile").mkdtemp()))
    assert selector.get_mla_prefill_backend(cfg) is FlashInferMLAPrefillBackend
    explicit = VllmConfig(model_config=cfg.model_config,
                          attention_config=AttentionConfig(mla_prefill_backend="FLASHINFER"))
    assert selector.get_mla_prefill_backend(explicit) is FlashInferMLAPrefillBackend
    # vLLM's FLASH_ATTN prefill cannot run on an out-of-tree platform: an explicit choice says so
    fa = VllmConfig(model_config=cfg.model_config,
                    attention_config=AttentionConfig(mla_prefill_backend="FLASH_ATTN"))
    with pytest.raises(ValueError, match="FLASH_ATTN"):
        selector.get_mla_prefill_backend(fa)
    selector._auto_select_mla_prefill_backend.cache_clear()


def test_without_flashinfer_the_torch_prefill_is_chosen_and_says_why(gpu, monkeypatch):
    import vllm_metax.backend.flashinfer_prefill as fp
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    platform = gpu(HOPPER)
    monkeypatch.setattr(fp, "prefill_available", lambda: (False, "no flashinfer here"))
    assert platform.get_mla_prefill_backend_cls(_selector()) is CPUSDPAMLAPrefillBackend


def test_unsupported_dims_and_no_device_get_the_torch_fallback_not_an_error(gpu):
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    platform = gpu(HOPPER)
    odd = _selector(qk_nope_head_dim=96, qk_rope_head_dim=32, v_head_dim=96)
    assert platform.get_mla_prefill_backend_cls(odd) is CPUSDPAMLAPrefillBackend


def test_no_valid_prefill_raises_with_every_reason(gpu, monkeypatch):
    import vllm_metax.platform as P
    platform = gpu(HOPPER)
    monkeypatch.setattr(P, "MLA_PREFILL_ORDER", ("FLASHINFER",))
    with pytest.raises(ValueError, match=r"No valid MLA prefill backend.*FLASHINFER: \[.*MLA dimensions"):
        platform.get_mla_prefill_backend_cls(_selector(qk_nope_head_dim=96, qk_rope_head_dim=32,
                                                       v_head_dim=96))


# ---------------------------------------------------------------------------- a real MLAAttention

@pytest.fixture
def tp_world(tmp_path):
    """vLLM's distributed state for one rank on gloo (what a real layer's linear needs)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(ps.make_vllm_config(tmp_path / "world")):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
        initialize_model_parallel(1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def test_a_real_mla_attention_layer_builds_on_the_platform(gpu, tp_world, tmp_path):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.v1.attention.backends.mla.prefill import selector
    from vllm_metax.backend.flashinfer_mla import FlashInferMLABackend, FlashInferMLAImpl
    from vllm_metax.backend.flashinfer_prefill import FlashInferMLAPrefillBackend
    import vllm_metax.backend.flashinfer_mla as fb

    gpu(HOPPER)
    fb_ok = fb.flashinfer_available
    selector._auto_select_mla_prefill_backend.cache_clear()
    cfg = ps.make_vllm_config(tmp_path, block_size=64)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)      # vLLM builds a model in its dtype
    try:
        with set_current_vllm_config(cfg):
            kv_b = ColumnParallelLinear(KV_LORA, HEADS * (NOPE + V_DIM), bias=False,
                                        prefix="model.layers.0.self_attn.kv_b_proj")
            layer = MLAAttention(num_heads=HEADS, scale=ps.softmax_scale(), qk_nope_head_dim=NOPE,
                                 qk_rope_head_dim=ROPE, v_head_dim=V_DIM, q_lora_rank=None,
                                 kv_lora_rank=KV_LORA, kv_b_proj=kv_b, cache_config=cfg.cache_config,
                                 prefix="model.layers.0.self_attn.attn")
    finally:
        torch.set_default_dtype(old)
        selector._auto_select_mla_prefill_backend.cache_clear()
    assert fb_ok()[0], "FlashInfer imports on this host (vllm pins it)"
    assert layer.attn_backend is FlashInferMLABackend
    assert isinstance(layer.impl, FlashInferMLAImpl)
    assert isinstance(layer.prefill_backend, FlashInferMLAPrefillBackend)
    assert layer.prefill_backend.scale == ps.softmax_scale()
    assert layer.prefill_backend.backend == "fa3"


# ---------------------------------------------------------------------------- prefill numerics

@pytest.fixture
def recording_prefill(monkeypatch):
    import vllm_metax.ops.flashinfer_prefill as op
    RecordingRaggedWrapper.instances, RecordingRaggedWrapper.refuse = [], set()
    monkeypatch.setattr(op, "ragged_wrapper_cls", lambda: RecordingRaggedWrapper)
    return RecordingRaggedWrapper


def _flashinfer_prefill():
    from vllm_metax.backend.flashinfer_prefill import FlashInferMLAPrefillBackend
    return FlashInferMLAPrefillBackend(num_heads=HEADS, scale=scale(), kv_lora_rank=KV_LORA,
                                       vllm_config=None, **DS_DIMS)


Q_LENS, CTX_LENS = [37, 1, 130], [200, 64, 3]


def test_flashinfer_prefill_plans_mla_heads_and_converts_the_lse(gpu, recording_prefill):
    gpu(HOPPER)
    b = _flashinfer_prefill()
    md = prefill_metadata(Q_LENS, "cpu", chunk_kv_lens=CTX_LENS)
    b.prepare_metadata(md)
    main, chunk = recording_prefill.instances[0].plans[-1], recording_prefill.instances[1].plans[-1]
    assert (main["qk"], main["vo"], main["heads"], main["kv_heads"]) == (NOPE + ROPE, V_DIM, HEADS, HEADS)
    assert main["causal"] and not chunk["causal"]
    assert main["scale"] == chunk["scale"] == scale()           # the layer's scale, never 1.0
    assert main["qo"].tolist() == [0, 37, 38, 168] and main["qo"].device.type == "cpu"
    assert chunk["kv"].tolist() == [0, 200, 264, 267]
    assert recording_prefill.instances[0].backend == "fa3"

    q, k, v = ragged(Q_LENS, seed=1), ragged(Q_LENS, seed=2), ragged(Q_LENS, dim=V_DIM, seed=3)
    o, lse = b.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    ro, rl = reference(q, k, v, Q_LENS, Q_LENS, scale(), causal=True)
    assert lse.shape == (HEADS, sum(Q_LENS))                     # vLLM's [heads, tokens], natural log
    assert torch.allclose(lse.double(), rl, atol=1e-4) and torch.allclose(o.double(), ro, atol=2e-2)
    kc, vc = ragged(CTX_LENS, seed=4), ragged(CTX_LENS, dim=V_DIM, seed=5)
    co, cl = b.run_prefill_context_chunk(md.chunked_context.chunks[0], q, kc, vc)
    rco, rcl = reference(q, kc, vc, Q_LENS, CTX_LENS, scale(), causal=False)
    assert torch.allclose(cl.double(), rcl, atol=1e-4) and torch.allclose(co.double(), rco, atol=2e-2)


def test_a_refused_prefill_backend_falls_back_to_fa2_for_good(gpu, recording_prefill, caplog):
    gpu(HOPPER)
    recording_prefill.refuse = {"fa3"}
    b = _flashinfer_prefill()
    b.prepare_metadata(prefill_metadata(Q_LENS, "cpu"))
    b.prepare_metadata(prefill_metadata(Q_LENS, "cpu"))
    assert b.backend == "fa2" and b._main.backend == "fa2" and len(b._main.wrapper.plans) == 2
    assert sum("cannot plan here" in r.getMessage() for r in caplog.records) == 1


def test_fa2_refused_too_is_an_error_not_a_silent_fallback(gpu, recording_prefill):
    from vllm_metax.ops.flashinfer_mla import BackendRefused
    gpu(METAX)
    recording_prefill.refuse = {"fa2"}
    with pytest.raises(BackendRefused):
        _flashinfer_prefill().prepare_metadata(prefill_metadata(Q_LENS, "cpu"))


def test_flat_api_plan_without_o_data_type_is_called_without_it(gpu, recording_prefill, monkeypatch):
    """MetaX's 0.2.6-based FlashInfer has no o_data_type in plan(): it must not be passed."""
    import vllm_metax.ops.flashinfer_prefill as op

    class Flat(RecordingRaggedWrapper):
        def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
                 causal=False, sm_scale=None, q_data_type=None, kv_data_type=None):
            super().plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                         causal, sm_scale, q_data_type, kv_data_type)

    monkeypatch.setattr(op, "ragged_wrapper_cls", lambda: Flat)
    gpu(METAX)
    b = _flashinfer_prefill()
    b.prepare_metadata(prefill_metadata(Q_LENS, "cpu"))
    assert b._main.wrapper.plans[-1]["o_dtype"] is None and b._main.backend == "fa2"


def test_torch_fallback_prefill_matches_the_reference_on_the_cpu(gpu, monkeypatch):
    """The prefill the platform picks without FlashInfer (vLLM's torch one), run for real."""
    import vllm_metax.backend.flashinfer_prefill as fp
    platform = gpu(HOPPER)
    monkeypatch.setattr(fp, "prefill_available", lambda: (False, "absent"))
    cls = platform.get_mla_prefill_backend_cls(_selector())
    b = cls(num_heads=HEADS, scale=scale(), kv_lora_rank=KV_LORA, vllm_config=None, **DS_DIMS)
    md = prefill_metadata(Q_LENS, "cpu", chunk_kv_lens=CTX_LENS)
    b.prepare_metadata(md)
    q, k, v = ragged(Q_LENS, seed=1), ragged(Q_LENS, seed=2), ragged(Q_LENS, dim=V_DIM, seed=3)
    o, lse = b.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    ro, rl = reference(q, k, v, Q_LENS, Q_LENS, scale(), causal=True)
    assert torch.allclose(o.double(), ro, atol=2e-2) and torch.allclose(lse.double(), rl, atol=1e-3)
    kc, vc = ragged(CTX_LENS, seed=4), ragged(CTX_LENS, dim=V_DIM, seed=5)
    co, cl = b.run_prefill_context_chunk(md.chunked_context.chunks[0], q, kc, vc)
    rco, rcl = reference(q, kc, vc, Q_LENS, CTX_LENS, scale(), causal=False)
    assert torch.allclose(co.double(), rco, atol=2e-2) and torch.allclose(cl.double(), rcl, atol=1e-3)


# ---------------------------------------------------------------------------- capability questions

def _validate(**flags):
    from vllm.platforms.interface import DeviceCapability
    from vllm_metax.backend.flashinfer_mla import FlashInferMLABackend
    return FlashInferMLABackend.validate_configuration(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=64, use_mla=True,
        has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
        device_capability=DeviceCapability(9, 0), attn_type="decoder", **flags)


def test_host_planned_backend_refuses_query_lens_mismatch_dcp_and_pcp(gpu, monkeypatch):
    import vllm_metax.backend.flashinfer_mla as fb
    from vllm_metax.backend.flashinfer_mla import FlashInferMLABackend
    gpu(HOPPER)
    monkeypatch.setattr(fb, "flashinfer_available", lambda: (True, "stand-in"))
    assert FlashInferMLABackend.supports_device_cpu_query_lens_mismatch() is False
    assert _validate() == []
    assert "device-cpu query lens mismatch not supported, this is needed for adaptive verification" \
        in _validate(use_adaptive_verification=True)
    assert "DCP not supported" in _validate(use_dcp=True)
    assert "PCP not supported" in _validate(use_pcp=True)


def test_engine_wiring_answers(gpu, monkeypatch):
    platform = gpu(HOPPER)
    assert platform.get_device_communicator_cls().endswith("cuda_communicator.CudaCommunicator")
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert platform.get_all_gpu_pci_bus_ids() == {0: "0000:3b:00.0", 1: "0000:3b:00.0"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no GPU"):
        platform.get_all_gpu_pci_bus_ids()


# ---------------------------------------------------------------------------- compiled ops

def test_vendor_ops_come_first_on_metax_and_missing_ops_are_named():
    from vllm_metax.kernels import REQUIRED_OPS, load_compiled_ops
    tried = []

    def importer(name):
        tried.append(name)
        raise ImportError(f"No module named {name!r}")

    report = load_compiled_ops(is_metax=True, importer=importer)
    assert tried == ["mcoplib._C", "mcoplib._moe_C", "vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"]
    assert report.missing == list(REQUIRED_OPS) and not report.loaded
    tried.clear()
    load_compiled_ops(is_metax=False, importer=importer)
    assert tried == ["vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch"]


def test_the_real_vllm_ops_library_is_what_import_kernels_loads(gpu):
    """On this GPU-less host the CUDA build of vllm._C_stable_libtorch cannot load (no libcuda):
    the report says exactly that, names the ops, and the worker refuses to start with it."""
    import vllm_metax.platform as P
    from vllm_metax.kernels import MissingKernelsError
    from vllm_metax.worker import MetaxWorker
    gpu(HOPPER)
    P.compiled_ops.cache_clear()
    try:
        report = P.compiled_ops()
        P.MetaxPlatform.import_kernels()            # warns, never raises at import time
        assert "vllm._C_stable_libtorch" in report.failed
        assert "_C_cache_ops.concat_and_cache_mla" in report.missing
        with pytest.raises(MissingKernelsError, match="concat_and_cache_mla"):
            object.__new__(MetaxWorker).init_device()
    finally:
        P.compiled_ops.cache_clear()


def test_the_platform_runs_vllms_worker_through_the_ops_check(gpu, tmp_path):
    platform = gpu(HOPPER)
    cfg = ps.make_vllm_config(tmp_path)
    cfg.parallel_config.worker_cls = "auto"
    platform.check_and_update_config(cfg)
    assert cfg.parallel_config.worker_cls == "vllm_metax.worker.MetaxWorker"
    from vllm.v1.worker.gpu_worker import Worker
    from vllm_metax.worker import MetaxWorker
    assert issubclass(MetaxWorker, Worker)


# ---------------------------------------------------------------------------- vendor package clash

class _Dist:
    """A distribution's metadata as importlib.metadata reads it: top_level.txt and a file list
    (a wheel's RECORD lines, or an egg's installed-files.txt relative to its .egg-info)."""

    def __init__(self, name, top=(), files=(), eps=(), egg=False):
        self.metadata = {"Name": name}
        self.version = "0.11.2"
        self._top, self.entry_points = top, list(eps)
        self._lists = ({"installed-files.txt": "\n".join(f"../{f}" for f in files)} if egg else
                       {"RECORD": "".join(f"{f},sha256=x,1\n" for f in files)}) if files else {}

    def read_text(self, f):
        if f == "top_level.txt":
            return "\n".join(self._top)
        return self._lists.get(f)


def test_the_vendor_plugin_owning_vllm_metax_is_detected():
    from importlib.metadata import EntryPoint
    from vllm_metax.core.distribution import clash_message, other_owners
    vendor = _Dist("vllm-metax", top=["vllm_metax"],
                   eps=[EntryPoint("metax", "vllm_metax:register", "vllm.platform_plugins")])
    ours = _Dist("mla-tune", top=["mla_tune", "vllm_metax"])
    other = _Dist("numpy", top=["numpy"])
    files_only = _Dist("vllm_metax_fork", files=["vllm_metax_fork/x.py", "vllm_metax/__init__.py"])
    egg = _Dist("old-egg", files=["vllm_metax/ops/a.py"], egg=True)
    # a vllm_metax folder inside another package, or a package whose name only starts so: no clash
    nested = _Dist("nested", files=["other/vllm_metax/a.py", "vllm_metax_fork/b.py", "vllm_metax.pth"])
    assert other_owners([vendor, ours, other, files_only, egg, nested]) == [
        "old-egg 0.11.2", "vllm-metax 0.11.2", "vllm_metax_fork 0.11.2"]
    msg = clash_message(other_owners([vendor]))
    assert "vllm-metax 0.11.2" in msg and "\n" not in msg
    assert clash_message([]) is None
    assert other_owners() == []          # this environment: mla-tune alone


def test_doctor_and_register_say_so_in_one_line(monkeypatch, caplog):
    import vllm_metax
    import vllm_metax.core.distribution as dist
    from mla_tune.views.doctor import diagnose
    monkeypatch.setattr(dist, "other_owners", lambda distributions=None: ["vllm-metax 0.11.2"])
    checks = {c.what: c for c in diagnose().checks}
    assert checks["vllm_metax package"].status == "warn"
    assert "vllm-metax 0.11.2" in checks["vllm_metax package"].detail
    monkeypatch.setenv("VLLM_METAX_FORCE", "1")
    assert vllm_metax.register() == vllm_metax.PLATFORM_CLASS
    assert sum("vllm-metax 0.11.2" in r.getMessage() for r in caplog.records) == 1
