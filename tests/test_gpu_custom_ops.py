"""vLLM's compiled kernels for norms, activations and rotary on the metax platform, on a real GPU
with vLLM's real compiled ops (vllm._C_stable_libtorch): each op dispatches to vLLM's CUDA kernel
(vllm_metax.custom_ops) and agrees with vLLM's PyTorch code. Skips where those ops are not carried."""

from __future__ import annotations

import os

import pytest
import torch

import plugin_support as ps

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    os.environ.setdefault("VLLM_METAX_FORCE", "1")
    from vllm_metax.platform import compiled_ops

    report = compiled_ops()
    if "vllm._C_stable_libtorch" not in report.loaded:
        pytest.skip(f"vLLM's compiled ops are not here: {report.summary()}")
    ps.ensure_metax_platform()
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(ps.model_dir(tmp_path_factory.mktemp("model"))), tokenizer=None,
                     skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    return VllmConfig(model_config=mc, compilation_config=CompilationConfig(mode=0))


def test_norms_activations_and_rotary_run_vllms_cuda_kernels(config):
    from vllm import ir
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from vllm_metax.custom_ops import register_cuda_forward

    outcome = register_cuda_forward()
    assert outcome["SiluAndMul"] == outcome["RotaryEmbedding"] == "compiled", outcome
    assert config.kernel_config.ir_op_priority.rms_norm[0] == "vllm_c"
    g = torch.Generator(device="cuda").manual_seed(0)
    with set_current_vllm_config(config), config.kernel_config.ir_op_priority.set_priority():
        assert ir.ops.rms_norm.get_priority()[0] == "vllm_c"
        act = SiluAndMul()
        assert act._forward_method.__func__ is SiluAndMul.forward_cuda
        x = torch.randn(7, 2 * 1408, device="cuda", dtype=torch.bfloat16, generator=g)
        torch.testing.assert_close(act(x), SiluAndMul.forward_native(x), atol=2e-2, rtol=2e-2)

        norm = RMSNorm(1024, eps=1e-6).to("cuda", torch.bfloat16)
        h = torch.randn(7, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        r = torch.randn(7, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(norm(h).float(), ref, atol=3e-2, rtol=3e-2)
        s = (h.float() + r.float())
        out, res = norm(h.clone(), r.clone())
        torch.testing.assert_close(res.float(), s, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out.float(), s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6),
                                   atol=5e-2, rtol=5e-2)

        rope = RotaryEmbedding(64, 64, 4096, 10000.0, False, torch.bfloat16).to("cuda")
        assert rope._forward_method.__func__ is RotaryEmbedding.forward_cuda
        pos = torch.arange(7, device="cuda") * 97
        q = torch.randn(7, 16 * 64, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(7, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        q_ref, k_ref = rope.forward_native(pos, q.clone(), k.clone())
        q_out, k_out = rope(pos, q.clone(), k.clone())
        torch.testing.assert_close(q_out, q_ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(k_out, k_ref, atol=2e-2, rtol=2e-2)


def test_the_mla_layers_merge_runs_vllms_cuda_kernel(config):
    """The MLA prefill's merge of context and new-token attention through vLLM's compiled
    `_C.merge_attn_states` (vllm_metax.custom_ops.route_merge_attn_states), agreeing with vLLM's
    Triton merge (what the platform ran before) and a float64 reference, LSE included."""
    import importlib

    from vllm_metax.custom_ops import MERGE_USERS, route_merge_attn_states

    users = [importlib.import_module(m) for m in MERGE_USERS]
    mla = users[0]
    vllm_own = mla.merge_attn_states
    try:
        assert route_merge_attn_states() == "compiled"
        g = torch.Generator(device="cuda").manual_seed(0)
        t, h, d = 300, 16, 128
        # as vLLM's MLA prefill merges them: outputs sliced to v_head_dim from the 192-wide
        # q/k head (head stride 192), LSE [heads, tokens] as transposed views of [tokens, heads]
        po, so = (torch.randn(t, h, 192, device="cuda", dtype=torch.bfloat16, generator=g)[..., :d]
                  for _ in range(2))
        plse, slse = ((torch.randn(t, h, device="cuda", generator=g) * 3).t() for _ in range(2))
        plse[:, :7] = float("-inf")               # tokens whose context chunk saw nothing
        out, lse = torch.empty(t, h, d, device="cuda", dtype=torch.bfloat16), torch.empty(h, t, device="cuda")
        mla.merge_attn_states(output=out, prefix_output=po, prefix_lse=plse, suffix_output=so,
                              suffix_lse=slse, output_lse=lse)
        tri, tri_lse = torch.empty_like(out), torch.empty_like(lse)
        from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states as triton_merge
        triton_merge(tri, po, plse, so, slse, tri_lse)
        ref_lse = torch.logaddexp(plse.double(), slse.double())
        wp = torch.exp(plse.double() - ref_lse).transpose(0, 1).unsqueeze(-1)
        ws = torch.exp(slse.double() - ref_lse).transpose(0, 1).unsqueeze(-1)
        ref = wp * po.double() + ws * so.double()
        torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out, tri, atol=1e-2, rtol=1e-2)
    finally:
        for u in users:
            u.merge_attn_states = vllm_own
