"""A split-KV Triton MLA decode kernel (paged KV, q_len 1), for the batches FlashInfer's MLA kernels
spread badly: few requests, where FlashInfer's in-kernel merge of many KV chunks runs one
(request, head) per merge item (measured on the H200: 1.1-1.65x faster than FlashInfer fa3 at 16
heads, batch 1-2, bench/results/small_decode_kernel*_h200.txt).

The kernels themselves (the algorithm, the two merges, the pointer and TMA loads) are
`vllm_metax.ops.split_kernels`; here is what launches them: `SplitDecode` (knobs fixed, workspaces
allocated, launches only: CUDA-graph capturable), the served configuration and its workspace, the
step form FLASHINFER_MLA's impl calls, and the check the plugin runs before it serves a kernel.
This module imports nothing from mla_tune: it only needs torch and triton.

`served(params, ...)` is the configuration the tuner measures and the plugin serves for the
tuned-config family `split` (`vllm_metax.core.choices.SplitChoice`): its knobs are the split count,
the partials' dtype and the pipe (`PIPES`: tile size, pipeline stages, grouped page ids, head
rows, PDL); the rest is fixed here (the TMA kernel `tma_kernel` at 8 warps, tokens as the
dots' M below 64 head rows; the merge kernel with 64-column blocks and up to 128 splits in one
tile). On the H200 the TMA kernel of the served pipe "t64" was 1-4% faster than the pointer
kernel at 16 heads and 10-20% at 128 (bench/results/small_decode_kernel_h200.txt, run `tma`).
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:     # an older or vendor Triton (MetaX's: no TMA there): the pointer kernel only
    _TensorDescriptor = None

from vllm_metax.core import device as core_device
from vllm_metax.core.profile import target_profile
from vllm_metax.core.split_facts import (
    MAX_PROGRAMS, PARTIAL_DTYPES, PIPES, SERVED_PIPE, Pipe, default_block_h,
)
from vllm_metax.ops.split_kernels import merge_kernel, pointer_kernel, tma_kernel

MERGES = ("fused", "kernel")
LOADS = ("gather", "tma")
_LOG2E = 1.4426950408889634
SERVED_BLOCK_N = 64
SERVED_MERGE_D = 64
# splits the merge kernel folds per load: one tile for up to 128 splits (masked rows cost no
# memory traffic), and one compile for every split count
SERVED_MERGE_SPLITS = 128
# group_pages: page ids the TMA kernel loads at once, ahead of their tiles' copies (0: one
# block-table load a tile, in the tile loop)
SERVED_GROUP_PAGES = 0


assert PIPES[SERVED_PIPE].block_n == SERVED_BLOCK_N


def pipe_of(name: str) -> Pipe:
    if name not in PIPES:
        raise ValueError(f"pipe must be one of {', '.join(PIPES)}, got {name!r}")
    return PIPES[name]


class SplitDecode:
    """The kernel with its knobs fixed and its workspaces allocated, so `run` only launches
    (no allocation, no host sync: CUDA-graph capturable).

    `num_splits`: KV splits per request (the grid's first axis; a request uses
    ceil(len / chunk) of them, chunk = BLOCK_N-aligned len / num_splits). `merge`: "fused" (one
    launch, the last split merges) or "kernel" (a second merge kernel). `partial_dtype`: the
    workspace's partial-output dtype (float32; bfloat16 halves the merge traffic). `transposed`:
    scores computed as ckv . q^T (tokens as the dot's M), the form that gives a 16-row head block
    Hopper's wgmma. None picks the defaults below. `load`: "gather" (the pointer kernel: every
    tile through registers) or "tma" (`tma_kernel`: tiles copied by the tensor-memory
    accelerator into shared memory, double-buffered; merge "kernel" only, BLOCK_N dividing the
    page, and caches whose pages are rows of one [pages x page, width] view; a cache that is not
    is served by the pointer kernel instead). `group_pages` (TMA kernel): 0, a block-table load
    per tile in the tile loop (the pipe "t64"), or page ids loaded that many pages at a time
    ahead of their tiles (lets 32-token tiles take 3-4 stages: "t32x4"). `pdl`: the merge kernel
    launched as the split kernel's programmatic dependent (sm_90+ CUDA only: the "-pdl" pipes).
    `served` builds them from a tuned pipe (`PIPES`).
    """

    def __init__(self, num_heads: int, page_size: int, max_batch: int, num_splits: int,
                 block_n: int = 64, num_warps: int | None = None, num_stages: int = 2,
                 block_h: int | None = None, merge: str = "fused", partial_dtype: torch.dtype = torch.float32,
                 transposed: bool | None = None,
                 kv_lora_rank: int = 512, rope_dim: int = 64, device="cuda",
                 merge_block_d: int = 128, merge_split_tile: int = 16, merge_num_warps: int = 4,
                 workspace: "tuple[torch.Tensor, torch.Tensor] | None" = None, load: str = "gather",
                 group_pages: int = SERVED_GROUP_PAGES, pdl: bool = False):
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
        if load not in LOADS:
            raise ValueError(f"load must be one of {LOADS}, got {load!r}")
        if load == "tma" and (merge != "kernel" or block_n > page_size):
            raise ValueError(f"load 'tma' needs merge 'kernel' and block_n <= page_size, got merge {merge!r}, "
                             f"block_n {block_n}, page_size {page_size}")
        if group_pages and group_pages & (group_pages - 1) or group_pages < 0:
            raise ValueError(f"group_pages must be 0 or a power of two, got {group_pages}")
        self.group_pages = group_pages
        if pdl and not (merge == "kernel" and torch.device(device).type == "cuda" and tma_supported(device)
                        and hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")):
            # grid-dependency control is Hopper's (sm_90+) PTX; the interpreter cannot run it
            raise ValueError("pdl (the merge kernel as a programmatic dependent launch) needs merge 'kernel' "
                             "and an NVIDIA GPU of compute capability 9+")
        self.pdl = bool(pdl)
        for label, v in (("page_size", page_size), ("block_n", block_n), ("kv_lora_rank", kv_lora_rank),
                         ("rope_dim", rope_dim), ("merge_block_d", merge_block_d),
                         ("merge_split_tile", merge_split_tile)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{label} must be a power of two, got {v}")
        self.block_h = block_h or default_block_h(num_heads)
        if self.block_h < 16 or self.block_h & (self.block_h - 1):
            raise ValueError(f"block_h must be a power of two >= 16 (tl.dot's M), got {self.block_h}")
        if block_n < 16 or rope_dim < 16 or kv_lora_rank < 16:
            raise ValueError("block_n, rope_dim and kv_lora_rank must be >= 16 (tl.dot's N and K)")
        if num_splits < 1 or max_batch < 1 or num_heads < 1:
            raise ValueError("num_heads, max_batch and num_splits must be >= 1")
        if kv_lora_rank % merge_block_d:
            raise ValueError(f"merge_block_d {merge_block_d} must divide kv_lora_rank {kv_lora_rank}")
        self.num_heads, self.page_size, self.max_batch = num_heads, page_size, max_batch
        self.num_splits, self.block_n, self.merge, self.load = num_splits, block_n, merge, load
        # defaults from compiling for sm_90a (ptxas -v): a 64-row head block spills at 4 warps; a
        # 16-row one gets wgmma (no spill) only with tokens as the dot's M, BLOCK_N >= 64
        self.num_warps = num_warps or (8 if self.block_h >= 64 else 4)
        self.num_stages = num_stages
        self.transposed = (self.block_h < 64 and block_n >= 64) if transposed is None else bool(transposed)
        if self.transposed and num_stages < 2:
            # wrong results on the H200 under Triton 3.6, both loads: the pointer kernel at 128
            # heads (small_decode_kernel_h200.txt), the TMA kernel at every 16-head shape (relative
            # error 5-7, small_decode_kernel_h200.txt, run `tma_occupancy`); two stages are right
            raise ValueError("transposed (tokens as the dots' M) needs num_stages >= 2: one stage "
                             "computed wrong results on the H200")
        self.R, self.P = kv_lora_rank, rope_dim
        self.merge_block_d, self.merge_split_tile, self.merge_num_warps = (
            merge_block_d, merge_split_tile, merge_num_warps)
        self.head_blocks = -(-num_heads // self.block_h)
        # the fused merge's tile: 8192 fp32 (32 KiB in flight, 64 registers a thread at 4 warps)
        self.fused_merge_d = max(16, min(kv_lora_rank, 8192 // self.block_h))
        self.padded_heads = self.head_blocks * self.block_h
        # the workspace's heads: whole head blocks for the fused merge (its last split reads a
        # whole block's rows); the real heads for the merge kernel (a head block wider than the
        # heads writes only those, `_store_partial`)
        self.ws_heads = self.padded_heads if merge == "fused" else num_heads
        dev = torch.device(device)
        if workspace is None:
            workspace = allocate_workspace(max_batch * num_splits, self.ws_heads, kv_lora_rank,
                                           partial_dtype, dev)
        self.ws_acc, self.ws_lse = workspace
        # rows of (request, split) partials the workspace holds: a batch needs B x num_splits
        self.ws_rows = self.ws_lse.shape[0]
        if (self.ws_acc.shape[1:] != (self.ws_heads, kv_lora_rank) or self.ws_acc.dtype != partial_dtype
                or self.ws_lse.shape[1:] != (self.ws_heads,) or self.ws_acc.shape[0] != self.ws_rows):
            raise ValueError(f"workspace {tuple(self.ws_acc.shape)} {self.ws_acc.dtype} does not fit "
                             f"{self.ws_heads} heads x rank {kv_lora_rank} {partial_dtype}")
        self.max_batch = min(max_batch, self.ws_rows // num_splits)
        if self.max_batch < 1:
            raise ValueError(f"a workspace of {self.ws_rows} rows cannot hold {num_splits} splits")
        # zeroed once here; the fused kernel leaves every counter at 0 after each launch
        self.counter = torch.zeros(max_batch, self.head_blocks, dtype=torch.int32, device=dev)

    def describe(self) -> dict:
        return {"num_splits": self.num_splits, "block_n": self.block_n, "block_h": self.block_h,
                "num_warps": self.num_warps, "num_stages": self.num_stages, "merge": self.merge,
                "transposed": self.transposed, "load": self.load, "group_pages": self.group_pages,
                "pdl": self.pdl,
                "partial_dtype": str(self.ws_acc.dtype).replace("torch.", "")}

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, scale: float, out):
        """Launch over q_nope [B, H, R], q_pe [B, H, P], ckv_cache [pages, page, R],
        kpe_cache [pages, page, P] (any strides but a unit last one), block_table int32
        [B, max_pages], seq_lens int32 [B] on the device; writes out [B, H, R]."""
        B, H, R = q_nope.shape
        if H != self.num_heads or R != self.R or q_pe.shape[-1] != self.P or B > self.max_batch or B < 1:
            raise ValueError(f"q {tuple(q_nope.shape)} / {tuple(q_pe.shape)} does not fit this kernel "
                             f"(heads {self.num_heads}, rank {self.R}, rope {self.P}, max batch {self.max_batch})")
        if ckv_cache.shape[1] != self.page_size or kpe_cache.shape[1] != self.page_size:
            raise ValueError(f"cache page size {ckv_cache.shape[1]} is not {self.page_size}")
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache),
                        ("kpe_cache", kpe_cache), ("out", out)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} needs a unit stride in its last dim")
        descs = self._descriptors(ckv_cache, kpe_cache) if self.load == "tma" else None
        if descs is not None:
            tma_kernel[(self.num_splits, self.head_blocks, B)](
                q_nope, q_pe, descs[0], descs[1], block_table, seq_lens, out, self.ws_acc, self.ws_lse,
                q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
                block_table.stride(0), out.stride(0), out.stride(1),
                float(scale) * _LOG2E, self.num_splits,
                H=H, HP=self.ws_heads, R=R, P=self.P, PAGE=self.page_size,
                BLOCK_H=self.block_h, BLOCK_N=self.block_n, TRANS=self.transposed, GROUP_PAGES=self.group_pages,
                PDL=self.pdl, num_warps=self.num_warps, num_stages=self.num_stages,
            )
        else:
            self._pointer_kernel(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, scale, out)
        if self.merge == "kernel" and self.num_splits > 1:
            merge_kernel[(H, R // self.merge_block_d, B)](
                self.ws_acc, self.ws_lse, seq_lens, out, out.stride(0), out.stride(1), self.num_splits,
                HP=self.ws_heads, R=R, BLOCK_N=self.block_n, DC=self.merge_block_d,
                ST=self.merge_split_tile, num_warps=self.merge_num_warps, num_stages=1,
                **({"PDL": True, "launch_pdl": True} if self.pdl else {}),
            )
        return out

    def _descriptors(self, ckv_cache, kpe_cache):
        """The caches' TMA descriptors (host objects of a few fields: built every launch, so no
        cache tensor is kept alive here), or None where a cache's pages are not rows of one 2-D
        view with 16-byte aligned rows (the pointer kernel serves those)."""
        if _TensorDescriptor is None or not all(t.dim() == 3 and t.stride(0) == t.shape[1] * t.stride(1) and t.stride(2) == 1
                   and (t.stride(1) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
                   for t in (ckv_cache, kpe_cache)):
            return None
        rows = ckv_cache.shape[0] * ckv_cache.shape[1]
        return (_TensorDescriptor(ckv_cache, [rows, self.R], [ckv_cache.stride(1), 1], [self.block_n, self.R]),
                _TensorDescriptor(kpe_cache, [rows, self.P], [kpe_cache.stride(1), 1], [self.block_n, self.P]))

    def _pointer_kernel(self, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, scale, out):
        B, H, R = q_nope.shape
        pointer_kernel[(self.num_splits, self.head_blocks, B)](
            q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, out,
            self.ws_acc, self.ws_lse, self.counter,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
            ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1),
            block_table.stride(0), out.stride(0), out.stride(1),
            float(scale) * _LOG2E, self.num_splits, int(self.merge == "fused"),
            H=H, HP=self.ws_heads, R=R, P=self.P, PAGE=self.page_size,
            BLOCK_H=self.block_h, BLOCK_N=self.block_n,
            MERGE_D=self.fused_merge_d, TRANS=self.transposed,
            num_warps=self.num_warps, num_stages=self.num_stages,
        )


def allocate_workspace(rows: int, heads: int, kv_lora_rank: int, partial_dtype: torch.dtype,
                       device) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials for `rows` (request, split) pairs: [rows, heads, rank] and their LSE."""
    return (torch.empty(rows, heads, kv_lora_rank, dtype=partial_dtype, device=device),
            torch.empty(rows, heads, dtype=torch.float32, device=device))


def served_rows(num_heads: int, pipe: str = SERVED_PIPE) -> int:
    """(request, split) rows of the served workspace: MAX_PROGRAMS over the pipe's head blocks."""
    return MAX_PROGRAMS // -(-num_heads // pipe_of(pipe).head_block(num_heads))


def served_workspace(num_heads: int, kv_lora_rank: int, partial: str, device,
                     pipe: str = SERVED_PIPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The served workspace: `served_rows` rows over the heads (the merge kernel's layout)."""
    return allocate_workspace(served_rows(num_heads, pipe), num_heads, kv_lora_rank, getattr(torch, partial),
                              device)


def fits(num_heads: int, batch_size: int, num_splits: int, pipe: str = SERVED_PIPE) -> bool:
    """Whether a launch of this batch and split count stays within MAX_PROGRAMS (what the
    served workspace holds)."""
    return batch_size * num_splits <= served_rows(num_heads, pipe)


def served(num_splits: int, partial: str, num_heads: int, page_size: int, max_batch: int, device,
           workspace=None, kv_lora_rank: int = 512, rope_dim: int = 64, pipe: str = SERVED_PIPE,
           profile=None) -> "SplitDecode":
    """The served configuration of the `split` family for these knobs (validated: ValueError);
    `profile` (default: the active one) may rule the TMA kernel out (`tma_supported`)."""
    if partial not in PARTIAL_DTYPES:
        raise ValueError(f"partial must be one of {', '.join(PARTIAL_DTYPES)}, got {partial!r}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= MAX_PROGRAMS:
        raise ValueError(f"num_splits must be an integer in 1..{MAX_PROGRAMS}, got {num_splits!r}")
    p = pipe_of(pipe)
    # a TMA tile lies in one page; below that page size, or where the device has no TMA, the
    # pointer kernel (pipes of the TMA kernel only: refused)
    tma = p.block_n <= page_size and tma_supported(device, profile)
    if p.tma_only and not tma:
        raise ValueError(f"pipe {pipe!r} runs on the TMA kernel only: a page of at least {p.block_n} tokens "
                         f"(got {page_size}) on a GPU with a tensor-memory accelerator")
    block_h = p.head_block(num_heads)
    return SplitDecode(num_heads, page_size, max_batch, num_splits, block_n=p.block_n,
                       num_warps=8, num_stages=p.num_stages, block_h=block_h, merge="kernel",
                       partial_dtype=getattr(torch, partial),
                       transposed=tma and block_h < 64, kv_lora_rank=kv_lora_rank,
                       rope_dim=rope_dim, device=device, merge_block_d=min(SERVED_MERGE_D, kv_lora_rank),
                       merge_split_tile=SERVED_MERGE_SPLITS, workspace=workspace,
                       load="tma" if tma else "gather", group_pages=p.group_pages, pdl=p.pdl)


def tma_supported(device, profile=None) -> bool:
    """Whether the TMA kernel can run on `device`: a Triton with tensor descriptors, and an NVIDIA
    GPU of compute capability 9 or later (Hopper's tensor-memory accelerator; MetaX GPUs, found
    by pymxsml or their name, have none); a CPU tensor runs it under Triton's interpreter. Never
    under a profile whose target has no TMA (`profile`, default: the active one: metax)."""
    if _TensorDescriptor is None:
        return False
    if not target_profile(profile).split_tma:
        return False
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type == "cpu"
    if core_device.detect_device().is_metax:
        return False
    try:
        return torch.cuda.get_device_capability(dev)[0] >= 9
    except Exception:  # noqa: BLE001 - no answer from the driver: the pointer kernel
        return False


def splits_for(total_tokens_per_request: int, block_n: int, num_splits: int) -> int:
    """The splits a request of this length actually uses (the kernel's own rule)."""
    chunk = max(math.ceil(math.ceil(total_tokens_per_request / num_splits) / block_n) * block_n, block_n)
    return math.ceil(total_tokens_per_request / chunk)


class SplitStep:
    """One decode step of the split kernel in the form FLASHINFER_MLA's impl calls every layer
    (`run(q_nope, q_pe, ckv, kpe, out=...)`): the step's device block table and sequence lengths
    are bound here, so a captured graph replays with whatever those buffers hold next step."""

    use_cuda_graph = False
    graph_buffers = None

    def __init__(self, kernel: SplitDecode, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float):
        self.kernel, self.block_table, self.seq_lens, self.scale = kernel, block_table, seq_lens, scale

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, return_lse: bool = False):
        if return_lse:
            raise ValueError("the split kernel does not return the decode LSE")
        if out is None:
            out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
        return self.kernel.run(q_nope, q_pe, ckv_cache, kpe_cache, self.block_table, self.seq_lens,
                               self.scale, out)


def self_check(kernel: SplitDecode, dtype: torch.dtype, device, page_size: int | None = None,
               lens=(1, 77, 300), tol: float = 2e-2) -> str | None:
    """Run `kernel` once on a small random paged problem (ragged lengths, shuffled pages) against
    a float32 torch reference: None when it matches, else why not (a compile error included).
    What the plugin runs before it serves a tuned split choice on this device."""
    try:
        page = page_size or kernel.page_size
        H, R, P = kernel.num_heads, kernel.R, kernel.P
        B = min(len(lens), kernel.max_batch)
        lens = list(lens)[:B]
        g = torch.Generator(device="cpu").manual_seed(0)
        pages_per = [-(-n // page) for n in lens]
        n_pages = sum(pages_per) + 3
        kv = torch.randn(n_pages, page, R + P, generator=g).to(dtype)
        q = (torch.randn(B, H, R + P, generator=g) * 0.3).to(dtype)
        perm = torch.randperm(n_pages, generator=g)
        bt = torch.zeros(B, max(pages_per), dtype=torch.int32)
        at = 0
        for b, n in enumerate(pages_per):
            bt[b, :n] = perm[at:at + n].to(torch.int32)
            at += n
        scale = (R + P) ** -0.5
        ref = torch.empty(B, H, R)
        for b, n in enumerate(lens):
            tok = kv[bt[b, :pages_per[b]].long()].reshape(-1, R + P)[:n].float()
            p = torch.softmax((q[b].float() @ tok.T) * scale, dim=-1)
            ref[b] = p @ tok[:, :R]
        kv_d, q_d = kv.to(device), q.to(device)
        out = torch.full((B, H, R), float("nan"), dtype=dtype, device=device)
        kernel.run(q_d[..., :R], q_d[..., R:], kv_d[..., :R], kv_d[..., R:], bt.to(device),
                   torch.tensor(lens, dtype=torch.int32, device=device), scale, out)
        got = out.float().cpu()
        err = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
        if not err < tol:         # NaN fails too
            return f"wrong result on a {B}-request check problem (relative error {err:.3g})"
        return None
    except Exception as e:  # noqa: BLE001 - a compile or launch failure is a reason, never a crash
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
