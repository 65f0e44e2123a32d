"""What the metax platform gives vLLM around attention, with the real vLLM 0.33.0 machinery on the
CPU: vLLM's compiled kernels for norms, activations and rotary (vllm_metax.custom_ops, through
vLLM's CustomOp and IR-op dispatch), and a FlashInfer warmup that the installed FlashInfer can run.

vLLM's compiled ops are not on this GPU-less host; where a test needs one it registers a CPU
double under the same `torch.ops._C` name through torch.library, removed afterwards."""

from __future__ import annotations

import logging

import pytest
import torch

from plugin_support import ensure_metax_platform, model_dir

import vllm_metax
from vllm_metax import custom_ops


@pytest.fixture
def oot_registry(monkeypatch):
    """vLLM's out-of-tree op registry, empty for the test and restored afterwards."""
    import vllm.model_executor.custom_op as co

    monkeypatch.setattr(co, "op_registry_oot", {})
    return co.op_registry_oot


@pytest.fixture
def silu_kernel():
    """A CPU double of vLLM's compiled `_C.silu_and_mul` (out = silu(x[:d]) * x[d:]) that counts
    its calls: registered as torch.ops._C.silu_and_mul for the test only."""
    lib = torch.library.Library("_C", "FRAGMENT")
    calls = []
    lib.define("silu_and_mul(Tensor(a!) out, Tensor x) -> ()")

    def impl(out, x):
        calls.append(tuple(x.shape))
        d = x.shape[-1] // 2
        out.copy_(torch.nn.functional.silu(x[..., :d]) * x[..., d:])

    lib.impl("silu_and_mul", impl, "CPU")
    yield calls
    lib._destroy()


@pytest.fixture(autouse=True)
def merge_users(monkeypatch):
    """The MLA modules' `merge_attn_states` bindings, restored after every test (routing rebinds
    them for the whole process)."""
    import importlib

    mods = [importlib.import_module(m) for m in custom_ops.MERGE_USERS]
    for m in mods:
        monkeypatch.setattr(m, "merge_attn_states", m.merge_attn_states)
    return mods


@pytest.fixture
def merge_kernel():
    """A CPU double of vLLM's compiled `_C.merge_attn_states` (the LSE-weighted merge of prefix
    and suffix attention, in float64) that counts its calls."""
    lib = torch.library.Library("_C", "FRAGMENT")
    calls = []
    lib.define("merge_attn_states(Tensor(a!) output, Tensor(b!)? output_lse, Tensor prefix_output, "
               "Tensor prefix_lse, Tensor suffix_output, Tensor suffix_lse, "
               "int? prefill_tokens_with_context, Tensor? output_scale) -> ()")

    def impl(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, n, scale):
        assert prefix_lse.is_contiguous() and suffix_lse.is_contiguous()   # earlier kernels' indexing
        calls.append(tuple(output.shape))
        out, lse = _merge_reference(prefix_output, prefix_lse, suffix_output, suffix_lse)
        output.copy_(out.to(output.dtype))
        if output_lse is not None:
            output_lse.copy_(lse.to(output_lse.dtype))

    lib.impl("merge_attn_states", impl, "CPU")
    yield calls
    lib._destroy()


def _merge_reference(po, plse, so, slse):
    """out = (e^plse po + e^slse so) / (e^plse + e^slse) per token and head; lse its log-normaliser.
    lse tensors are [heads, tokens], outputs [tokens, heads, dim]."""
    lse = torch.logaddexp(plse.double(), slse.double())
    wp = torch.exp(plse.double() - lse).transpose(0, 1).unsqueeze(-1)
    ws = torch.exp(slse.double() - lse).transpose(0, 1).unsqueeze(-1)
    return wp * po.double() + ws * so.double(), lse


def _merge_inputs(tokens=5, heads=16, dim=128, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    po, so = (torch.randn(tokens, heads, dim, generator=g).to(dtype) for _ in range(2))
    plse, slse = (torch.randn(heads, tokens, generator=g) * 3 for _ in range(2))
    return po, plse, so, slse


def _vllm_config(tmp_path, mode: int):
    ensure_metax_platform()
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(model_dir(tmp_path)), tokenizer=None, skip_tokenizer_init=True,
                     dtype="bfloat16", max_model_len=4096)
    return VllmConfig(model_config=mc, compilation_config=CompilationConfig(mode=mode))


def test_ir_ops_take_the_compiled_kernel_first_only_where_it_is_loaded_and_nothing_compiles():
    both = custom_ops.ir_op_priority(False, has=lambda op: True)
    assert both == {"rms_norm": ["vllm_c", "native"], "fused_add_rms_norm": ["vllm_c", "native"]}
    assert set(map(tuple, custom_ops.ir_op_priority(True, has=lambda op: True).values())) == {("native",)}
    only_norm = custom_ops.ir_op_priority(False, has=lambda op: op == "_C.rms_norm")
    assert only_norm == {"rms_norm": ["vllm_c", "native"], "fused_add_rms_norm": ["native"]}


def test_the_platform_gives_vllms_config_the_compiled_norms(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(custom_ops, "has_op", lambda op: True)
    with caplog.at_level(logging.INFO):
        eager = _vllm_config(tmp_path, mode=0)
    assert eager.kernel_config.ir_op_priority.rms_norm == ["vllm_c", "native"]
    assert eager.kernel_config.ir_op_priority.fused_add_rms_norm == ["vllm_c", "native"]
    assert "rms_norm=['vllm_c', 'native']" in caplog.text        # vLLM's own log line says so
    compiled = _vllm_config(tmp_path, mode=3)                     # inductor fuses the native code
    assert compiled.kernel_config.ir_op_priority.rms_norm == ["native"]
    monkeypatch.setattr(custom_ops, "has_op", lambda op: False)   # no kernels loaded: PyTorch's
    assert _vllm_config(tmp_path, mode=0).kernel_config.ir_op_priority.rms_norm == ["native"]


def test_silu_and_mul_runs_the_compiled_kernel_on_the_platform(tmp_path, oot_registry, silu_kernel):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul

    config = _vllm_config(tmp_path, mode=0)
    outcome = custom_ops.register_cuda_forward()
    assert outcome["SiluAndMul"] == "compiled"
    assert "torch.ops._C.mul_and_silu not registered" in outcome["MulAndSilu"]
    assert set(oot_registry) == {"SiluAndMul"}
    with set_current_vllm_config(config):
        act = SiluAndMul()
        x = torch.randn(3, 2 * 16)
        out = act(x)
    assert isinstance(act, SiluAndMul) and type(act) is not SiluAndMul
    assert type(act).name == "silu_and_mul"          # --compilation-config custom_ops still name it
    assert silu_kernel == [(3, 32)]                  # the compiled op ran, not PyTorch's code
    torch.testing.assert_close(out, SiluAndMul.forward_native(x))
    assert custom_ops.register_cuda_forward()["SiluAndMul"] == "compiled"   # idempotent
    assert len(oot_registry) == 1


def test_without_the_kernel_vllms_pytorch_code_stays(tmp_path, oot_registry, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    monkeypatch.setattr(custom_ops, "has_op", lambda op: False)
    config = _vllm_config(tmp_path, mode=0)
    outcome = custom_ops.register_cuda_forward()
    assert set(outcome) == {"SiluAndMul", "MulAndSilu", "GeluAndMul", "RotaryEmbedding"}
    assert all(v.startswith("PyTorch code: torch.ops._C.") for v in outcome.values())
    assert oot_registry == {}
    with set_current_vllm_config(config):
        rope = RotaryEmbedding(64, 64, 4096, 10000.0, False, torch.float32)
    assert type(rope) is RotaryEmbedding and rope._forward_method == rope.forward_oot
    line = custom_ops.summary(outcome)
    assert "compiled kernels for no CustomOp" in line and "RotaryEmbedding (PyTorch code" in line


def test_rotary_dispatches_to_vllms_cuda_forward_where_its_kernel_is(tmp_path, oot_registry, monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    monkeypatch.setattr(custom_ops, "has_op", lambda op: True)
    config = _vllm_config(tmp_path, mode=0)
    custom_ops.register_cuda_forward()
    with set_current_vllm_config(config):
        rope = RotaryEmbedding(64, 64, 4096, 10000.0, False, torch.float32)
    assert isinstance(rope, RotaryEmbedding) and type(rope).name == "rotary_embedding"
    assert rope._forward_method.__func__ is RotaryEmbedding.forward_cuda


def test_an_op_another_plugin_registered_first_is_kept(oot_registry, monkeypatch):
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import SiluAndMul

    @CustomOp.register_oot(name="SiluAndMul")
    class VendorSiluAndMul(SiluAndMul):
        pass

    monkeypatch.setattr(custom_ops, "has_op", lambda op: True)
    outcome = custom_ops.register_cuda_forward()
    assert outcome["SiluAndMul"].startswith("kept ") and "VendorSiluAndMul" in outcome["SiluAndMul"]
    assert oot_registry["SiluAndMul"] is VendorSiluAndMul
    assert outcome["RotaryEmbedding"] == "compiled"


def test_a_class_this_vllm_lacks_keeps_its_default(oot_registry, monkeypatch):
    monkeypatch.setattr(custom_ops, "has_op", lambda op: True)

    def loader(path):
        raise AttributeError(f"no {path.rsplit('.', 1)[1]} here")

    outcome = custom_ops.register_cuda_forward(loader=loader)
    assert outcome["SiluAndMul"] == "PyTorch code: AttributeError: no SiluAndMul here"
    assert oot_registry == {}


def test_the_entry_point_registers_only_where_the_platform_is_active(oot_registry, monkeypatch, caplog,
                                                                    merge_kernel):
    monkeypatch.setattr(custom_ops, "has_op", lambda op: True)
    monkeypatch.setattr(vllm_metax, "should_activate", lambda: (False, "not a MetaX device"))
    assert vllm_metax.register_custom_ops() is None and oot_registry == {}
    monkeypatch.setattr(vllm_metax, "should_activate", lambda: (True, "forced"))
    with caplog.at_level(logging.INFO):
        outcome = vllm_metax.register_custom_ops()
    assert outcome["SiluAndMul"] == "compiled" and "SiluAndMul" in oot_registry
    assert outcome["merge_attn_states"] == "compiled"
    assert ("vllm_metax: vLLM's compiled kernels for SiluAndMul, MulAndSilu, GeluAndMul, RotaryEmbedding, "
            "merge_attn_states") in caplog.text


def test_rms_norm_runs_the_compiled_kernel_under_the_platforms_priority(tmp_path, monkeypatch):
    """vLLM's RMSNorm layer -> its IR op -> the `vllm_c` provider -> torch.ops._C.rms_norm (a CPU
    double here), under the priority the platform gave vLLM's config."""
    from vllm import ir
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    lib = torch.library.Library("_C", "FRAGMENT")
    calls = []
    lib.define("rms_norm(Tensor(a!) out, Tensor x, Tensor? weight, float eps) -> ()")

    def impl(out, x, weight, eps):
        calls.append(tuple(x.shape))
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        out.copy_((y * weight.float()).to(x.dtype) if weight is not None else y.to(x.dtype))

    lib.impl("rms_norm", impl, "CPU")
    # vllm/kernels/vllm_c.py decides `supported` once, at import, from the platform then current
    # (`is_cuda_alike()`); another test of this process may have imported it under vLLM's CPU
    # platform, so take the metax platform's answer, as a server's import has it
    platform = ensure_metax_platform()
    import vllm.kernels  # noqa: F401 - registers the vllm_c implementations
    monkeypatch.setattr(ir.ops.rms_norm.impls["vllm_c"], "supported", platform.is_cuda_alike())
    try:
        config = _vllm_config(tmp_path, mode=0)
        assert config.kernel_config.ir_op_priority.rms_norm == ["vllm_c", "native"]
        with set_current_vllm_config(config), config.kernel_config.ir_op_priority.set_priority():
            assert ir.ops.rms_norm.get_priority()[0] == "vllm_c"
            norm = RMSNorm(64, eps=1e-6)
            x = torch.randn(5, 64)
            out = norm(x)
        assert calls == [(5, 64)]
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(out, ref)
    finally:
        lib._destroy()


def _fake_flashinfer(monkeypatch, version, **autotuner_attrs):
    import importlib.machinery
    import sys
    import types

    pkg = types.ModuleType("flashinfer")
    pkg.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None, is_package=True)
    pkg.__version__ = version
    pkg.autotuner = types.ModuleType("flashinfer.autotuner")
    for k, v in autotuner_attrs.items():
        setattr(pkg.autotuner, k, v)
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.autotuner", pkg.autotuner)


@pytest.mark.parametrize("has_api", [False, True])
def test_flashinfer_autotune_is_off_where_flashinfer_lacks_what_vllms_warmup_calls(
        tmp_path, monkeypatch, caplog, has_api):
    """FlashInfer 0.2.6 (MetaX's flat build) has flashinfer.autotuner without
    set_autotune_process_group: vLLM's warmup imported it and the engine died at start (seen on the
    lent H100 with 0.2.6.post1). The platform turns the autotune off there, in one line."""
    from vllm_metax import platform

    extra = {"set_autotune_process_group": lambda group: None} if has_api else {}
    _fake_flashinfer(monkeypatch, "0.2.6.post1" if not has_api else "0.7.2.post1", **extra)
    platform.flashinfer_autotune_missing.cache_clear()
    try:
        with caplog.at_level(logging.INFO):
            config = _vllm_config(tmp_path, mode=0)
    finally:
        platform.flashinfer_autotune_missing.cache_clear()
    if has_api:
        assert config.kernel_config.enable_flashinfer_autotune is not False
        assert "FlashInfer autotune at warmup off" not in caplog.text
    else:
        assert config.kernel_config.enable_flashinfer_autotune is False
        assert ("vllm_metax: FlashInfer autotune at warmup off: FlashInfer 0.2.6.post1 has no "
                "flashinfer.autotuner.set_autotune_process_group") in caplog.text


def test_the_mla_layers_merge_runs_the_compiled_kernel_where_it_is_registered(merge_users, merge_kernel):
    """vLLM picks its compiled merge only on CudaPlatform; elsewhere a Triton kernel JIT-compiled
    at the first long prompt (vLLM's JIT monitor warned of it on every plugin server). The MLA
    modules' own `merge_attn_states` (what vLLM's MLA prefill calls) now reaches the compiled one."""
    mla, sparse = merge_users
    vllm_own = mla.merge_attn_states
    assert custom_ops.route_merge_attn_states(has=lambda op: True) == "compiled"
    assert mla.merge_attn_states.__wrapped__ is vllm_own and sparse.merge_attn_states is mla.merge_attn_states
    po, plse, so, slse = _merge_inputs()
    # as the plugin's FlashInfer prefill returns them: [tokens, heads] transposed to [heads, tokens]
    plse, slse = plse.t().contiguous().t(), slse.t().contiguous().t()
    assert not plse.is_contiguous()
    out, out_lse = torch.empty_like(po), torch.empty(plse.shape)
    mla.merge_attn_states(output=out, prefix_output=po, prefix_lse=plse, suffix_output=so,
                          suffix_lse=slse, output_lse=out_lse)
    assert merge_kernel == [(5, 16, 128)]
    ref, ref_lse = _merge_reference(po, plse, so, slse)
    torch.testing.assert_close(out, ref.to(out.dtype))
    torch.testing.assert_close(out_lse, ref_lse.float())
    assert custom_ops.route_merge_attn_states(has=lambda op: True) == "compiled"   # idempotent
    assert mla.merge_attn_states.__wrapped__ is vllm_own


@pytest.mark.parametrize("case, compiled", [
    ("bf16 dim 128", True), ("fp32 dim 100", True), ("fp16 dim 100", False),
    ("bf16 strides differ", False), ("fp8 out without scale", False), ("fp8 out with scale", True),
    ("bf16 strided output_lse", False)])
def test_the_compiled_merge_takes_what_vllms_rule_gives_its_kernel(case, compiled, monkeypatch):
    """vLLM's rule (merge_attn_states.py): float32/half/bfloat16 inputs with a head size that is a
    multiple of 4 (float32) or 8; anything else goes to vLLM's own function, which asserts on
    mismatched strides and on FP8 output without a scale. An output LSE that is a strided view
    stays with vLLM's function too (earlier compiled kernels write it as contiguous)."""
    from vllm import _custom_ops

    took = []
    monkeypatch.setattr(_custom_ops, "merge_attn_states", lambda *a: took.append("compiled"))
    merge = custom_ops.compiled_merge(lambda *a: took.append("vllm's own"))
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(case.split()[0], torch.bfloat16)
    dim = 100 if "dim 100" in case else 128
    po, plse, so, slse = _merge_inputs(dim=dim, dtype=dtype)
    if "strides" in case:
        so = torch.randn(5, 16, 2 * dim).to(dtype)[..., :dim]
    out = torch.empty(po.shape, dtype=torch.float8_e4m3fn) if "fp8" in case else torch.empty_like(po)
    scale = torch.ones(()) if "with scale" in case else None
    out_lse = torch.empty(16, 9)[:, 2:7] if "output_lse" in case else None   # a slice, as the
    merge(out, po, plse, so, slse, out_lse, None, scale)                      # continuation merge
    assert took == ["compiled" if compiled else "vllm's own"]


def test_without_the_compiled_merge_vllms_stays(merge_users):
    mla, sparse = merge_users
    before = mla.merge_attn_states
    outcome = custom_ops.route_merge_attn_states(has=lambda op: False)
    assert outcome == "Triton: torch.ops._C.merge_attn_states not registered"
    assert mla.merge_attn_states is before and sparse.merge_attn_states is before
    assert "merge_attn_states (Triton: torch.ops._C.merge_attn_states not registered)" in \
        custom_ops.summary({"SiluAndMul": "compiled", "merge_attn_states": outcome})


def test_a_merge_another_plugin_bound_first_is_kept(merge_users, merge_kernel):
    mla, sparse = merge_users

    def vendor_merge(*a, **k):
        return None

    mla.merge_attn_states = vendor_merge
    outcome = custom_ops.route_merge_attn_states(has=lambda op: True)
    assert outcome == "compiled, except another plugin's merge_attn_states kept in mla_attention"
    assert mla.merge_attn_states is vendor_merge
    assert getattr(sparse.merge_attn_states, "_vllm_metax_compiled", False)


def test_a_merge_kernel_of_another_signature_keeps_vllms_merge(merge_users):
    """An older `_C.merge_attn_states` (six arguments, contiguous heads only: what another build,
    MetaX's mcoplib say, may register) is not called with vLLM 0.33's eight."""
    mla, _ = merge_users
    before = mla.merge_attn_states
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("merge_attn_states(Tensor(a!) output, Tensor(b!)? output_lse, Tensor prefix_output, "
               "Tensor prefix_lse, Tensor suffix_output, Tensor suffix_lse) -> ()")
    try:
        outcome = custom_ops.route_merge_attn_states(has=lambda op: True)
    finally:
        lib._destroy()
    assert outcome.startswith("Triton: torch.ops._C.merge_attn_states takes (output, output_lse, "
                              "prefix_output, prefix_lse, suffix_output, suffix_lse), not vLLM 0.33's")
    assert mla.merge_attn_states is before
