"""Block table + sequence lengths -> FlashInfer's CSR page metadata (qo_indptr, kv_indptr,
kv_indices, kv_len). The only place in the project that knows how to build them.

Two layouts of the same pages:

* compact (default): kv_indices holds exactly the pages each request uses, back to back, and
  kv_indptr[r+1] - kv_indptr[r] = ceil(kv_len[r] / page_size). This is what FlashInfer's public
  plan() validates and accepts.
* strided (`compact=False`): kv_indices is the block table itself, flattened (a view, no copy and
  no kernel launch), and kv_indptr[r] = r * table_width. FlashInfer's native fa2/fa3 MLAPlan
  (scheduler.cuh) reads kv_indptr only as each request's start offset and kv_len for its length,
  so it describes the same pages; only the fast re-plan in `vllm_metax.ops.flashinfer_mla` may
  hand it to FlashInfer, and `PagedMetadata.compacted()` turns it into the compact form for the
  public plan(). vLLM's own FlashMLA/FlashInfer-trtllm backends pass the block table the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PagedMetadata:
    qo_indptr: torch.Tensor    # [B+1] int32, host
    kv_indptr: torch.Tensor    # [B+1] int32, host
    kv_len: torch.Tensor       # [B] int32, host
    kv_indices: torch.Tensor   # int32, on the block table's device
    num_pages_used: int        # pages the batch reads (sum of ceil(kv_len / page_size))
    compact: bool = True       # False: strided over `block_table` (see the module docstring)
    block_table: torch.Tensor | None = None   # the source table (strided metadata only)
    page_size: int = 0
    q_len: int = 1

    def compacted(self, out_kv_indices: torch.Tensor | None = None) -> "PagedMetadata":
        """This metadata in the compact layout (itself if already compact)."""
        if self.compact:
            return self
        return build_paged_metadata(self.block_table, self.kv_len, self.page_size, self.q_len,
                                    out_kv_indices=out_kv_indices)


def _host_lengths(seq_lens_cpu) -> np.ndarray:
    if isinstance(seq_lens_cpu, torch.Tensor):
        if seq_lens_cpu.device.type != "cpu":
            raise ValueError("seq_lens must be a host tensor")
        seq_lens_cpu = seq_lens_cpu.numpy()
    return np.asarray(seq_lens_cpu).astype(np.int32, copy=False)


def _check_table(block_table: torch.Tensor, batch: int, pages: np.ndarray) -> None:
    if block_table.dim() != 2 or block_table.shape[0] < batch:
        raise ValueError(f"block table of shape {tuple(block_table.shape)} does not cover batch {batch}")
    if batch and int(np.maximum.reduce(pages)) > block_table.shape[1]:
        raise ValueError(f"a sequence needs {int(np.maximum.reduce(pages))} pages, block table holds "
                         f"{block_table.shape[1]}")


def build_paged_metadata(block_table: torch.Tensor, seq_lens_cpu, page_size: int,
                         q_len: int = 1, out_kv_indices: torch.Tensor | None = None,
                         compact: bool = True) -> PagedMetadata:
    """CSR metadata of a uniform-q_len batch.

    `block_table` [B, max_pages] may live on the GPU; `seq_lens_cpu` [B] (a host tensor or numpy
    array) must be on the host (plan reads indptr there anyway). Compact kv_indices are gathered
    with one index_select on the block table's device, with no host sync; `out_kv_indices`, when
    given (CUDA graphs), receives them in its first num_pages_used slots.

    `compact=False` returns the strided layout when the block table allows it (int32 rows laid out
    contiguously), which launches nothing on the device; otherwise the compact one.
    """
    seq_lens = _host_lengths(seq_lens_cpu)
    batch = seq_lens.shape[0]
    pages = (seq_lens + (page_size - 1)) // page_size
    _check_table(block_table, batch, pages)
    max_pages = block_table.shape[1]
    nnz = int(np.add.reduce(pages))           # ufunc, not .sum(): half the call overhead
    table = block_table if block_table.shape[0] == batch else block_table[:batch]
    if not compact and out_kv_indices is None and table.dtype == torch.int32 and table.is_contiguous():
        return PagedMetadata(_qo_indptr(batch, q_len), _strided_indptr(batch, max_pages),
                             torch.from_numpy(seq_lens), table.view(-1), nnz, compact=False,
                             block_table=table, page_size=page_size, q_len=q_len)
    # Host side in numpy: this runs every decode step and torch's per-op overhead dominates here.
    kv_indptr = np.zeros(batch + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    # Index work scales with the number of pages (millions at page size 1), so it runs on the
    # block table's device: output slot j belongs to row r = searchsorted(ends, j) and reads
    # block_table.flat[j + r * max_pages - kv_indptr[r]]. 2B integers cross in one copy; no sync.
    device = block_table.device
    host = np.empty(2 * batch, dtype=np.int64)
    host[:batch] = kv_indptr[1:]
    host[batch:] = np.arange(batch, dtype=np.int64) * max_pages - kv_indptr[:-1]
    dev = torch.from_numpy(host).to(device, non_blocking=True)
    slot = _slots(nnz, device)
    rows = torch.searchsorted(dev[:batch], slot, right=True)
    flat = slot + dev[batch:][rows]
    src = table.reshape(-1)
    if out_kv_indices is not None:
        if out_kv_indices.numel() < nnz:
            raise ValueError(f"out_kv_indices holds {out_kv_indices.numel()} pages, the batch needs {nnz}")
        kv_indices = torch.index_select(src, 0, flat, out=out_kv_indices[:nnz])
    else:
        kv_indices = torch.index_select(src, 0, flat).to(torch.int32)
    return PagedMetadata(_qo_indptr(batch, q_len), torch.from_numpy(kv_indptr),
                         torch.from_numpy(seq_lens), kv_indices, nnz, page_size=page_size, q_len=q_len)


# The index arrays that depend only on the batch shape are the same every step: build each once.
# They are read-only for everyone (FlashInfer reads them on the host while planning).
_QO: dict = {}
_STRIDED: dict = {}


def _qo_indptr(batch: int, q_len: int) -> torch.Tensor:
    key = (batch, q_len)
    t = _QO.get(key)
    if t is None:
        t = _QO[key] = torch.from_numpy(np.arange(0, (batch + 1) * q_len, q_len, dtype=np.int32))
    return t


def _strided_indptr(batch: int, width: int) -> torch.Tensor:
    key = (batch, width)
    t = _STRIDED.get(key)
    if t is None:
        if (batch + 1) * width > np.iinfo(np.int32).max:
            raise ValueError(f"a block table of {batch} x {width} pages overflows int32 offsets")
        t = _STRIDED[key] = torch.from_numpy(np.arange(0, (batch + 1) * width, width, dtype=np.int32))
    return t


_SLOTS: dict = {}


def _slots(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) on `device`, from a cached buffer that grows by doubling (no launch per step)."""
    buf = _SLOTS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.arange(max(n, 2 * (buf.numel() if buf is not None else 1024)), dtype=torch.int64,
                           device=device)
        _SLOTS[device] = buf
    return buf[:n]
