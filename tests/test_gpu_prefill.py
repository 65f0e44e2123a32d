"""The plugin's MLA prefill on a real GPU (run on the H200: pytest -m gpu): FlashInfer's ragged
prefill through vllm_metax's prefill backend, for the new tokens (causal, ragged requests) and a
context chunk (non-causal, natural-log LSE as vLLM merges chunks), against a float64 reference and
against vLLM's own torch prefill on the same tensors; fa2 and, on Hopper, fa3 and vLLM's FA3
varlen prefill (vllm_fa3, where vLLM's FA3 library is installed). Then the tuned
prefill backend: every candidate of the tuner's `flashinfer_prefill` family through the real
kernel against the tuner's reference, and the plugin planning a tuned config's prefill buckets
with the real FlashInfer, each plan the backend its bucket names (where the device runs it)."""

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
    if value == "vllm_fa3":
        from vllm_metax.ops.fa3_prefill import fa3_available
        ok, why = fa3_available()
        if not ok:
            pytest.skip(why)
    from vllm_metax.backend.flashinfer_prefill import FlashInferMLAPrefillBackend
    b = FlashInferMLAPrefillBackend(num_heads=HEADS, scale=scale(), kv_lora_rank=KV_LORA,
                                    qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                    v_head_dim=V_DIM, vllm_config=None)
    from vllm_metax.core import decisions
    b.backends = decisions.FlashInferBackends((value,), value)     # plan this value only
    return b


def _vllm_torch_prefill():
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    return CPUSDPAMLAPrefillBackend(num_heads=HEADS, scale=scale(), kv_lora_rank=KV_LORA,
                                    qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                    v_head_dim=V_DIM, vllm_config=None)


@pytest.mark.parametrize("value", ["fa2", "fa3", "vllm_fa3"])
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


# ---------------------------------------------------------------- the tuned prefill backend

def _prefill_here():
    from vllm_metax.ops.flashinfer_prefill import prefill_available
    ok, why = prefill_available()
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("causal, q, kv, n", [(True, 256, 64, 4), (True, 512, 512, 1),
                                              (False, 256, 4096, 1), (False, 128, 1000, 2)])
def test_every_prefill_family_candidate_matches_the_reference(causal, q, kv, n):
    """The tuner's family runs the plugin's op on the real kernel: every backend it declares
    passes the correctness gate (poisoned output, sampled rows, LSE for a chunk) and is timed."""
    _prefill_here()
    from mla_tune.families.flashinfer_prefill import FlashInferPrefillFamily
    from mla_tune.measure.prefill_trial import measure_prefill
    from mla_tune.measure.trial import MeasureSettings
    from mla_tune.problem.prefill import PrefillWorkload
    from vllm_metax.ops.device_backends import device_prefill_backends
    fam = FlashInferPrefillFamily()
    w = PrefillWorkload(HEADS, KV_LORA, ROPE, scale(), causal, q, kv, n)
    space = fam.space(w)
    assert [c.backend for c in space] == list(device_prefill_backends().allowed)
    if torch.cuda.get_device_capability(0)[0] == 9:
        from vllm_metax.ops.fa3_prefill import fa3_available
        assert {c.backend for c in space} == {"fa2", "fa3"} | ({"vllm_fa3"} if fa3_available()[0] else set())
    res = measure_prefill([(fam, c) for c in space], w,
                          MeasureSettings(device="cuda", warmup=1, samples=6, plan_samples=2), rounds=2)
    for c, r in zip(space, res):
        assert r.status == "ok", (c.key, r.invalid_reason, r.message)
        assert r.max_rel_error < 2e-2 and len(r.samples["kernel_us"]) == 6


def test_the_plugin_plans_the_tuned_prefill_backend_with_real_flashinfer(tmp_path, monkeypatch):
    _prefill_here()
    import os
    import plugin_support as ps
    from vllm_metax.core import tuned_config as tc
    from vllm_metax.ops import device_backends
    from vllm_metax.backend.flashinfer_prefill import FlashInferMLAPrefillBackend
    from vllm_metax.core.device import detect_device
    os.environ.setdefault("VLLM_METAX_FORCE", "1")
    dev = detect_device()
    here = device_backends.device_prefill_backends()
    # fa2, fa3 and vllm_fa3 each in a bucket of either kind, whatever bench measured
    buckets = [tc.PrefillBucket(True, 256, 64, {"backend": "fa2"}),
               tc.PrefillBucket(True, 256, 256, {"backend": "fa3"}),
               tc.PrefillBucket(True, 512, 512, {"backend": "vllm_fa3"}),
               tc.PrefillBucket(False, 256, 16384, {"backend": "fa2"}),
               tc.PrefillBucket(False, 256, 1024, {"backend": "fa3"}),
               tc.PrefillBucket(False, 512, 4096, {"backend": "vllm_fa3"})]
    dims = tc.ModelDims(HEADS, KV_LORA, ROPE, "bfloat16", "bfloat16")
    decode = [tc.Bucket(8, 4096, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa2"})})]
    tc.write_tuned_config(tc.TunedConfig(dev.name, {"test": True}, [
        tc.ModelEntry(dims, 64, ["FLASHINFER_MLA"], decode, prefill=buckets)]), tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()
    try:
        cfg = ps.make_vllm_config(tmp_path / "model", block_size=64)
        b = FlashInferMLAPrefillBackend(num_heads=HEADS, scale=scale(), kv_lora_rank=KV_LORA,
                                        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                        v_head_dim=V_DIM, vllm_config=cfg)
        assert b.entry is not None and len(b.entry.prefill) == 6

        def served(value):
            return value if value in here.allowed else here.default

        for q_lens, ctx, new_backend, ctx_backend in (
                ([16, 48, 64, 128], [8192] * 4, "fa2", "fa2"),     # (256, 64); chunk (256, 8192)
                ([256], [1000], "fa3", "fa3"),                     # (256, 256); chunk (256, 1000)
                ([512], [4096], "vllm_fa3", "vllm_fa3")):          # (512, 512); chunk (512, 4096)
            md = prefill_metadata(q_lens, "cuda", chunk_kv_lens=ctx)
            b.prepare_metadata(md)
            assert b._main.backend == served(new_backend)
            assert b._chunks[0].backend == served(ctx_backend)
            q = ragged(q_lens, seed=1, device="cuda")
            k = ragged(q_lens, seed=2, device="cuda")
            v = ragged(q_lens, dim=V_DIM, seed=3, device="cuda")
            o = b.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
            ro, _ = reference(q, k, v, q_lens, q_lens, scale(), causal=True)
            assert (o.double() - ro).abs().max() < 2e-2
            kc = ragged(ctx, seed=4, device="cuda")
            vc = ragged(ctx, dim=V_DIM, seed=5, device="cuda")
            co, cl = b.run_prefill_context_chunk(md.chunked_context.chunks[0], q, kc, vc)
            rco, rcl = reference(q, kc, vc, q_lens, ctx, scale(), causal=False)
            assert (co.double() - rco).abs().max() < 2e-2 and (cl.double() - rcl).abs().max() < 1e-2
    finally:
        tc.clear_cache()
