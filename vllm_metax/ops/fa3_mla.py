"""vLLM's FA3 MLA decode kernel (the kernel of its FLASH_ATTN_MLA backend, vLLM's own default on
Hopper), without importing vllm: the op the tuner measures as the `fa3_mla` family and the plugin
serves in the buckets a tuned config gives it.

vLLM reaches the kernel through `vllm.vllm_flash_attn.flash_attn_varlen_func(..., fa_version=3)`
and its FLASH_ATTN_MLA backend is offered only on vLLM's own CUDA platform
(`fa_utils.flash_attn_supports_mla` checks `current_platform.is_cuda()`). Here the library,
`vllm/vllm_flash_attn/_vllm_fa3_C*.so`, is found beside the installed vllm package
(`importlib.util.find_spec`, which does not execute vllm) and loaded with
`torch.ops.load_library`: vLLM 0.33.0 builds it against torch's stable C ABI (its only torch
symbols are `aoti_torch_*` and `torch_call_dispatcher`), so one build serves several torch
versions. The two ops and their positional arguments are the ones vLLM's wrapper passes:
`_vllm_fa3_C.get_scheduler_metadata(...)` and `_vllm_fa3_C.fwd(...)` (vllm/vllm_flash_attn/
flash_attn_interface.py, vLLM 0.33.0).

The MLA call, as vLLM's FlashAttnMLAImpl.forward_mqa makes it: q = q_pe [T, H, 64] (the rope
part), k = the cache's rope columns [pages, page, 1, 64], v = its latent columns
[pages, page, 1, 512], q_v = q_nope [T, H, 512], out [T, H, 512]; `seqused_k` the sequence
lengths, `cu_seqlens_q` the query starts, `block_table` the pages, causal.

Knobs (the tuner's): `num_splits` (0: FA3's own split heuristic; n: at most n KV splits) and
`schedule` ("aot": the scheduler metadata is computed once per step by FA3's scheduler kernel and
every layer reuses it, as vLLM does; "none": each call schedules inside the kernel launch).
Under CUDA graphs the metadata lives in one persistent buffer (1 + round_up(max_batch, 4) * 4
int32, the rest zeroed), as vLLM's builder keeps it.

Constraints: Hopper (compute capability 9.x: the library is sm_90a only), bf16 or fp16 q and KV of
one dtype, page (block) size a multiple of 16, head dims 512 + 64. Where the library is absent
(every non-Hopper GPU, MetaX included) `fa3_available()` says why and nothing is offered.
"""

from __future__ import annotations

import torch

from vllm_metax.core.choices import FA3, SPECS
from vllm_metax.ops.vllm_library import VllmLibrary, hopper_reason

LIBRARY_GLOB = "_vllm_fa3_C*.so"
OP_NAMESPACE = "_vllm_fa3_C"
HEAD_DIM_V = 512             # kv_lora_rank
ROPE_DIM = 64                # qk_rope_head_dim
PAGES = SPECS[FA3].page       # the KV block sizes it runs at (the spec's)
SCHEDULES = ("aot", "none")
GRAPH_SPLITS = 32            # vLLM's flash_attn_max_num_splits_for_cuda_graph: the bound in graphs

_LIBRARY = VllmLibrary("vllm_flash_attn", LIBRARY_GLOB, OP_NAMESPACE, ("fwd", "get_scheduler_metadata"),
                       "vllm's FA3 library (vllm/vllm_flash_attn/_vllm_fa3_C*.so)")


library_path = _LIBRARY.path      # the library beside the installed vllm (None if absent)
load_library = _LIBRARY.load      # load its ops once per process: (loaded, why not); never raises


def fa3_available(device=None, capability: tuple | None = None) -> tuple[bool, str]:
    """(vLLM's FA3 MLA decode can run here, why not). `capability` overrides the device's (tests);
    the library is only loaded once a CUDA device qualifies."""
    why = hopper_reason("vLLM's FA3", "vLLM's FA3 kernels", device, capability)
    if why:
        return False, why
    return load_library()


def check_shapes(kv_lora_rank: int, rope_dim: int, page_size: int, q_dtype: torch.dtype,
                 kv_dtype: torch.dtype) -> str | None:
    """Why FA3's MLA decode cannot run this geometry, or None."""
    if not PAGES.allows(page_size):
        return f"vLLM's FA3 MLA needs a KV block size that is {PAGES}, not {page_size}"
    if kv_lora_rank != HEAD_DIM_V or rope_dim != ROPE_DIM:
        return f"vLLM's FA3 MLA needs kv_lora_rank {HEAD_DIM_V} + rope {ROPE_DIM}, not {kv_lora_rank} + {rope_dim}"
    if q_dtype != kv_dtype or q_dtype not in (torch.bfloat16, torch.float16):
        return f"vLLM's FA3 MLA needs bf16 or fp16 q and KV of one dtype, not {q_dtype} / {kv_dtype}"
    return None


def metadata_size(max_batch: int) -> int:
    """The scheduler metadata's int32 length for a batch of `max_batch` requests (FA3's own
    formula: one tile-count semaphore and 4 vectors per request, rounded up to 4 requests)."""
    return 1 + -(-max_batch // 4) * 4 * 4


class FA3MLADecode:
    """One layer-independent decode op with a fixed split count and schedule mode. `schedule()`
    computes the step's scheduler metadata (once per step, on the first layer; into a persistent
    buffer so a CUDA graph replays the new schedule); `run()` attends."""

    def __init__(self, softmax_scale: float, num_heads: int, page_size: int, num_splits: int = 0,
                 schedule: str = "aot", max_batch: int = 0, device=None):
        ok, why = load_library()
        if not ok:
            raise RuntimeError(why)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
        ops = getattr(torch.ops, OP_NAMESPACE)
        self._fwd, self._sched = ops.fwd, ops.get_scheduler_metadata
        self.softmax_scale = float(softmax_scale)
        self.num_heads, self.page_size = int(num_heads), int(page_size)
        self.num_splits, self.schedule_mode = int(num_splits), schedule
        self.metadata: torch.Tensor | None = None
        self._buffer = (torch.zeros(metadata_size(max_batch), dtype=torch.int32, device=device)
                        if max_batch > 0 and schedule == "aot" else None)

    def schedule(self, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                 max_seqlen_k: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The step's scheduler metadata (None with schedule "none"); seq_lens int32 [B] and
        cu_seqlens_q int32 [B + 1] on the device."""
        if self.schedule_mode != "aot":
            self.metadata = None
            return None
        batch = seq_lens.shape[0]
        md = self._sched(batch, max(int(max_seqlen_q), 1), int(max_seqlen_k), self.num_heads, 1,
                         ROPE_DIM, HEAD_DIM_V, dtype, seq_lens, cu_seqlens_q, None, None, None,
                         None, self.page_size, 0, True, -1, -1, False, self.num_splits, None, 0)
        if self._buffer is not None:
            n = md.shape[0]
            if n > self._buffer.shape[0]:
                raise ValueError(f"FA3 scheduler metadata of {n} entries exceeds the buffer "
                                 f"({self._buffer.shape[0]}) sized for the largest batch")
            self._buffer[:n] = md
            self._buffer[n:] = 0
            md = self._buffer[:n]
        self.metadata = md
        return md

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
            cu_seqlens_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
            out: torch.Tensor | None = None, return_lse: bool = False):
        """q_nope [T, H, 512], q_pe [T, H, 64]; ckv_cache [pages, page, 512] and kpe_cache
        [pages, page, 64], the latent and rope columns of vLLM's packed cache (views);
        block_table int32 [B, max_pages], seq_lens int32 [B], cu_seqlens_q int32 [B + 1];
        out [T, H, 512] or None. Returns out, or (out, lse [H, T]) with `return_lse`."""
        k_pe, kv_c = kpe_cache.unsqueeze(-2), ckv_cache.unsqueeze(-2)
        if q_pe.stride(-1) != 1:
            q_pe = q_pe.contiguous()
        o, lse, _, _ = self._fwd(
            q_pe, k_pe, kv_c, None, None, q_nope, out, cu_seqlens_q, None, None, None, seq_lens,
            max(int(max_seqlen_q), 1), int(max_seqlen_k), block_table, None, None, None, None,
            None, None, None, None, self.softmax_scale, True, -1, -1, 0.0, True, self.metadata,
            self.num_splits, None, 0, None, 1, 0, None)
        return (o, lse) if return_lse else o


class FA3Step:
    """One decode step served by FA3 (the plugin's FLASHINFER_MLA builder makes it where the tuned
    config serves vLLM's FA3 MLA kernel): the step's tensors and its scheduler metadata, computed
    once at build time; every layer calls `run` like FlashInfer's planned kernel."""

    def __init__(self, kernel: FA3MLADecode, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dtype: torch.dtype):
        self.kernel = kernel
        self.block_table, self.seq_lens, self.cu_seqlens_q = block_table, seq_lens, cu_seqlens_q
        self.max_seqlen_q, self.max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
        kernel.schedule(seq_lens, cu_seqlens_q, self.max_seqlen_q, self.max_seqlen_k, dtype)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, return_lse: bool = False):
        return self.kernel.run(q_nope, q_pe, ckv_cache, kpe_cache, self.block_table, self.seq_lens,
                               self.cu_seqlens_q, self.max_seqlen_q, self.max_seqlen_k, out,
                               return_lse)


__all__ = ["FA3MLADecode", "FA3Step", "GRAPH_SPLITS", "HEAD_DIM_V", "PAGES", "ROPE_DIM", "SCHEDULES", "check_shapes",
           "fa3_available", "library_path", "load_library", "metadata_size"]
