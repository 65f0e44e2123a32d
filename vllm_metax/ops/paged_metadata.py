"""Block table + sequence lengths -> FlashInfer's CSR page metadata (qo_indptr, kv_indptr,
kv_indices, kv_len). The only place in the project that knows how to build them."""

from __future__ import annotations

from dataclasses import dataclass

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
    seq_lens = seq_lens_cpu.to(torch.int32)
    pages = (seq_lens + (page_size - 1)) // page_size
    max_pages = block_table.shape[1]
    if batch and int(pages.max()) > max_pages:
        raise ValueError(f"a sequence needs {int(pages.max())} pages, block table holds {max_pages}")
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    qo_indptr = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    nnz = int(kv_indptr[-1])
    # Index work scales with the number of pages (millions at page size 1), so it runs on the
    # block table's device: for output slot j, its request is the searchsorted row of j in
    # kv_indptr and its column j - kv_indptr[row]. Only B+1 integers cross to the device; no sync.
    device = block_table.device
    indptr = kv_indptr.to(device, non_blocking=True)
    slot = torch.arange(nnz, dtype=torch.int32, device=device)
    rows = torch.searchsorted(indptr[1:], slot, right=True)
    flat = rows * max_pages + (slot - indptr[rows])
    src = block_table[:batch].reshape(-1)
    if out_kv_indices is not None:
        torch.index_select(src, 0, flat, out=out_kv_indices[:nnz])
        kv_indices = out_kv_indices[:nnz]
    else:
        kv_indices = torch.index_select(src, 0, flat).to(torch.int32)
    return PagedMetadata(qo_indptr, kv_indptr, seq_lens, kv_indices, nnz)
