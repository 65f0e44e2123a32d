"""FlashInfer 0.7's fa2/fa3 MLA schedule, computed with numpy instead of its C++ MLAPlan.

Every decode step re-plans: FlashInfer's MLAPlan (include/flashinfer/attention/scheduler.cuh)
splits each request's query tiles into KV chunks and hands the chunks to the GPU's clusters. On the
H200 that C++ call alone costs 14-52 us at 128 heads and 32-124 us at 16 heads for B = 1-128
(git show 9cbb460:bench/results/2026-12-02_h200_plan_floor.json), over 0.5 us per work item: it grows eight
std::vectors per cluster one push_back at a time and pops a heap per chunk. Here the same work
items are a few dozen whole-array numpy operations, and a decode step whose batch kept its shape
(every request one token longer) reuses the step before's schedule, refreshing two arrays.

What is kept exactly as MLAPlan makes it (the kernel's contract):

* the cluster shape (1 or 2 CTAs by the average packed query length), the 64-row tile per CTA, the
  KV chunk limit (`_kv_len_limit`), the chunks of every query tile and their order;
* each chunk's work item (query/KV offsets, lengths, tile start, KV range) and its rows in the
  partial-output buffer (split tiles take consecutive rows in tile order, so the merge reads a
  request's chunks at a fixed stride), and the merge CTAs' ranges, entry for entry.

What differs: which cluster runs which chunk. MLAPlan hands each chunk, in request order, to the
least-loaded cluster so far; here the chunks are ranked by size and dealt largest first in snake
order (clusters 0..C-1, then C-1..0, ...), which keeps every cluster within one chunk of the mean
and in practice much closer: the slowest cluster's load is 19-34% lower on the recorded ragged
batches of 3-200 requests (tests/data), and the decode kernel, which waits for its slowest
cluster, runs 16-30% faster on the H200 (bench/results/plan_floor_h200.txt;
identical outputs). The kernel does not care which cluster runs a chunk: partial outputs are
merged after a grid-wide barrier.
`tests/test_mla_schedule.py` checks all of this against schedules FlashInfer's MLAPlan wrote on
the H200, and the GPU tests run the kernel on it.

The buffer layout (where each array lives in the int workspace, and the float workspace offsets)
is never computed here: it is taken from one native MLAPlan call (see `ScheduleLayout`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

CTA_TILE_Q = 64                  # query rows (packed heads x tokens) per CTA in MLAPlan
MAX_WORK_ITEMS = 16384           # MLAPlan's per-array capacity
# plan_info vector (MLAPlanInfo::ToVector in scheduler.cuh)
PLAN_INFO_FIELDS = (
    "num_blks_x", "num_blks_y", "q_indptr", "kv_indptr", "partial_indptr", "merge_packed_offset_start",
    "merge_packed_offset_end", "merge_partial_packed_offset_start", "merge_partial_packed_offset_end",
    "merge_partial_stride", "q_len", "kv_len", "q_start", "kv_start", "kv_end", "work_indptr",
    "partial_o", "partial_lse")
WORK_FIELDS = ("q_indptr", "kv_indptr", "partial_indptr", "q_len", "kv_len", "q_start", "kv_start",
               "kv_end")
MERGE_FIELDS = ("merge_packed_offset_start", "merge_packed_offset_end",
                "merge_partial_packed_offset_start", "merge_partial_packed_offset_end",
                "merge_partial_stride")


def cluster_size(avg_packed_q: int) -> int:
    """CTAs per cluster: two when the average packed query length of a request (query tokens x
    heads) exceeds one 64-row tile, else one."""
    return 2 if avg_packed_q > CTA_TILE_Q else 1


def _kv_len_limit(total_kv: int, num_clusters: int) -> int:
    """The longest KV chunk one work item takes (MLAPlan's rounding of total / clusters)."""
    x = max(-(-total_kv // num_clusters), 1)
    if x <= 8:
        return 32
    if x <= 16:
        return 64
    if x <= 32:
        return 128
    if x <= 64:
        return 192
    return -(-x // 256) * 256


@dataclass
class Schedule:
    """One step's schedule: what MLAPlan writes into the int workspace."""
    cluster_size: int
    num_clusters: int
    work_indptr: np.ndarray          # [clusters + 1]
    works: dict                      # WORK_FIELDS -> [num_works] int32
    merges: dict                     # MERGE_FIELDS -> [num_merges] int32 (padded with 0 to num_sm)
    num_merges: int
    # shared by the schedules of consecutive steps that differ only in kv_len / kv_end (see
    # `_Reuse`); `ScheduleLayout.write` then rewrites only those two arrays
    structure: object = None

    @property
    def num_works(self) -> int:
        return int(self.work_indptr[-1])

    def cluster_costs(self) -> np.ndarray:
        """Per cluster: MLAPlan's cost measure summed over its work items (2 x tile rows + KV)."""
        cost = 2 * CTA_TILE_Q * self.cluster_size + (self.works["kv_end"] - self.works["kv_start"])
        owner = np.repeat(np.arange(self.num_clusters), np.diff(self.work_indptr))
        return np.bincount(owner, weights=cost, minlength=self.num_clusters)


def chunk_limit(base_limit: int, kv_chunk: float | None, longest: int) -> int:
    """The KV chunk limit a schedule cuts with: MLAPlan's (`base_limit`) when `kv_chunk` is None,
    else `base_limit` x `kv_chunk` rounded up to a multiple of 32 tokens (at least 32); an
    infinite `kv_chunk` never splits (the limit covers the `longest` tile)."""
    if kv_chunk is None or kv_chunk == 1:
        return base_limit
    if kv_chunk == float("inf"):    # a power of two: the same limit for many steps (reuse)
        return 1 << (max(longest, base_limit, 1) - 1).bit_length()
    return max(32, -(-int(math.ceil(base_limit * kv_chunk)) // 32) * 32)


def mla_schedule(qo_indptr, kv_indptr, kv_len, num_heads: int, causal: bool, num_sm: int,
                 q_len: int | None = None, kv_chunk: float | None = None) -> Schedule | None:
    """The schedule MLAPlan makes for this batch (host int arrays), up to cluster assignment.

    `q_len`, when given, says every request has that many query tokens (qo_indptr is then not
    read for lengths). `kv_chunk` (a tuned choice; None = MLAPlan's) scales the KV chunk limit
    (`chunk_limit`): below 1 cuts long tiles finer (more, smaller work items: better balance,
    more partial outputs to merge), above 1 coarser, infinity never splits. The merge CTAs of a
    split tile stay as many as MLAPlan would give it, which keeps them within the SM count.
    None when the batch would not fit MLAPlan's buffers (more than 16384 work items, more merge
    CTAs than SMs, or more partial-output rows than the float workspace holds for this cluster
    shape, 2 x clusters x tile rows): the caller then plans another way. This runs every decode
    step: whole-array operations only, and the common case (one query tile per request, few
    split requests) skips what it does not need.
    """
    qo_indptr = np.asarray(qo_indptr)
    kv_len = np.asarray(kv_len)
    batch = kv_len.shape[0]
    if batch == 0 or qo_indptr.shape[0] != batch + 1:
        return None
    if q_len is None:
        qo_len = np.diff(qo_indptr)
        if (qo_len < 0).any():
            return None
        avg = int(qo_indptr[-1] - qo_indptr[0]) * num_heads // batch
    else:
        qo_len = None
        avg = q_len * num_heads
    cs = cluster_size(avg)
    clusters = num_sm // cs
    tile_q = CTA_TILE_Q * cs
    qo_len, req, tile, eff, row_tile = _query_tiles(kv_len, qo_len, q_len, num_heads, causal, tile_q)
    base = _kv_len_limit(int(_sum(eff)), clusters)
    limit = base if kv_chunk is None else chunk_limit(base, kv_chunk, int(eff.max()))
    n_chunks = _max((eff + (limit - 1)) // limit, 1)          # a zero-length tile gets one item
    pieces = _max(eff * cs // base, 1)                        # merge pieces of a split tile
    key = (batch, num_heads, causal, num_sm, q_len, limit, base)
    prev = _REUSE.get(key)
    if prev is not None and prev.matches(qo_indptr, np.asarray(kv_indptr), n_chunks, pieces):
        return prev.schedule(kv_len, eff)
    num_works = int(_sum(n_chunks))
    if num_works > MAX_WORK_ITEMS:
        return None
    qo_start = qo_indptr[:-1]
    tile_row0 = qo_start * num_heads if req is None else qo_start[req] * num_heads + tile * tile_q
    items = _work_items(eff, n_chunks, pieces, num_works, row_tile, tile_row0, req is None, limit, base,
                        2 * clusters * tile_q, num_sm)
    if items is None:
        return None
    wt, kv_start, kv_end, partial, merges, num_merges = items

    # clusters: the largest chunk first, dealt in snake order (0..C-1, C-1..0, ...), each
    # cluster's items together (positions from `_deal`, cached per clusters x items)
    positions, work_indptr = _deal(clusters, num_works)
    order = (kv_start - kv_end).argsort(kind="stable")[positions]
    w_tile = order if wt is None else wt[order]
    w_req = w_tile if req is None else req[w_tile]
    works = {
        "q_indptr": qo_start[w_req], "kv_indptr": np.asarray(kv_indptr)[w_req],
        "partial_indptr": partial[order],
        "q_len": np.full(num_works, q_len) if qo_len is None else qo_len[w_req],
        "kv_len": kv_len[w_req],
        "q_start": np.zeros(num_works, dtype=np.int64) if req is None else tile[w_tile] * tile_q,
        "kv_start": kv_start[order], "kv_end": kv_end[order],
    }
    sched = Schedule(cs, clusters, work_indptr, works, merges, num_merges, structure=object())
    if len(_REUSE) >= 32:
        _REUSE.clear()
    _REUSE[key] = _Reuse(qo_indptr, np.asarray(kv_indptr), n_chunks, pieces, sched, w_req, w_tile, limit)
    return sched


def _query_tiles(kv_len, qo_len, q_len, num_heads: int, causal: bool, tile_q: int):
    """The batch's query tiles in MLAPlan's order (request by request, a request's last tile
    first): (per-request query lengths, each tile's request and tile index, the KV it attends
    to, its query rows). The common case, one tile per request, is scalars and None: tile i is
    request i's only one."""
    if q_len is not None and q_len * num_heads <= tile_q:     # one tile per request
        return qo_len, None, 0, kv_len.astype(np.int64), q_len * num_heads    # the last tile sees all the KV
    if qo_len is None:
        qo_len = np.full(kv_len.shape[0], q_len, dtype=np.int64)
    packed = qo_len * num_heads
    n_tiles = -(-packed // tile_q)
    req = np.repeat(np.arange(kv_len.shape[0]), n_tiles)
    first = np.cumsum(n_tiles) - n_tiles
    tile = n_tiles[req] - 1 - (np.arange(req.shape[0]) - first[req])
    eff = kv_len[req].astype(np.int64)
    if causal:
        t_q = qo_len[req]
        cut = np.maximum(np.minimum(eff - t_q + -(-(tile + 1) * tile_q // num_heads), eff), 0)
        eff = np.where(tile + 1 == n_tiles[req], eff, cut)
    return qo_len, req, tile, eff, np.minimum(tile_q, packed[req] - tile * tile_q)


def _work_items(eff, n_chunks, pieces, num_works: int, row_tile, tile_row0, scalar_rows: bool,
                limit: int, base: int, partial_rows: int, num_sm: int):
    """The KV chunks' work items before the deal, and the merge CTAs: (each item's tile, None
    where item i is tile i; its KV start and end; its partial-output row, -1 where its tile is
    not split; the merges; their count). None when the batch would not fit MLAPlan's buffers
    (`partial_rows` partial-output rows, `num_sm` merge CTAs)."""
    num_tiles = eff.shape[0]
    if num_works == num_tiles:                                # nothing split: one item per tile
        merges = {name: np.zeros(0, dtype=np.int64) for name in MERGE_FIELDS}
        return None, np.zeros(num_works, dtype=np.int64), eff, np.full(num_works, -1, dtype=np.int64), merges, 0
    split = n_chunks > 1
    part_rows = n_chunks * row_tile * split
    part_base = _cumsum(part_rows) - part_rows                # a split tile's first partial row
    if limit != base and int(part_base[-1] + part_rows[-1]) > partial_rows:
        return None                                           # partial outputs beyond the buffer
    wt = np.arange(num_tiles).repeat(n_chunks)
    k = np.arange(num_works) - (_cumsum(n_chunks) - n_chunks)[wt]
    kv_start = k * limit
    kv_end = np.minimum(kv_start + limit, eff[wt])
    rt = row_tile if scalar_rows else row_tile[wt]
    partial = (part_base[wt] + k * rt + 1) * split[wt] - 1    # -1 where not split
    found = _merge_ctas(split.nonzero()[0], n_chunks, pieces, row_tile, tile_row0, part_base, scalar_rows,
                        num_sm)
    if found is None:
        return None
    return (wt, kv_start, kv_end, partial) + found


def _merge_ctas(st, n_chunks, pieces, row_tile, tile_row0, part_base, scalar_rows: bool, num_sm: int):
    """The merge CTAs of the split tiles `st`: a split tile's rows cut into about (its KV x
    cluster size / limit) pieces. (MERGE_FIELDS -> arrays, their count), or None beyond `num_sm`."""
    rows = row_tile if scalar_rows else row_tile[st]
    chunk_rows = -(-rows // pieces[st])
    per_tile = -(-rows // chunk_rows)
    num_merges = int(_sum(per_tile))
    if num_merges > num_sm:
        return None
    q0, p0 = tile_row0[st], part_base[st]
    p_end = p0 + n_chunks[st] * rows
    if num_merges == st.shape[0]:                             # one merge CTA per split tile
        m_start, m_end, m_pstart = q0, q0 + _min(chunk_rows, rows), p0
        m_stride = np.full(num_merges, rows) if scalar_rows else rows
    else:
        g = np.arange(st.shape[0]).repeat(per_tile)
        off = (np.arange(num_merges) - (_cumsum(per_tile) - per_tile)[g]) * chunk_rows[g]
        rows_g = rows if scalar_rows else rows[g]
        m_start, m_pstart, p_end = q0[g] + off, p0[g] + off, p_end[g]
        m_end = q0[g] + _min(off + chunk_rows[g], rows_g)
        m_stride = np.full(num_merges, rows) if scalar_rows else rows_g
    return dict(zip(MERGE_FIELDS, (m_start, m_end, m_pstart, p_end, m_stride))), num_merges


class _Reuse:
    """The last schedule of a batch shape, to be reused by the next decode step.

    From one step to the next every request's KV grows by a token: the schedule keeps its shape
    (the same tiles, chunk counts, chunk limit and merge pieces, so the same work items, partial
    rows and merges) and only kv_len and the last chunk's kv_end move. When those inputs are
    equal, the next schedule is the last one with those two arrays refreshed. Its cluster deal
    was ranked on the older lengths: the chunks that grew did so by a few tokens of a chunk limit
    of hundreds to thousands, and any change of shape deals afresh.
    """

    def __init__(self, qo_indptr, kv_indptr, n_chunks, pieces, sched, w_req, w_tile, limit):
        # compared as bytes (dtype included): ~4x cheaper than array comparisons at these sizes
        self.inputs = (n_chunks.tobytes(), pieces.tobytes(), qo_indptr.dtype, qo_indptr.tobytes(),
                       kv_indptr.dtype, kv_indptr.tobytes())
        self.sched, self.w_req, self.w_tile = sched, w_req, w_tile
        self.kv_cap = sched.works["kv_start"] + limit

    def matches(self, qo_indptr, kv_indptr, n_chunks, pieces) -> bool:
        i = self.inputs
        return (n_chunks.tobytes() == i[0] and pieces.tobytes() == i[1] and qo_indptr.dtype == i[2]
                and qo_indptr.tobytes() == i[3] and kv_indptr.dtype == i[4]
                and kv_indptr.tobytes() == i[5])

    def schedule(self, kv_len, eff) -> Schedule:
        s = self.sched
        works = dict(s.works)
        works["kv_len"] = kv_len[self.w_req]
        works["kv_end"] = _min(self.kv_cap, eff[self.w_tile])
        return Schedule(s.cluster_size, s.num_clusters, s.work_indptr, works, s.merges, s.num_merges,
                        structure=s.structure)


_REUSE: dict = {}


def clear_reuse() -> None:
    """Forget every schedule kept for step-to-step reuse (the next plan computes it whole)."""
    _REUSE.clear()


# ufunc entry points: this runs every decode step and np.cumsum & co. cost twice these
_sum, _cumsum, _max, _min = np.add.reduce, np.add.accumulate, np.maximum, np.minimum


@functools.lru_cache(maxsize=4096)
def _deal(clusters: int, num_works: int) -> tuple[np.ndarray, np.ndarray]:
    """Snake deal of `num_works` ranked items over `clusters`: the ranks each cluster gets, all
    clusters' back to back (cluster-major), and the cluster boundaries in that list."""
    turns = -(-num_works // clusters)
    r = np.arange(turns)[None, :] * clusters
    c = np.arange(clusters)[:, None]
    rank = np.where(np.arange(turns)[None, :] % 2 == 0, r + c, r + clusters - 1 - c)
    keep = rank < num_works
    indptr = np.zeros(clusters + 1, dtype=np.int64)
    np.cumsum(keep.sum(axis=1), out=indptr[1:])
    positions = rank[keep]
    positions.flags.writeable = False
    indptr.flags.writeable = False
    return positions, indptr


@dataclass(frozen=True)
class ScheduleLayout:
    """Where MLAPlan keeps each schedule array: the plan-info vector of a native plan with the
    same cluster shape, and the bytes it stages. Taken from FlashInfer, never derived here."""
    plan_info: tuple
    staged_bytes: int
    num_sm: int

    def offset(self, field: str) -> int:
        return int(self.plan_info[PLAN_INFO_FIELDS.index(field)])

    @property
    def cluster_shape(self) -> tuple[int, int]:
        return int(self.plan_info[0]), int(self.plan_info[1])

    def write(self, sched: Schedule, host: np.ndarray, holds: object = None) -> None:
        """Write `sched` into `host`, an int32 view of a staging buffer laid out as MLAPlan's.
        Merge entries past the schedule's are zeroed: every CTA reads its merge slot. `holds` is
        the structure of the schedule `host` holds already (if known): when it is this one's,
        only kv_len and kv_end are written."""
        if (sched.cluster_size, sched.num_clusters) != self.cluster_shape:
            raise ValueError(f"schedule for {sched.cluster_size}x{sched.num_clusters} clusters, "
                             f"layout for {self.cluster_shape}")
        n = sched.num_works
        if holds is not None and holds is sched.structure:
            for name in ("kv_len", "kv_end"):
                o = self.offset(name) // 4
                host[o:o + n] = sched.works[name]
            return
        o = self.offset("work_indptr") // 4
        host[o:o + sched.num_clusters + 1] = sched.work_indptr
        for name in WORK_FIELDS:
            o = self.offset(name) // 4
            host[o:o + n] = sched.works[name]
        m = sched.num_merges
        for name in MERGE_FIELDS:
            o = self.offset(name) // 4
            host[o:o + m] = sched.merges[name]
            host[o + m:o + self.num_sm] = 0


def read_schedule(plan_info, host: np.ndarray, num_sm: int) -> Schedule:
    """The schedule a native MLAPlan wrote into `host` (an int32 view of its staging buffer)."""
    info = [int(x) for x in plan_info]
    at = {name: info[i] // 4 for i, name in enumerate(PLAN_INFO_FIELDS)}
    clusters = info[1]
    work_indptr = host[at["work_indptr"]:at["work_indptr"] + clusters + 1].astype(np.int64)
    n = int(work_indptr[-1])
    works = {name: host[at[name]:at[name] + n].astype(np.int64) for name in WORK_FIELDS}
    merges = {name: host[at[name]:at[name] + num_sm].astype(np.int64) for name in MERGE_FIELDS}
    num_merges = int(np.count_nonzero(merges["merge_partial_stride"]))
    return Schedule(info[0], clusters, work_indptr, works, merges, num_merges)


def same_schedule(a: Schedule, b: Schedule) -> str | None:
    """None when `a` and `b` give the kernel the same work (equal merges; the same work items,
    in any cluster), else what differs."""
    if (a.cluster_size, a.num_clusters) != (b.cluster_size, b.num_clusters):
        return f"cluster shape {a.cluster_size}x{a.num_clusters} != {b.cluster_size}x{b.num_clusters}"
    if a.num_merges != b.num_merges:
        return f"{a.num_merges} merge CTAs != {b.num_merges}"
    for name in MERGE_FIELDS:
        if not np.array_equal(a.merges[name][:a.num_merges], b.merges[name][:b.num_merges]):
            return f"{name} differs"
    if a.num_works != b.num_works:
        return f"{a.num_works} work items != {b.num_works}"
    ka = np.stack([a.works[n] for n in WORK_FIELDS], axis=1)
    kb = np.stack([b.works[n] for n in WORK_FIELDS], axis=1)
    if not np.array_equal(ka[np.lexsort(ka.T[::-1])], kb[np.lexsort(kb.T[::-1])]):
        return "work items differ"
    return None


__all__ = ["CTA_TILE_Q", "MAX_WORK_ITEMS", "MERGE_FIELDS", "PLAN_INFO_FIELDS", "Schedule",
           "ScheduleLayout", "WORK_FIELDS", "chunk_limit", "clear_reuse", "cluster_size", "mla_schedule", "read_schedule",
           "same_schedule"]
