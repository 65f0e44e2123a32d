"""Torch reference for paged, absorbed MLA decode: the correctness oracle on CPU and GPU.

Absorbed MLA attends a query (q_nope against the compressed latent ckv, q_pe against the rope key
kpe) over a paged cache and returns a weighted sum of ckv rows. Accumulation is fp32.
"""

from __future__ import annotations

import math

import torch


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` token rows of one request, read through its page list."""
    page_size = cache.shape[1]
    n_pages = (length + page_size - 1) // page_size
    return cache[pages[:n_pages].long()].reshape(-1, cache.shape[-1])[:length]


def mla_decode_reference(
    q_nope: torch.Tensor,        # [T, H, kv_lora_rank], T = B * q_len
    q_pe: torch.Tensor,          # [T, H, rope_dim]
    ckv_cache: torch.Tensor,     # [num_pages, page_size, kv_lora_rank]
    kpe_cache: torch.Tensor,     # [num_pages, page_size, rope_dim]
    block_table: torch.Tensor,   # [B, max_pages] int
    seq_lens: torch.Tensor | list[int],  # [B] KV lengths, the q_len new tokens included
    sm_scale: float,
    q_len: int = 1,
    return_lse: bool = False,
):
    """Output [T, H, kv_lora_rank] in q's dtype (and LSE [T, H] in natural log if asked).

    With q_len > 1 the queries of a request are its last q_len tokens and attend causally:
    query i sees KV positions [0, L - q_len + i].
    """
    lens = [int(x) for x in (seq_lens.tolist() if torch.is_tensor(seq_lens) else seq_lens)]
    batch = len(lens)
    if q_nope.shape[0] != batch * q_len:
        raise ValueError(f"q has {q_nope.shape[0]} rows, expected batch {batch} x q_len {q_len}")
    out = torch.empty(q_nope.shape, dtype=torch.float32, device=q_nope.device)
    lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
    for b, length in enumerate(lens):
        ckv = gather_pages(ckv_cache, block_table[b], length).float()      # [L, R]
        kpe = gather_pages(kpe_cache, block_table[b], length).float()      # [L, P]
        rows = slice(b * q_len, (b + 1) * q_len)
        qn, qp = q_nope[rows].float(), q_pe[rows].float()                  # [q, H, *]
        logits = (torch.einsum("qhr,lr->qhl", qn, ckv) + torch.einsum("qhp,lp->qhl", qp, kpe)) * sm_scale
        if q_len > 1:
            pos = torch.arange(length, device=logits.device)
            last = length - q_len + torch.arange(q_len, device=logits.device)
            logits = logits.masked_fill(pos[None, None, :] > last[:, None, None], float("-inf"))
        lse[rows] = torch.logsumexp(logits, dim=-1)
        out[rows] = torch.einsum("qhl,lr->qhr", torch.softmax(logits, dim=-1), ckv)
    out = out.to(q_nope.dtype)
    return (out, lse) if return_lse else out


def mla_decode_unpaged(q_nope, q_pe, ckv, kpe, sm_scale: float):
    """The same attention on contiguous per-request tensors (a list of [L, R] / [L, P]), q_len 1.

    Used to test the paged reference: no page table, no gather.
    """
    outs = []
    for b in range(len(ckv)):
        s = (q_nope[b].double() @ ckv[b].double().T + q_pe[b].double() @ kpe[b].double().T) * sm_scale
        p = torch.softmax(s, dim=-1)
        outs.append(p @ ckv[b].double())
    return torch.stack(outs)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, inf when out holds a NaN or inf."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf
    denom = r.norm().item()
    return (o - r).norm().item() / (denom if denom else 1.0)
