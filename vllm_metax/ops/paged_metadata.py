"""Block table + sequence lengths -> FlashInfer's CSR page metadata (qo_indptr, kv_indptr,
kv_indices, kv_len). The only place in the project that knows how to build them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PagedMetadata:
    qo_indptr: torch.Tensor    # [B+1] int32, host
    kv_indptr: torch.Tensor    # [B+1] int32, host
    kv_len: torch.Tensor       # [B] int32, host
    kv_indices: torch.Tensor   # [num_used_pages] int32, on the block table's device
    num_pages_used: int


def build_paged_metadata(block_table: torch.Tensor, seq_lens_cpu: torch.Tensor, page_size: int,
                         q_len: int = 1, out_kv_indices: torch.Tensor | None = None) -> PagedMetadata:
    """CSR metadata of a uniform-q_len batch.

    `block_table` [B, max_pages] may live on the GPU; `seq_lens_cpu` [B] must be on the host (plan
    reads indptr there anyway). kv_indices is compacted with one gather on the block table's
    device, with no host sync. `out_kv_indices`, when given (CUDA graphs), receives the indices in
    its first num_pages_used slots.
    """
    if seq_lens_cpu.device.type != "cpu":
        raise ValueError("seq_lens must be a host tensor")
    batch = seq_lens_cpu.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] < batch:
        raise ValueError(f"block table of shape {tuple(block_table.shape)} does not cover batch {batch}")
    # Host side in numpy: this runs every decode step and torch's per-op overhead dominates here.
    seq_lens = seq_lens_cpu.numpy().astype(np.int32, copy=False)
    pages = (seq_lens + (page_size - 1)) // page_size
    max_pages = block_table.shape[1]
    if batch and int(pages.max()) > max_pages:
        raise ValueError(f"a sequence needs {int(pages.max())} pages, block table holds {max_pages}")
    kv_indptr = np.zeros(batch + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    nnz = int(kv_indptr[-1])
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
    src = block_table[:batch].reshape(-1)
    if out_kv_indices is not None:
        if out_kv_indices.numel() < nnz:
            raise ValueError(f"out_kv_indices holds {out_kv_indices.numel()} pages, the batch needs {nnz}")
        kv_indices = torch.index_select(src, 0, flat, out=out_kv_indices[:nnz])
    else:
        kv_indices = torch.index_select(src, 0, flat).to(torch.int32)
    qo_indptr = torch.from_numpy(np.arange(0, (batch + 1) * q_len, q_len, dtype=np.int32))
    return PagedMetadata(qo_indptr, torch.from_numpy(kv_indptr), torch.from_numpy(seq_lens),
                         kv_indices, nnz)


_SLOTS: dict = {}


def _slots(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) on `device`, from a cached buffer that grows by doubling (no launch per step)."""
    buf = _SLOTS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.arange(max(n, 2 * (buf.numel() if buf is not None else 1024)), dtype=torch.int64,
                           device=device)
        _SLOTS[device] = buf
    return buf[:n]
