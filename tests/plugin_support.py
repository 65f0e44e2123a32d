"""Shared set-up for the vllm_metax plugin tests: a DeepSeek-shaped model directory, a VllmConfig
with the plugin as vLLM's current platform, the layer a metadata builder reads, vLLM's common
attention metadata for a ragged decode batch, a recording FlashInfer stand-in that computes
with the torch reference from exactly the CSR metadata it was planned with, and a stand-in for
MetaX's `flash_mla` package (FlashMLA 1.0's interface) that does the same.

Everything here runs with the real vllm==0.33.0; no GPU and no FlashInfer are needed.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
import types
from types import SimpleNamespace

import torch

from bench_support import load_bench
from mla_tune.problem.reference import mla_decode_reference

# DeepSeek-V2-Lite's attention (16 heads, YaRN) with a toy MLP, so the config is small: bench's
# tiny DeepSeek (bench/tiny_model.py) with two layers and V2-Lite's long-context YaRN scaling.
MODEL_CONFIG = {
    **load_bench("tiny_model").BASE_CONFIG,
    "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 163840,
    "first_k_dense_replace": 1,
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
}
NUM_HEADS, KV_LORA_RANK, ROPE_DIM, NOPE_DIM, V_DIM = 16, 512, 64, 128, 128


def softmax_scale() -> float:
    """What DeepSeek-V2's attention passes to MLAAttention: 1/sqrt(192) * mscale^2 (YaRN)."""
    m = 0.1 * 0.707 * math.log(40) + 1.0
    return (NOPE_DIM + ROPE_DIM) ** -0.5 * m * m


def model_dir(root: Path, **overrides) -> Path:
    d = Path(root) / ("dsmodel-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items())))
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**MODEL_CONFIG, **overrides}))
    return d


def ensure_metax_platform():
    """Make vllm_metax's platform vLLM's current platform in this process and return it.

    vLLM resolves `current_platform` once per process; when another test resolved it first
    (without the force variable), swap the instance everywhere it was imported by name.
    """
    from vllm_metax.core.device import FORCE_ENV
    import vllm.platforms as vp

    from vllm_metax.platform import MetaxPlatform

    if vp._current_platform is None:
        old = os.environ.get(FORCE_ENV)
        os.environ[FORCE_ENV] = "1"
        try:
            vp.current_platform  # noqa: B018 - resolves through the plugin entry point
        finally:
            if old is None:
                del os.environ[FORCE_ENV]
            else:
                os.environ[FORCE_ENV] = old
    old = vp._current_platform
    if not isinstance(old, MetaxPlatform):
        new = MetaxPlatform()
        vp._current_platform = new
        for mod in list(sys.modules.values()):
            if getattr(mod, "current_platform", None) is old:
                setattr(mod, "current_platform", new)
    return vp._current_platform


def make_vllm_config(root: Path, block_size: int | None = None, cache_dtype: str = "auto",
                     cudagraph_mode: str | None = None, **model_overrides):
    """A VllmConfig for the small DeepSeek-shaped model, built as `vllm serve` would."""
    ensure_metax_platform()
    from vllm.config import CacheConfig, CompilationConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(model_dir(root, **model_overrides)), tokenizer=None,
                     skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192)
    kwargs = {}
    if cudagraph_mode is not None:
        kwargs["compilation_config"] = CompilationConfig(cudagraph_mode=cudagraph_mode,
                                                         cudagraph_capture_sizes=[1, 2, 4, 8])
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=block_size,
                                                                cache_dtype=cache_dtype), **kwargs)


class _PrefillBackend:
    def clone(self):
        return self

    def get_name(self):
        return "STAND_IN"

    def prepare_metadata(self, prefill_metadata):
        self.prepared = prefill_metadata


def stand_in_layer(scale: float | None = None):
    """What a metadata builder reads from vLLM's static forward context for one MLA layer."""
    return SimpleNamespace(q_lora_rank=None, kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=NOPE_DIM,
                           qk_rope_head_dim=ROPE_DIM, v_head_dim=V_DIM, num_heads=NUM_HEADS,
                           scale=softmax_scale() if scale is None else scale,
                           non_causal_multi_token_decode=False, prefill_backend=_PrefillBackend())


def kv_cache_spec(vllm_config):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=vllm_config.cache_config.block_size, num_kv_heads=1,
                            head_size=KV_LORA_RANK + ROPE_DIM, dtype=torch.bfloat16,
                            max_tp_shards=1, cache_dtype_str="auto")


def make_builder(vllm_config, device="cpu", layer_name="model.layers.0.self_attn.attn", scale=None):
    """The plugin's metadata builder, constructed as vLLM's GPU model runner constructs it."""
    from vllm.config import set_current_vllm_config

    from vllm_metax.backend.flashinfer_mla import FlashInferMLABackend

    vllm_config.compilation_config.static_forward_context[layer_name] = stand_in_layer(scale)
    with set_current_vllm_config(vllm_config):
        return FlashInferMLABackend.get_builder_cls()(kv_cache_spec(vllm_config), [layer_name],
                                                      vllm_config, torch.device(device))


def make_impl(vllm_config, scale=None, **overrides):
    from vllm.config import set_current_vllm_config

    from vllm_metax.backend.flashinfer_mla import FlashInferMLABackend

    args = dict(num_heads=NUM_HEADS, head_size=KV_LORA_RANK + ROPE_DIM,
                scale=softmax_scale() if scale is None else scale, num_kv_heads=1,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                attn_type="decoder", kv_sharing_target_layer_name=None, q_lora_rank=None,
                kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=NOPE_DIM, qk_rope_head_dim=ROPE_DIM,
                qk_head_dim=NOPE_DIM + ROPE_DIM, v_head_dim=V_DIM, kv_b_proj=None)
    args.update(overrides)
    with set_current_vllm_config(vllm_config):
        return FlashInferMLABackend.get_impl_cls()(**args)


def ragged_batch(seq_lens, page_size, q_len=1, extra_rows=0, num_pages=None, seed=0,
                 device="cpu"):
    """A shuffled block table covering `seq_lens` (block 0 is vLLM's null block) and vLLM's
    CommonAttentionMetadata for a decode batch of uniform q_len. `extra_rows` adds rows past the
    batch (the persistent block table is wider than the step)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    pages = [-(-s // page_size) for s in seq_lens]
    width = max(pages) + 2
    total = sum(pages)
    num_pages = num_pages or total + 8
    ids = (torch.randperm(num_pages - 1, generator=g)[:total] + 1).to(torch.int32)
    block_table = torch.zeros(batch + extra_rows, width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        block_table[b, :n] = ids[start:start + n]
        start += n
    block_table[batch:] = 7            # rows past the batch must never be read
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    qsl = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl, seq_lens=lens.to(device),
        num_reqs=batch, num_actual_tokens=batch * q_len, max_query_len=q_len,
        max_seq_len=max(seq_lens), block_table_tensor=block_table[:batch].to(device),
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64, device=device),
        seq_lens_cpu_upper_bound=lens.clone())
    return block_table.to(device), lens, common, num_pages


def side_kernel_entry(family: str, params: dict, batches=(1, 2, 8)):
    """A tuned entry whose every bucket (`batches` x 256/4096 context) names `family` with
    `params`, 1.5x faster than FlashInfer's fa3 choice: the buckets FLASHINFER_MLA's decode then
    serves with that side kernel (split, FA3 or FlashMLA)."""
    from vllm_metax.core import tuned_config as tc

    dims = tc.ModelDims(NUM_HEADS, KV_LORA_RANK, ROPE_DIM, "bfloat16", "bfloat16")
    buckets = [tc.Bucket(b, c, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa3"}, time_us=30.0),
                                   family: tc.FamilyChoice(dict(params), time_us=20.0)}, family)
               for b in batches for c in (256, 4096)]
    return tc.ModelEntry(dims, 64, ["FLASHINFER_MLA", "TRITON_MLA"], buckets)


def page64_config(base, cudagraph: bool):
    """`base`'s model at KV page 64, with full CUDA graphs for decode (capture sizes 1-8) or
    piecewise ones only."""
    from vllm.config import CacheConfig, CompilationConfig, VllmConfig

    return VllmConfig(model_config=base.model_config, cache_config=CacheConfig(block_size=64),
                      compilation_config=CompilationConfig(
                          cudagraph_mode="FULL_AND_PIECEWISE" if cudagraph else "PIECEWISE",
                          cudagraph_capture_sizes=[1, 2, 4, 8]))


def decode_inputs(rows, num_pages, seed, device="cuda"):
    """A seeded bf16 query (`rows` x NUM_HEADS x 576) and page-64 latent+rope KV cache."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(rows, NUM_HEADS, 576, device=device, generator=g).to(torch.bfloat16)
    kv = torch.randn(num_pages, 64, 576, device=device, generator=g).to(torch.bfloat16)
    return q, kv


class GraphStep:
    """vLLM's persistent buffers a captured decode graph reads on every replay (block table,
    lengths, query, KV cache), for `batch` requests at page 64. Calling it builds one step's
    metadata with `builder` into those buffers and fills the query and cache (decode_inputs);
    it returns (metadata, the step's block table, lengths)."""

    def __init__(self, builder, batch=8, num_pages=900, width=96, device="cuda"):
        self.builder, self.batch, self.num_pages, self.device = builder, batch, num_pages, device
        self.bt = torch.zeros(batch + 4, width, dtype=torch.int32, device=device)
        self.lens = torch.zeros(batch + 4, dtype=torch.int32, device=device)
        self.q = torch.zeros(batch, NUM_HEADS, 576, dtype=torch.bfloat16, device=device)
        self.kv = torch.zeros(num_pages, 64, 576, dtype=torch.bfloat16, device=device)

    def __call__(self, seq_lens, seed):
        n = self.batch
        bt, lens, common, _ = ragged_batch(seq_lens, 64, num_pages=self.num_pages, seed=seed,
                                           device=self.device)
        self.bt.zero_()
        self.bt[:n, :bt.shape[1]].copy_(bt[:n])
        self.lens[:n].copy_(lens.to(self.device))
        common.block_table_tensor = self.bt[:n]
        common.seq_lens = self.lens[:n]
        md = self.builder.build(0, common)
        q, kv = decode_inputs(n, self.num_pages, seed, self.device)
        self.q.copy_(q)
        self.kv.copy_(kv)
        return md, self.bt[:n].clone(), lens

    def forward(self, impl, md):
        """One layer's decode output on the static buffers."""
        return impl.forward_mqa((self.q[..., :512], self.q[..., 512:]), self.kv, md, None)[0]


def build_decode(builder, seq_lens, page_size, q_len=1, extra_rows=2, seed=0, device="cpu"):
    """A builder's `_build_decode` called with what vLLM's MLA build() passes for a decode batch
    of `seq_lens` (`ragged_batch`); (metadata, block table, lengths, pages in the cache)."""
    bt, lens, common, num_pages = ragged_batch(seq_lens, page_size, q_len, extra_rows, seed=seed, device=device)
    n = len(seq_lens)
    md = builder._build_decode(
        block_table_tensor=bt[:n], seq_lens_device=common.seq_lens, max_seq_len=max(seq_lens),
        query_start_loc_cpu=common.query_start_loc_cpu, query_start_loc_device=common.query_start_loc,
        num_decode_tokens=n * q_len, max_query_len=q_len, dcp_tot_seq_lens_device=None)
    return md, bt, lens, num_pages


def install_recording_plugin(monkeypatch, device, *more_modules):
    """The plugin on a pretend `device` (a DeviceInfo) with FlashInfer's wrapper replaced by
    RecordingKernel and no decode workspace; `more_modules` also see the pretend device.
    Returns the FLASHINFER_MLA backend module."""
    import vllm_metax.backend as backend_pkg
    import vllm_metax.backend.flashinfer_mla as fb
    import vllm_metax.platform as P
    from vllm_metax.core import device as device_mod

    ensure_metax_platform()
    RecordingKernel.instances.clear()
    monkeypatch.setattr(fb, "MLADecodeKernel", RecordingKernel)
    monkeypatch.setattr(fb, "shared_workspace", lambda device: torch.empty(16, dtype=torch.uint8))
    for mod in (device_mod, backend_pkg, P, *more_modules):
        monkeypatch.setattr(mod, "detect_device", lambda: device)
    return fb


class RecordingKernel:
    """Stand-in for vllm_metax.ops.flashinfer_mla.MLADecodeKernel on the CPU.

    Records construction and every plan; run() computes MLA with the torch reference from the
    planned CSR metadata (kv_indptr/kv_indices -> per-request page lists), and returns a base-2
    LSE as FlashInfer does.
    """

    instances: list = []

    def __init__(self, workspace, backend="auto", use_cuda_graph=False, graph_buffers=None,
                 api=None, flashinfer=None):
        self.backend, self.use_cuda_graph, self.graph_buffers = backend, use_cuda_graph, graph_buffers
        self.api = "flat"
        self.plans: list = []
        self.runs: list = []
        RecordingKernel.instances.append(self)

    @property
    def resolved_backend(self):
        return self.backend

    def plan(self, meta, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
             q_dtype, kv_dtype, *, return_lse=False, layout=None, kv_chunk=None):
        self.plans.append(dict(meta=meta, num_heads=num_heads, head_dim_ckv=head_dim_ckv,
                               head_dim_kpe=head_dim_kpe, page_size=page_size, causal=causal,
                               sm_scale=sm_scale, q_dtype=q_dtype, kv_dtype=kv_dtype,
                               return_lse=return_lse, kv_chunk=kv_chunk))

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        p = self.plans[-1]
        self.runs.append(dict(q_nope=q_nope, q_pe=q_pe, ckv=ckv_cache, kpe=kpe_cache))
        meta = p["meta"]
        indptr = meta.kv_indptr.tolist()
        batch = len(indptr) - 1
        q_len = int(meta.qo_indptr[1] - meta.qo_indptr[0])
        table = torch.zeros(batch, max(indptr[i + 1] - indptr[i] for i in range(batch)) or 1,
                            dtype=torch.int64)
        for b in range(batch):
            row = meta.kv_indices[indptr[b]:indptr[b + 1]].long()
            table[b, : row.shape[0]] = row
        res, lse_e = mla_decode_reference(q_nope, q_pe, ckv_cache, kpe_cache, table, meta.kv_len,
                                          p["sm_scale"], q_len=q_len, return_lse=True)
        if out is not None:
            out.copy_(res)
            res = out
        return (res, lse_e / math.log(2)) if return_lse else res


class FakeFlashMLA:
    """The flash_mla package's interface (FlashMLA 1.0: get_mla_metadata,
    flash_mla_with_kvcache), recording calls and computing with the torch reference."""

    def __init__(self):
        self.metadata_calls, self.fwd_calls = [], []
        self.module = types.ModuleType("flash_mla")
        self.module.get_mla_metadata = self.get_mla_metadata
        self.module.flash_mla_with_kvcache = self.flash_mla_with_kvcache

    def get_mla_metadata(self, cache_seqlens, num_q_tokens_per_head_k, num_heads_k):
        self.metadata_calls.append((cache_seqlens.tolist(), num_q_tokens_per_head_k, num_heads_k))
        return (torch.full((4, 8), len(self.metadata_calls), dtype=torch.int32),
                torch.zeros(cache_seqlens.shape[0] + 1, dtype=torch.int32))

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v,
                               tile_scheduler_metadata, num_splits, softmax_scale=None, causal=False):
        self.fwd_calls.append(dict(q_shape=tuple(q.shape), k_shape=tuple(k_cache.shape),
                                   block_table=block_table, seq_lens=cache_seqlens.tolist(),
                                   head_dim_v=head_dim_v, tsm=int(tile_scheduler_metadata[0, 0]),
                                   scale=softmax_scale, causal=causal))
        b, s_q, h, d = q.shape
        kv = k_cache.squeeze(-2)
        rows = q.reshape(b * s_q, h, d)
        out, lse = mla_decode_reference(rows[..., :head_dim_v], rows[..., head_dim_v:],
                                        kv[..., :head_dim_v], kv[..., head_dim_v:], block_table,
                                        cache_seqlens, softmax_scale, q_len=s_q, return_lse=True)
        return out.reshape(b, s_q, h, head_dim_v), lse.reshape(b, s_q, h).permute(0, 2, 1)


def engine_core_probe(vllm_config, queue) -> None:
    """Run in a process vLLM's way (its multiprocessing context, the VllmConfig handed over):
    which platform resolves there, and which tuned config and entry it serves."""
    import vllm.platforms as vp

    from vllm_metax.core import tuned_config as tc
    from vllm_metax.core.device import detect_device

    platform = vp.current_platform
    cfg = tc.load_tuned_config(detect_device().name)
    entry = platform.tuned_entry_for_config(vllm_config) if hasattr(platform, "tuned_entry_for_config") else None
    queue.put({"platform": f"{type(platform).__module__}.{type(platform).__qualname__}",
               "config": cfg.path if cfg is not None else None,
               "page_size": entry.page_size if entry is not None else None,
               "block_size": vllm_config.cache_config.block_size})
