"""FlashMLA's dense decode kernel (DeepSeek's FlashMLA, as vLLM builds it into `vllm/_flashmla_C`),
without importing vllm: the op the plugin's FLASHMLA backend runs and the tuner measures.

vLLM's own FLASHMLA backend reaches the kernel through `vllm.v1.attention.ops.flashmla`, which
loads `vllm._flashmla_C` only when `current_platform.is_cuda()`: on an out-of-tree platform such
as `metax` it reports FlashMLA unavailable even where the library and a Hopper GPU are there.
Here the library is found next to the installed vllm package (`importlib.util.find_spec`, which
does not execute vllm) and loaded with `torch.ops.load_library`: vLLM 0.33.0 builds it against
torch's stable C ABI (it imports only `aoti_torch_*` symbols), so one build serves several torch
versions. The op is `torch.ops._flashmla_C.dense_decode_fwd(q, k_cache, head_dim_v,
cache_seqlens, block_table, softmax_scale, causal, tile_scheduler_metadata, num_splits, out)
-> (out, lse, tile_scheduler_metadata, num_splits)`, the call vLLM's
`flash_mla_with_kvcache` makes for dense (not sparse) attention.

The schedule: with `tile_scheduler_metadata = None` the op first computes the split schedule on
the GPU from `cache_seqlens` (one small kernel) and returns it; a later call with the same
sequence lengths passes it back and only attends. A decode step therefore schedules once (its
first layer) and every other layer reuses the schedule, as vLLM's backend does with a fresh
FlashMLASchedMeta per step. `FlashMLADecode.new_step()` forgets the schedule.

Constraints (FlashMLA's): page (KV block) size 64, head dim 576 (kv_lora_rank 512 + rope 64),
head_dim_v 512, q and KV of one 16-bit dtype, Hopper (compute capability 9.x: the dense kernels
of this build are sm_90a only). MetaX's FlashMLA port is a different library; where this one is
missing, `flashmla_available()` says so and FLASHMLA is not chosen.
"""

from __future__ import annotations

import torch

from vllm_metax.core.tuned_config import FLASHMLA_PAGE_SIZE as PAGE_SIZE   # FlashMLA's only KV block size
from vllm_metax.ops.vllm_library import VllmLibrary

HEAD_DIM = 576                 # kv_lora_rank + qk_rope_head_dim
HEAD_DIM_V = 512               # kv_lora_rank
LIBRARY_GLOB = "_flashmla_C*.so"
OP_NAMESPACE = "_flashmla_C"

_LIBRARY = VllmLibrary("", LIBRARY_GLOB, OP_NAMESPACE, ("dense_decode_fwd",),
                       "vllm's FlashMLA library (vllm/_flashmla_C*.so)")


library_path = _LIBRARY.path      # the library beside the installed vllm (None if absent)
load_library = _LIBRARY.load      # load its ops once per process: (loaded, why not); never raises


def flashmla_available(device=None, capability: tuple | None = None) -> tuple[bool, str]:
    """(FlashMLA dense decode can run here, why not). `capability` overrides the device's
    (tests); the library is only loaded once a CUDA device qualifies."""
    if capability is None:
        if not torch.cuda.is_available():
            return False, "FlashMLA needs a CUDA device (torch sees none)"
        capability = tuple(torch.cuda.get_device_capability(device))
    if capability[0] != 9:
        return False, (f"FlashMLA's dense decode kernels are built for Hopper (sm_90a); this device "
                       f"is compute capability {capability[0]}.{capability[1]}")
    return load_library()


def check_shapes(num_heads: int, kv_lora_rank: int, rope_dim: int, page_size: int,
                 q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """Why FlashMLA cannot run this geometry, or None."""
    if page_size != PAGE_SIZE:
        return f"FlashMLA needs KV block size {PAGE_SIZE}, not {page_size}"
    if kv_lora_rank + rope_dim != HEAD_DIM or kv_lora_rank != HEAD_DIM_V:
        return (f"FlashMLA needs kv_lora_rank {HEAD_DIM_V} + rope {HEAD_DIM - HEAD_DIM_V}, "
                f"not {kv_lora_rank} + {rope_dim}")
    if q_dtype != kv_dtype or q_dtype not in (torch.bfloat16, torch.float16):
        return f"FlashMLA needs bf16 or fp16 q and KV of one dtype, not {q_dtype} / {kv_dtype}"
    if num_heads < 1:
        return "FlashMLA needs at least one head"
    return None


class FlashMLADecode:
    """One layer-independent decode op: `run` attends with the step's schedule, computing it on
    the step's first call. CUDA-graph capturable once a schedule exists or is computed inside
    the captured call (its tensors then live in the graph's pool)."""

    def __init__(self, softmax_scale: float, causal: bool = False):
        ok, why = load_library()
        if not ok:
            raise RuntimeError(why)
        self._fwd = getattr(torch.ops, OP_NAMESPACE).dense_decode_fwd   # resolved once, not per layer
        self.softmax_scale = float(softmax_scale)
        self.causal = bool(causal)
        self.tile_scheduler_metadata: torch.Tensor | None = None
        self.num_splits: torch.Tensor | None = None
        self._stale = True

    def new_step(self) -> None:
        """The next call schedules afresh (new sequence lengths). Where the new schedule has the
        old one's shapes it is copied into the old tensors, so a CUDA graph captured with them
        replays the new schedule (the tensors' addresses never change within one batch shape)."""
        self._stale = True

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor | None = None):
        """q [B, q_len, H, 576], kv_cache [pages, 64, 576] (vLLM's layout), block_table int32
        [B, max_pages], seq_lens int32 [B] on the device; out [B, q_len, H, 512] (contiguous) or
        None. Returns (out, lse [B, H, q_len])."""
        stale = self._stale
        o, lse, tsm, ns = self._fwd(
            q, kv_cache.unsqueeze(-2), HEAD_DIM_V, seq_lens, block_table, self.softmax_scale,
            self.causal, None if stale else self.tile_scheduler_metadata,
            None if stale else self.num_splits, out)
        if stale:
            old_t, old_n = self.tile_scheduler_metadata, self.num_splits
            if (old_t is not None and old_n is not None and old_t.shape == tsm.shape
                    and old_n.shape == ns.shape):
                old_t.copy_(tsm)
                old_n.copy_(ns)
            else:
                self.tile_scheduler_metadata, self.num_splits = tsm, ns
            self._stale = False
        return o, lse


__all__ = ["FlashMLADecode", "HEAD_DIM", "HEAD_DIM_V", "PAGE_SIZE", "check_shapes",
           "flashmla_available", "library_path", "load_library"]
