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
FlashMLASchedMeta per step. `FlashMLADecode.new_step()` forgets the schedule. `FlashMLAStep` is one
such step inside FLASHINFER_MLA (the buckets a tuned config gives FlashMLA there): it takes
FlashInfer's split q and cache columns and hands FlashMLA the packed ones (`packed_cache`, no copy
of the cache).

Constraints (FlashMLA's): page (KV block) size 64, head dim 576 (kv_lora_rank 512 + rope 64),
head_dim_v 512, q and KV of one 16-bit dtype, Hopper (compute capability 9.x: the dense kernels
of this build are sm_90a only).

MetaX's FlashMLA port is another library: the `flash_mla` package (`flash_mla==1.0.1+metax`, what
the vendor's vLLM-metax FLASHMLA backend calls), with FlashMLA 1.0's Python interface
`get_mla_metadata(cache_seqlens, q_tokens_per_head_k, num_heads_k) -> (tile_scheduler_metadata,
num_splits)` and `flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
tile_scheduler_metadata, num_splits, softmax_scale, causal) -> (out, lse)`: the same schedule
once per step, then one attention call per layer. On a MetaX device (`vllm_metax.core.device`)
the op runs that package; elsewhere vLLM's library (or, where vLLM's is absent, the package).
Where neither can run, `flashmla_available()` says so and FLASHMLA is not chosen.
"""

from __future__ import annotations

import torch

from vllm_metax.core import device as core_device
from vllm_metax.core.choices import FLASHMLA, SPECS
from vllm_metax.ops.vllm_library import VllmLibrary, hopper_reason

PAGE_SIZE = SPECS[FLASHMLA].page.only     # FlashMLA's only KV block size (the spec's)
HEAD_DIM = 576                 # kv_lora_rank + qk_rope_head_dim
HEAD_DIM_V = 512               # kv_lora_rank
LIBRARY_GLOB = "_flashmla_C*.so"
OP_NAMESPACE = "_flashmla_C"
VLLM_LIBRARY = "vllm"          # vllm/_flashmla_C: torch.ops._flashmla_C.dense_decode_fwd
VENDOR_LIBRARY = "flash_mla"   # the flash_mla package (MetaX's build): FlashMLA 1.0's interface

_LIBRARY = VllmLibrary("", LIBRARY_GLOB, OP_NAMESPACE, ("dense_decode_fwd",),
                       "vllm's FlashMLA library (vllm/_flashmla_C*.so)")


library_path = _LIBRARY.path      # the library beside the installed vllm (None if absent)
load_library = _LIBRARY.load      # load its ops once per process: (loaded, why not); never raises


def vendor_interface():
    """The flash_mla package's (get_mla_metadata, flash_mla_with_kvcache), or (None, why not).
    Never raises."""
    try:
        import flash_mla    # lazy: optional (the MetaX vendor's package); absent is an answer
    except Exception as e:  # noqa: BLE001 - a broken install is "not here", with its reason
        return None, f"the flash_mla package is not importable ({type(e).__name__}: {str(e)[:200]})"
    for mod in (flash_mla, getattr(flash_mla, "flash_mla_interface", None)):
        meta = getattr(mod, "get_mla_metadata", None)
        fwd = getattr(mod, "flash_mla_with_kvcache", None)
        if callable(meta) and callable(fwd):
            return (meta, fwd), ""
    return None, "the flash_mla package has no get_mla_metadata / flash_mla_with_kvcache"


def _on_metax() -> bool:
    return core_device.detect_device().is_metax


def flashmla_library(device=None, capability: tuple | None = None) -> tuple[str | None, str]:
    """(the library FlashMLA's dense decode runs with here, why none): the flash_mla package on
    a MetaX device; vLLM's library on a Hopper GPU, else the package there. `capability`
    overrides the device's (tests); a library is only loaded once a device qualifies."""
    if _on_metax():
        found, why = vendor_interface()
        return (VENDOR_LIBRARY, "") if found else (None, f"MetaX device: {why}")
    why = hopper_reason("FlashMLA", "FlashMLA's dense decode kernels", device, capability)
    if why:
        return None, why
    ok, why = load_library()
    if ok:
        return VLLM_LIBRARY, ""
    found, vendor_why = vendor_interface()
    return (VENDOR_LIBRARY, "") if found else (None, f"{why}; {vendor_why}")


def flashmla_available(device=None, capability: tuple | None = None) -> tuple[bool, str]:
    """(FlashMLA dense decode can run here, why not): `flashmla_library` found one."""
    library, why = flashmla_library(device, capability)
    return library is not None, why


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

    def __init__(self, softmax_scale: float, causal: bool = False, library: str | None = None):
        """`library`: VLLM_LIBRARY or VENDOR_LIBRARY (default: `flashmla_library()`'s)."""
        if library is None:
            library, why = flashmla_library()
            if library is None:
                raise RuntimeError(why)
        self.library = library
        if library == VENDOR_LIBRARY:
            found, why = vendor_interface()
            if found is None:
                raise RuntimeError(why)
            self._metadata, self._vendor_fwd = found
        else:
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
        if self.library == VENDOR_LIBRARY:
            return self._run_vendor(q, kv_cache, block_table, seq_lens, out)
        stale = self._stale
        o, lse, tsm, ns = self._fwd(
            q, kv_cache.unsqueeze(-2), HEAD_DIM_V, seq_lens, block_table, self.softmax_scale,
            self.causal, None if stale else self.tile_scheduler_metadata,
            None if stale else self.num_splits, out)
        if stale:
            self._keep_schedule(tsm, ns)
        return o, lse

    def _run_vendor(self, q, kv_cache, block_table, seq_lens, out):
        """The flash_mla package: the schedule from `get_mla_metadata` on the step's first call
        (one KV head: q_len x heads query rows per head), then `flash_mla_with_kvcache`, whose
        output is copied into `out` where one is given (FlashMLA 1.0 takes none)."""
        if self._stale:
            tsm, ns = self._metadata(seq_lens, q.shape[1] * q.shape[2], 1)
            self._keep_schedule(tsm, ns)
        o, lse = self._vendor_fwd(q, kv_cache.unsqueeze(-2), block_table, seq_lens, HEAD_DIM_V,
                                  self.tile_scheduler_metadata, self.num_splits,
                                  softmax_scale=self.softmax_scale, causal=self.causal)
        if out is not None:
            out.copy_(o)
            o = out
        return o, lse

    def _keep_schedule(self, tsm: torch.Tensor, ns: torch.Tensor) -> None:
        """A fresh schedule, copied into the old tensors where it has their shapes."""
        old_t, old_n = self.tile_scheduler_metadata, self.num_splits
        if (old_t is not None and old_n is not None and old_t.shape == tsm.shape
                and old_n.shape == ns.shape):
            old_t.copy_(tsm)
            old_n.copy_(ns)
        else:
            self.tile_scheduler_metadata, self.num_splits = tsm, ns
        self._stale = False


def packed_cache(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's packed MLA cache [pages, page, 576] whose latent and rope columns `ckv_cache`
    [pages, page, 512] and `kpe_cache` [pages, page, 64] are (views, as FLASHINFER_MLA's impl
    slices them), without a copy; ValueError where they are not two column ranges of one tensor."""
    rope = HEAD_DIM - HEAD_DIM_V
    same_rows = (ckv_cache.shape[:-1] == kpe_cache.shape[:-1] and ckv_cache.stride() == kpe_cache.stride()
                 and ckv_cache.untyped_storage().data_ptr() == kpe_cache.untyped_storage().data_ptr())
    if (not same_rows or ckv_cache.shape[-1] != HEAD_DIM_V or kpe_cache.shape[-1] != rope
            or ckv_cache.stride(-1) != 1 or ckv_cache.stride(-2) < HEAD_DIM
            or kpe_cache.storage_offset() != ckv_cache.storage_offset() + HEAD_DIM_V):
        raise ValueError(f"FlashMLA reads one packed [pages, page, {HEAD_DIM}] cache; got latent "
                         f"{tuple(ckv_cache.shape)} and rope {tuple(kpe_cache.shape)} columns that are "
                         "not views of one")
    return ckv_cache.as_strided((*ckv_cache.shape[:-1], HEAD_DIM), ckv_cache.stride())


class FlashMLAStep:
    """One decode step served by FlashMLA inside FLASHINFER_MLA (the plugin's builder makes it
    where the tuned config serves FlashMLA in the step's bucket): the step's block table and
    sequence lengths. Making it marks the op's schedule stale, so the step's first layer
    schedules and every later layer reuses it; `run` takes FlashInfer's planned kernel's
    arguments."""

    def __init__(self, kernel: FlashMLADecode, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 q_len: int):
        self.kernel, self.block_table, self.seq_lens = kernel, block_table, seq_lens
        self.q_len = int(q_len)
        kernel.new_step()

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, out: torch.Tensor | None = None, return_lse: bool = False):
        """q_nope [T, H, 512] and q_pe [T, H, 64] (T = batch x q_len); ckv_cache and kpe_cache the
        columns of one packed cache (`packed_cache`); out [T, H, 512] or None. Returns the
        output [T, H, 512]. No LSE: FLASHINFER_MLA serves FlashMLA only where none is asked for."""
        if return_lse:
            raise ValueError("FlashMLA inside FLASHINFER_MLA returns no decode LSE")
        rows, heads = q_nope.shape[0], q_nope.shape[1]
        batch = self.block_table.shape[0]
        if rows != batch * self.q_len:
            raise ValueError(f"FlashMLA step of {batch} requests x q_len {self.q_len}; got {rows} rows")
        q = torch.cat((q_nope, q_pe), dim=-1).view(batch, self.q_len, heads, HEAD_DIM)
        # FlashMLA writes a given output at q_len 1 only (it refuses a [B, q_len, H, 512] one
        # above): there its own output is copied, as the tuner's flashmla family does
        direct = out is not None and out.is_contiguous() and self.q_len == 1
        o, _ = self.kernel.run(q, packed_cache(ckv_cache, kpe_cache), self.block_table, self.seq_lens,
                               out=out.view(batch, self.q_len, heads, HEAD_DIM_V) if direct else None)
        o = o.reshape(rows, heads, HEAD_DIM_V)
        if out is not None and not direct:
            return out.copy_(o)
        return out if direct else o


__all__ = ["FlashMLADecode", "FlashMLAStep", "packed_cache", "HEAD_DIM", "HEAD_DIM_V", "PAGE_SIZE", "VENDOR_LIBRARY", "VLLM_LIBRARY",
           "check_shapes", "flashmla_available", "flashmla_library", "library_path", "load_library",
           "vendor_interface"]
