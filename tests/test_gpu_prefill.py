"""The plugin's MLA prefill on a real GPU (run on the H200: pytest -m gpu): FlashInfer's ragged
prefill through vllm_metax's prefill backend, for the new tokens (causal, ragged requests) and a
context chunk (non-causal, natural-log LSE as vLLM merges chunks), against a float64 reference and
against vLLM's own torch prefill on the same tensors; fa2 and, on Hopper, fa3."""

import pytest
import torch

from tests.prefill_support import (HEADS, KV_LORA, NOPE, ROPE, V_DIM, prefill_metadata, ragged,
                                   reference, scale)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

Q_LENS = [37, 1, 300, 129]
CTX_LENS = [500, 64, 3, 1000]


def _backend(value):
    from vllm_metax.ops.flashinfer_prefill import prefill_available
    ok, why = prefill_available()
    if not ok:
        pytest.skip(why)
    if value == "fa3" and torch.cuda.get_device_capability(0)[0] != 9:
        pytest.skip("fa3 needs SM90")
    from vllm_metax.backend.flashinfer_prefill import FlashInferMLAPrefillBackend
    b = FlashInferMLAPrefillBackend(num_heads=HEADS, scale=scale(), kv_lora_rank=KV_LORA,
                                    qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                    v_head_dim=V_DIM, vllm_config=None)
    b.backend = value
    return b


def _vllm_torch_prefill():
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    return CPUSDPAMLAPrefillBackend(num_heads=HEADS, scale=scale(), kv_lora_rank=KV_LORA,
                                    qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                    v_head_dim=V_DIM, vllm_config=None)


@pytest.mark.parametrize("value", ["fa2", "fa3"])
def test_new_tokens_and_context_chunk_match_reference(value):
    dev = "cuda"
    b = _backend(value)
    md = prefill_metadata(Q_LENS, dev, chunk_kv_lens=CTX_LENS)
    b.prepare_metadata(md)
    assert b.backend == value, "planned with a fallback"
    q = ragged(Q_LENS, seed=1, device=dev)
    k = ragged(Q_LENS, seed=2, device=dev)
    v = ragged(Q_LENS, dim=V_DIM, seed=3, device=dev)
    out = torch.full((q.shape[0], HEADS, V_DIM), float("nan"), dtype=q.dtype, device=dev)
    o, lse = b.run_prefill_new_tokens(q, k, v, return_softmax_lse=True, out=out)
    ro, rl = reference(q, k, v, Q_LENS, Q_LENS, scale(), causal=True)
    assert o.data_ptr() == out.data_ptr() and not o.isnan().any()
    assert (o.double() - ro).abs().max() < 2e-2
    assert lse.shape == (HEADS, q.shape[0]) and (lse.double() - rl).abs().max() < 1e-2

    kc = ragged(CTX_LENS, seed=4, device=dev)
    vc = ragged(CTX_LENS, dim=V_DIM, seed=5, device=dev)
    co, cl = b.run_prefill_context_chunk(md.chunked_context.chunks[0], q, kc, vc)
    rco, rcl = reference(q, kc, vc, Q_LENS, CTX_LENS, scale(), causal=False)
    assert (co.double() - rco).abs().max() < 2e-2
    assert (cl.double() - rcl).abs().max() < 1e-2

    # vLLM's own torch prefill on the same inputs agrees with the FlashInfer one
    t = _vllm_torch_prefill()
    t.prepare_metadata(md)
    to = t.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
    assert (to.float() - o.float()).abs().max() < 2e-2


def test_prefill_is_selected_on_the_gpu_platform():
    from tests.plugin_support import ensure_metax_platform
    from vllm.v1.attention.backends.mla.prefill.base import MLADimensions
    from vllm.v1.attention.backends.mla.prefill.selector import MLAPrefillSelectorConfig
    p = ensure_metax_platform()
    cls = p.get_mla_prefill_backend_cls(MLAPrefillSelectorConfig(
        torch.bfloat16, MLADimensions(qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM)))
    from vllm_metax.backend.flashinfer_prefill import FlashInferMLAPrefillBackend
    assert cls is FlashInferMLAPrefillBackend
