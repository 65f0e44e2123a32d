"""The plugin's FLASHINFER_MLA on a real GPU through vLLM 0.33.0's own classes and the real FlashInfer
kernels: MetadataBuilder and Impl built as vLLM builds them (a VllmConfig for a small DeepSeek-shaped
model, the MLA KV-cache spec, the block table of a ragged batch), `build()` -> `_build_decode` ->
plan, `forward_mqa` -> run, compared with mla_tune.problem.reference; then a uniform batch under CUDA-graph
capture and replay with re-planned metadata.

On the GPU machine vLLM is carried as Python files only (no compiled ops, no vllm.platforms.cuda):
run with VLLM_METAX_FORCE=1 so the plugin is vLLM's platform.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import plugin_support as ps
from mla_tune.problem.reference import mla_decode_reference, relative_error
from vllm_metax.core import decisions, tuned_config as tc

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

TOL = 2e-2          # bf16 output against the fp32 reference
DEVICE = "cuda"


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    """The base VllmConfig (its ModelConfig is reused by every test)."""
    os.environ.setdefault("VLLM_METAX_FORCE", "1")
    tc.clear_cache()
    return ps.make_vllm_config(tmp_path_factory.mktemp("model"))


def _config(base, page_size, cudagraph=False, spec_tokens=0):
    from vllm.config import CacheConfig, CompilationConfig, SpeculativeConfig, VllmConfig

    kw = {}
    if spec_tokens:
        kw["speculative_config"] = SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens)
    return VllmConfig(model_config=base.model_config, cache_config=CacheConfig(block_size=page_size),
                      compilation_config=CompilationConfig(
                          cudagraph_mode="FULL_AND_PIECEWISE" if cudagraph else "PIECEWISE",
                          cudagraph_capture_sizes=[1, 2, 4, 8, 16]), **kw)


def _inputs(rows, num_pages, page_size, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(rows, ps.NUM_HEADS, ps.NOPE_DIM + ps.ROPE_DIM + ps.KV_LORA_RANK, device=DEVICE,
                    generator=g, dtype=torch.float32).to(torch.bfloat16)
    kv = torch.randn(num_pages, page_size, ps.KV_LORA_RANK + ps.ROPE_DIM, device=DEVICE,
                     generator=g, dtype=torch.float32).to(torch.bfloat16)
    # as vLLM's MLAAttention hands them over: ql_nope contiguous, q_pe a strided slice of q
    return q[..., 192:].contiguous(), q[..., 128:192], kv


def _reference(q_nope, q_pe, kv, block_table, seq_lens, q_len=1, return_lse=False):
    return mla_decode_reference(q_nope, q_pe, kv[..., :512], kv[..., 512:], block_table,
                                seq_lens, ps.softmax_scale(), q_len=q_len, return_lse=return_lse)


class _Meta:
    def __init__(self, decode):
        self.decode = decode


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("page_size", [64, 16])
def test_ragged_decode_through_vllm_classes(model_root, backend, page_size):
    vc = _config(model_root, page_size)
    builder = ps.make_builder(vc, device=DEVICE)
    builder.choice.backends = decisions.FlashInferBackends((backend,), backend)
    impl = ps.make_impl(vc)
    seq_lens = [1, 37, 200, 64, 1500, 9, 4096, 130]
    bt, lens, common, num_pages = ps.ragged_batch(seq_lens, page_size, device=DEVICE)
    md = builder.build(0, common)
    assert md.decode is not None and md.decode.backend == backend
    assert md.decode.kernel.resolved_backend == backend
    q_nope, q_pe, kv = _inputs(len(seq_lens), num_pages, page_size, seed=page_size)
    out, lse = impl.forward_mqa((q_nope, q_pe), kv, md, None)
    ref = _reference(q_nope, q_pe, kv, bt, lens)
    assert lse is None
    assert relative_error(out, ref) < TOL, relative_error(out, ref)

    # the next steps re-plan through the fast path; each must still match
    for step, lens2 in enumerate(([5, 80, 700, 3000, 64, 2, 999, 40], [4096] * 8, [17] * 5)):
        bt2, l2, common2, n2 = ps.ragged_batch(lens2, page_size, seed=step + 1, device=DEVICE)
        md2 = builder.build(0, common2)
        qn, qp, kv2 = _inputs(len(lens2), n2, page_size, seed=100 + step)
        out2, _ = impl.forward_mqa((qn, qp), kv2, md2, None)
        assert relative_error(out2, _reference(qn, qp, kv2, bt2, l2)) < TOL, step
    kernel = builder._kernels[backend]
    assert not md2.decode.paged.compact, "eager steps should hand FlashInfer the block table itself"
    if kernel.api == "keyword":          # FlashInfer 0.7; the flat 0.2.x API plans publicly
        assert kernel.fast_replans >= 2, "later steps did not use the fast re-plan"
    else:
        assert kernel.fast_replans == 0


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
def test_uniform_multi_token_decode_and_lse(model_root, backend):
    vc = _config(model_root, 64, spec_tokens=2)
    builder = ps.make_builder(vc, device=DEVICE)
    builder.choice.backends = decisions.FlashInferBackends((backend,), backend)
    builder.plan_lse = True                      # what decode context parallelism would set
    impl = ps.make_impl(vc)
    impl.need_to_return_lse_for_decode = True
    seq_lens = [3, 90, 700, 2048]
    bt, lens, _, num_pages = ps.ragged_batch(seq_lens, 64, q_len=3, device=DEVICE)
    qsl = torch.arange(0, 5 * 3, 3, dtype=torch.int32)
    decode = builder._build_decode(bt[:4], lens.to(DEVICE), max(seq_lens), qsl, qsl.to(DEVICE), 12, 3, None)
    q_nope, q_pe, kv = _inputs(12, num_pages, 64, seed=7)
    out, lse = impl.forward_mqa((q_nope, q_pe), kv, _Meta(decode), None)
    ref, ref_lse = _reference(q_nope, q_pe, kv, bt, lens, q_len=3, return_lse=True)
    assert relative_error(out, ref) < TOL
    torch.testing.assert_close(lse * math.log(2), ref_lse, rtol=2e-3, atol=2e-2)


def test_full_cudagraph_capture_and_replay(model_root):
    vc = _config(model_root, 64, cudagraph=True)
    builder = ps.make_builder(vc, device=DEVICE)
    impl = ps.make_impl(vc)
    batch, num_pages = 8, 800
    static_q = torch.zeros(batch, ps.NUM_HEADS, 576, dtype=torch.bfloat16, device=DEVICE)
    static_kv = torch.zeros(num_pages, 64, 576, dtype=torch.bfloat16, device=DEVICE)

    def step(seq_lens, seed):
        bt, lens, common, _ = ps.ragged_batch(seq_lens, 64, num_pages=num_pages, seed=seed,
                                              device=DEVICE)
        md = builder.build(0, common)
        q_nope, q_pe, kv = _inputs(batch, num_pages, 64, seed=seed)
        static_q[..., :512].copy_(q_nope)
        static_q[..., 512:].copy_(q_pe)
        static_kv.copy_(kv)
        return md, bt, lens

    def forward(md):
        return impl.forward_mqa((static_q[..., :512], static_q[..., 512:]), static_kv, md, None)[0]

    md, bt, lens = step([100, 7, 3000, 64, 1, 512, 2047, 900], seed=1)
    assert md.decode.cuda_graph and md.decode.kernel.use_cuda_graph
    eager = forward(md)                                     # JIT and warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out = forward(md)
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference(static_q[..., :512], static_q[..., 512:], static_kv, bt, lens)
    assert relative_error(eager, ref) < TOL and relative_error(captured_out, ref) < TOL

    # next steps: new lengths, pages and queries; re-plan into the same buffers, replay the graph
    for seed, seq_lens in ((2, [4096, 4096, 1, 1, 70, 800, 33, 1000]), (3, [5] * 8),
                           (4, [2000, 10, 10, 10, 10, 10, 10, 3500])):
        md2, bt2, lens2 = step(seq_lens, seed)
        assert md2.decode.kernel is md.decode.kernel
        graph.replay()
        torch.cuda.synchronize()
        ref2 = _reference(static_q[..., :512], static_q[..., 512:], static_kv, bt2, lens2)
        assert relative_error(captured_out, ref2) < TOL, seed
    kernel = next(iter(builder._graph_kernels.values()))
    if kernel.api == "keyword":          # FlashInfer 0.7; the flat 0.2.x API plans publicly
        assert kernel.fast_replans >= 3
    else:
        assert kernel.fast_replans == 0


def test_vllm_selects_flashinfer_mla_here(model_root):
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from vllm_metax.platform import FLASHINFER_MLA_CLASS
    from vllm_metax.platform import MetaxPlatform

    assert isinstance(current_platform, MetaxPlatform)
    sel = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                  block_size=None, use_mla=True)
    with set_current_vllm_config(_config(model_root, 64)):
        assert current_platform.get_attn_backend_cls(None, sel, ps.NUM_HEADS) == FLASHINFER_MLA_CLASS
