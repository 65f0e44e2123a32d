"""Random problem instances for a workload: paged caches, shuffled page tables, queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_tune.problem.workload import Workload

_DT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DT[name]


@dataclass
class ProblemData:
    workload: Workload
    page_size: int
    q_nope: torch.Tensor        # [B*q_len, H, R]
    q_pe: torch.Tensor          # [B*q_len, H, P]
    ckv_cache: torch.Tensor     # [num_pages, page_size, R]
    kpe_cache: torch.Tensor     # [num_pages, page_size, P]
    kv_cache: torch.Tensor      # [num_pages, page_size, R+P]: vLLM's packed layout; ckv/kpe are views
    block_table: torch.Tensor   # [B, max_pages] int32, on device
    seq_lens_cpu: torch.Tensor  # [B] int32, host

    @property
    def device(self) -> torch.device:
        return self.q_nope.device


def make_problem(workload: Workload, page_size: int, device: str | torch.device = "cpu",
                 seed: int = 0, min_pool_bytes: int = 0, fill: bool = True) -> ProblemData:
    """Fill a KV pool with random data and give each request randomly chosen, shuffled pages.

    `min_pool_bytes` makes the pool larger than the requests need (e.g. > L2), so repeated runs
    do not read from cache; the used pages are scattered through it. `fill=False` leaves the
    pool and queries unwritten (no kernel runs: shapes and strides for a compile, not a run).
    """
    if page_size < 1:
        raise ValueError(f"page size must be >= 1, got {page_size}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = workload.seq_lens
    pages_per_req = [(n + page_size - 1) // page_size for n in lens]
    need = sum(pages_per_req)
    R, P, H = workload.kv_lora_rank, workload.qk_rope_head_dim, workload.num_heads
    kv_dt = torch_dtype(workload.kv_dtype)
    bytes_per_page = page_size * (R + P) * kv_dt.itemsize
    num_pages = max(need, -(-min_pool_bytes // bytes_per_page)) + 1
    perm = torch.randperm(num_pages, generator=g)[:need].to(torch.int32)
    max_pages = max(pages_per_req)
    block_table = torch.zeros(len(lens), max_pages, dtype=torch.int32)
    o = 0
    for b, n in enumerate(pages_per_req):
        block_table[b, :n] = perm[o:o + n]
        o += n
    kv_cache = torch.empty(num_pages, page_size, R + P, dtype=kv_dt, device=device)
    T = workload.batch_size * workload.q_len
    q = torch.empty(T, H, R + P, dtype=torch_dtype(workload.q_dtype), device=device)
    if fill:
        _fill_random(kv_cache, seed + 1)
        _fill_random(q, seed + 2)
    return ProblemData(workload, page_size, q[..., :R], q[..., R:], kv_cache[..., :R],
                       kv_cache[..., R:], kv_cache, block_table.to(device),
                       torch.tensor(lens, dtype=torch.int32))


def _fill_random(t: torch.Tensor, seed: int) -> None:
    # generate on the tensor's device, in chunks, so big GPU pools need no big host buffer
    g = torch.Generator(device=t.device).manual_seed(seed)
    flat = t.view(-1)
    step = 1 << 26
    for i in range(0, flat.numel(), step):
        chunk = flat[i:i + step]
        chunk.copy_(torch.randn(chunk.shape, generator=g, device=t.device, dtype=torch.float32))
