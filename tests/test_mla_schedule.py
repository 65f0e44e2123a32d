"""The numpy MLA schedule (vllm_metax.ops.mla_schedule) against FlashInfer's C++ MLAPlan.

Two oracles: schedules FlashInfer 0.7.2's MLAPlan wrote on the H200 (tests/data/
flashinfer_mlaplan_h200.npz, from bench/experiments/plan_floor.py), and `mlaplan_port`, a line-by-line Python
port of MLAPlan (scheduler.cuh) that is itself checked against those schedules and then drives
random batches. "Same schedule" means what the kernel is given: the merge CTAs entry for entry, and
the same work items (any cluster may run any of them).
"""

from __future__ import annotations

import heapq
import logging
from pathlib import Path

import numpy as np
import pytest

from vllm_metax.ops import mla_schedule as ms

FIXTURE = Path(__file__).parent / "data" / "flashinfer_mlaplan_h200.npz"


def mlaplan_port(qo_indptr, kv_indptr, kv_len, num_heads, causal, num_sm):
    """FlashInfer 0.7.2 MLAPlan's schedule, ported statement by statement (heap ties aside)."""
    qo_indptr, kv_indptr, kv_len = (list(map(int, a)) for a in (qo_indptr, kv_indptr, kv_len))
    batch = len(kv_len)
    reqs = [(i, qo_indptr[i + 1] - qo_indptr[i], kv_len[i]) for i in range(batch)]
    avg = sum(q * num_heads for _, q, _ in reqs) // batch
    cs = 2 if avg > 64 else 1
    clusters = num_sm // cs
    tile_q = 64 * cs

    def causal_end(q, kv, t, n):
        if t + 1 == n:
            return kv
        return max(min(kv - q + -(-(t + 1) * tile_q // num_heads), kv), 0)

    total = 0
    for _, q, kv in reqs:
        n = -(-q * num_heads // tile_q)
        for t in range(n - 1, -1, -1):
            total += causal_end(q, kv, t, n) if causal else kv
    limit = ms._kv_len_limit(total, clusters)
    heap = [(0, c) for c in range(clusters)]
    per_cluster = [[] for _ in range(clusters)]
    merges = []
    partial_nnz = 0
    for i, q, kv in reqs:
        packed = q * num_heads
        n = -(-packed // tile_q)
        for t in range(n - 1, -1, -1):
            remaining = causal_end(q, kv, t, n) if causal else kv
            kv_start = 0
            split = remaining > limit
            row_tile = min(tile_q, packed - t * tile_q)
            if split:
                pieces = max(remaining * cs // limit, 1)
                chunk = -(-row_tile // pieces)
                for off in range(0, row_tile, chunk):
                    base = qo_indptr[i] * num_heads + t * tile_q
                    merges.append((base + off, base + min(off + chunk, row_tile), partial_nnz + off,
                                   partial_nnz + -(-remaining // limit) * row_tile, row_tile))
            zero = remaining == 0
            while remaining > 0 or zero:
                cost, c = heapq.heappop(heap)
                length = min(remaining, limit)
                heapq.heappush(heap, (cost + 2 * tile_q + length, c))
                part = -1
                if split:
                    part = partial_nnz
                    partial_nnz += row_tile
                per_cluster[c].append((qo_indptr[i], kv_indptr[i], part, q, kv, t * tile_q,
                                       kv_start, kv_start + length))
                remaining -= length
                kv_start += length
                if zero:
                    break
    if len(merges) > num_sm or sum(map(len, per_cluster)) > ms.MAX_WORK_ITEMS:
        return None
    flat = [w for c in per_cluster for w in c]
    work_indptr = np.cumsum([0] + [len(c) for c in per_cluster])
    works = {name: np.array([w[j] for w in flat], dtype=np.int64) for j, name in enumerate(ms.WORK_FIELDS)}
    m = np.array(merges, dtype=np.int64).reshape(-1, 5)
    return ms.Schedule(cs, clusters, work_indptr, works,
                       {name: m[:, j] for j, name in enumerate(ms.MERGE_FIELDS)}, len(merges))


def fixture_cases():
    d = np.load(FIXTURE)
    keys = sorted({k.split("_")[0] for k in d.files}, key=lambda k: int(k[1:]))
    for k in keys:
        heads, q_len, causal, num_sm = (int(x) for x in d[f"{k}_in_case"])
        info = d[f"{k}_plan_info"]
        host = np.zeros(160_000, np.int32)            # MLAPlan's int layout ends at ~527 KB
        for name in ("work_indptr",) + ms.WORK_FIELDS + ms.MERGE_FIELDS:
            a = d[f"{k}_out_{name}"]
            o = int(info[ms.PLAN_INFO_FIELDS.index(name)]) // 4
            host[o:o + a.shape[0]] = a
        yield pytest.param(dict(qo_indptr=d[f"{k}_in_qo_indptr"], kv_indptr=d[f"{k}_in_kv_indptr"],
                                kv_len=d[f"{k}_in_kv_len"], num_heads=heads, q_len=q_len,
                                causal=bool(causal), num_sm=num_sm, plan_info=info, host=host),
                           id=f"{k}-H{heads}-B{d[f'{k}_in_kv_len'].shape[0]}-q{q_len}{'-causal' if causal else ''}")


def _ours(case, uniform=True):
    return ms.mla_schedule(case["qo_indptr"], case["kv_indptr"], case["kv_len"], case["num_heads"],
                           case["causal"], case["num_sm"], q_len=case["q_len"] if uniform else None)


def _bound(s: ms.Schedule) -> float:
    """Snake dealing of chunks sorted by cost keeps every cluster within one chunk of the mean."""
    cost = 2 * ms.CTA_TILE_Q * s.cluster_size + (s.works["kv_end"] - s.works["kv_start"])
    return cost.sum() / s.num_clusters + cost.max()


@pytest.mark.parametrize("case", list(fixture_cases()))
def test_numpy_schedule_gives_the_kernel_what_flashinfers_mlaplan_gave_it(case):
    native = ms.read_schedule(case["plan_info"], case["host"], case["num_sm"])
    assert native.num_works > 0
    for uniform in (True, False):
        ours = _ours(case, uniform)
        assert ms.same_schedule(ours, native) is None
    # and never a worse balance than MLAPlan's heap (on these batches: better or equal)
    assert ours.cluster_costs().max() <= native.cluster_costs().max()
    assert ours.cluster_costs().max() <= _bound(ours)
    # the port used as the oracle below agrees with FlashInfer as well
    port = mlaplan_port(case["qo_indptr"], case["kv_indptr"], case["kv_len"], case["num_heads"],
                        case["causal"], case["num_sm"])
    assert ms.same_schedule(port, native) is None


def _random_batch(rng):
    heads = int(rng.choice([1, 8, 16, 32, 64, 128]))
    q_len = int(rng.choice([1, 1, 1, 2, 3, 4, 7]))
    batch = int(rng.integers(1, 300))
    hi = int(rng.choice([4, 100, 5000, 70000]))
    kv_len = rng.integers(0 if rng.random() < 0.2 else q_len, hi + q_len, batch)
    width = int(-(-kv_len.max() // 16)) + 1
    return (np.arange(batch + 1) * q_len, np.arange(batch + 1) * width, kv_len, heads, q_len,
            bool(rng.random() < 0.5))


def test_numpy_schedule_matches_the_mlaplan_port_on_random_batches():
    rng = np.random.default_rng(0)
    seen = {"split": 0, "multi_tile": 0, "multi_merge": 0, "none": 0}
    for _ in range(300):
        qo, kvi, kvl, heads, q_len, causal = _random_batch(rng)
        num_sm = int(rng.choice([132, 104, 8]))
        port = mlaplan_port(qo, kvi, kvl, heads, causal, num_sm)
        for uniform in (True, False):
            ours = ms.mla_schedule(qo.astype(np.int32), kvi.astype(np.int32), kvl.astype(np.int32),
                                   heads, causal, num_sm, q_len=q_len if uniform else None)
            if port is None:
                assert ours is None
                continue
            assert ms.same_schedule(ours, port) is None, (heads, q_len, causal, len(kvl))
            assert ours.cluster_costs().max() <= _bound(ours)
            assert np.all(np.diff(ours.work_indptr) >= 0) and ours.work_indptr[0] == 0
            assert ours.num_merges <= num_sm
        if port is None:
            seen["none"] += 1
            continue
        seen["split"] += bool((port.works["partial_indptr"] >= 0).any())
        seen["multi_tile"] += bool(q_len * heads > 64 * port.cluster_size)
        seen["multi_merge"] += bool(port.num_merges > np.count_nonzero(
            np.diff(port.merges["merge_partial_packed_offset_end"]) != 0) + 1)
    assert all(v > 0 for k, v in seen.items() if k != "none"), seen   # every path was exercised


def test_capacity_limits_return_none_as_mlaplan_refuses():
    # more than 16384 work items (more merge CTAs than SMs cannot happen: MLAPlan proves
    # merges <= SMs, which the random test above checks too)
    assert ms.mla_schedule(np.arange(20_001), np.arange(20_001), np.ones(20_000, np.int32), 16, False,
                           132, q_len=1) is None
    assert ms.mla_schedule(np.arange(1), np.arange(1), np.zeros(0, np.int32), 16, False, 132) is None


def test_layout_write_round_trips_and_clears_stale_merge_slots():
    case = next(iter(fixture_cases())).values[0]
    info = tuple(int(x) for x in case["plan_info"])
    layout = ms.ScheduleLayout(info, 592464, case["num_sm"])
    host = np.full(160_000, 7, np.int32)                       # stale data from an earlier plan
    sched = _ours(case)
    layout.write(sched, host)
    back = ms.read_schedule(info, host, case["num_sm"])
    assert ms.same_schedule(back, sched) is None
    o = layout.offset("merge_partial_stride") // 4
    assert (host[o + sched.num_merges:o + case["num_sm"]] == 0).all()
    assert np.array_equal(back.work_indptr, sched.work_indptr)
    wrong = ms.mla_schedule(np.arange(3) * 2, np.arange(3), np.array([10, 20]), 128, True, 132, q_len=2)
    with pytest.raises(ValueError, match="clusters"):
        layout.write(wrong, host)                              # 2-CTA clusters, 1-CTA layout


class _Planned:
    """The parts of FlashInfer's planned fa3 backend the layout key reads."""
    _backend = "fa3"
    device = "cuda:0"

    def __init__(self):
        import torch
        self._float_workspace_buffer = torch.empty(16, dtype=torch.uint8)
        self._int_workspace_buffer = torch.empty(8, dtype=torch.uint8)


class _Ring:
    """The staging ring's host side (its pinned buffers need CUDA): one buffer, stale data."""
    def __init__(self):
        self.views = [np.full(160_000, 7, np.int32)]
        self.holds = [None]
        self.next = 0


def _meta(case):
    import torch
    from vllm_metax.ops.paged_metadata import PagedMetadata
    return PagedMetadata(torch.from_numpy(case["qo_indptr"]), torch.from_numpy(case["kv_indptr"]),
                         torch.from_numpy(case["kv_len"]), torch.zeros(1, dtype=torch.int32), 0,
                         compact=False, q_len=case["q_len"])


def test_layout_is_learnt_from_a_matching_native_plan_then_used(monkeypatch):
    from vllm_metax.ops import fast_replan as op
    monkeypatch.setattr(op, "_LAYOUTS", {})
    monkeypatch.setattr(op, "sm_count", lambda device: 132)
    cases = [c.values[0] for c in fixture_cases()]
    small, big = cases[1], cases[4]                            # H16 B6 and H16 B128: one cluster shape
    be = _Planned()
    op._learn_layout(be, _meta(small), 16, 512, False, small["plan_info"], 592464, small["host"])
    ring = _Ring()
    host = ring.views[0]
    assert op._numpy_plan(be, _meta(small), 16, 512, False, ring) is None    # below the batch cut
    plan_info, staged, made_by = op._numpy_plan(be, _meta(big), 16, 512, False, ring)
    assert plan_info is small["plan_info"] and staged == 592464             # FlashInfer's own object
    assert made_by == "numpy"
    got = ms.read_schedule(plan_info, host, 132)
    assert ms.same_schedule(got, ms.read_schedule(big["plan_info"], big["host"], 132)) is None
    # 128 heads is the 2-CTA cluster shape: not learnt yet, so MLAPlan plans it
    assert op._numpy_plan(be, _meta(cases[5]), 128, 512, False, ring) is None


def test_a_disagreeing_native_plan_switches_the_numpy_schedule_off(monkeypatch, caplog):
    from vllm_metax.ops import fast_replan as op
    monkeypatch.setattr(op, "_LAYOUTS", {})
    monkeypatch.setattr(op, "sm_count", lambda device: 132)
    case = [c.values[0] for c in fixture_cases()][4]
    host = case["host"].copy()
    o = int(case["plan_info"][ms.PLAN_INFO_FIELDS.index("kv_end")]) // 4
    host[o] += 1                                               # MLAPlan would have cut a chunk elsewhere
    be = _Planned()
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_metax.ops.fast_replan"):
        op._learn_layout(be, _meta(case), 16, 512, False, case["plan_info"], 592464, host)
    assert "differs from FlashInfer's MLAPlan" in caplog.text
    assert op._numpy_plan(be, _meta(case), 16, 512, False, _Ring()) is None


def test_consecutive_decode_steps_reuse_the_schedule_and_write_only_what_moved():
    """Step to step every request gains a token: while no chunk count or merge split changes,
    the schedule is the previous one with kv_len/kv_end refreshed, written as two arrays into a
    buffer that holds its structure; each step still equals MLAPlan's (the port's) schedule."""
    rng = np.random.default_rng(3)
    batch, heads, num_sm = 64, 16, 132
    lens = rng.integers(2000, 6000, batch)
    qo, kvi = np.arange(batch + 1), np.arange(batch + 1) * 200
    layout = None
    full, partial = np.full(160_000, 7, np.int32), np.full(160_000, 7, np.int32)
    holds, reused, structures = None, 0, set()
    for step in range(40):
        kvl = (lens + step).astype(np.int32)
        ours = ms.mla_schedule(qo, kvi, kvl, heads, False, num_sm, q_len=1)
        assert ms.same_schedule(ours, mlaplan_port(qo, kvi, kvl, heads, False, num_sm)) is None, step
        if layout is None:
            case = next(iter(fixture_cases())).values[0]    # H16: the same 1-CTA cluster layout
            layout = ms.ScheduleLayout(tuple(int(x) for x in case["plan_info"]), 592464, num_sm)
        reused += ours.structure is holds
        structures.add(id(ours.structure))
        layout.write(ours, full)
        layout.write(ours, partial, holds=holds)
        holds = ours.structure
        assert np.array_equal(partial, full), step
    assert reused >= 30 and len(structures) >= 2, (reused, len(structures))


# ------------------------------------------------------------------ tuned KV chunking

def _simulate(sched, qo_indptr, kv_len, num_heads, rng, d=4):
    """What the fa2/fa3 MLA kernel computes from `sched` (its contract as MLAPlan writes it),
    in float64 on tiny vectors: every work item attends its tile's rows to its KV range, writing
    the final rows (unsplit) or partial rows + LSE (split); every merge CTA combines a split
    tile's partial rows at their stride. Returns (out, exact): the scheduled result and plain
    softmax attention of the same numbers. Non-causal, one query token per request."""
    batch = kv_len.shape[0]
    rows = int(qo_indptr[-1]) * num_heads
    q = rng.standard_normal((rows, d))
    keys = [rng.standard_normal((int(n), d)) for n in kv_len]
    vals = [rng.standard_normal((int(n), d)) for n in kv_len]
    out = np.full((rows, d), np.nan)
    n_part = 2 * sched.num_clusters * CTA * sched.cluster_size
    part_o, part_lse = np.full((n_part, d), np.nan), np.full(n_part, np.nan)
    w = sched.works
    for i in range(sched.num_works):
        r = int(np.searchsorted(qo_indptr, w["q_indptr"][i], side="right") - 1)
        assert int(w["kv_len"][i]) == int(kv_len[r])
        packed = int(w["q_len"][i]) * num_heads
        n_rows = min(CTA * sched.cluster_size, packed - int(w["q_start"][i]))
        s, e = int(w["kv_start"][i]), int(w["kv_end"][i])
        for j in range(n_rows):
            row = int(w["q_indptr"][i]) * num_heads + int(w["q_start"][i]) + j
            logits = keys[r][s:e] @ q[row]
            m = logits.max()
            p = np.exp(logits - m)
            o, lse = (p @ vals[r][s:e]) / p.sum(), m + np.log(p.sum())
            if w["partial_indptr"][i] < 0:
                assert np.isnan(out[row]).all(), "a final row written twice"
                out[row] = o
            else:
                k = int(w["partial_indptr"][i]) + j
                assert np.isnan(part_lse[k]), "a partial row written twice"
                part_o[k], part_lse[k] = o, lse
    mg = sched.merges
    for m in range(sched.num_merges):
        start, end = int(mg["merge_packed_offset_start"][m]), int(mg["merge_packed_offset_end"][m])
        p0, p_end = int(mg["merge_partial_packed_offset_start"][m]), int(mg["merge_partial_packed_offset_end"][m])
        stride = int(mg["merge_partial_stride"][m])
        for j in range(end - start):
            ks = list(range(p0 + j, p_end, stride))
            lse = part_lse[ks]
            assert not np.isnan(lse).any(), "a merge read a partial row nobody wrote"
            wts = np.exp(lse - lse.max())
            assert np.isnan(out[start + j]).all(), "a final row written twice"
            out[start + j] = (wts[:, None] * part_o[ks]).sum(0) / wts.sum()
    exact = np.empty_like(out)
    for r in range(batch):
        for h in range(num_heads):
            row = int(qo_indptr[r]) * num_heads + h
            logits = keys[r] @ q[row]
            p = np.exp(logits - logits.max())
            exact[row] = (p @ vals[r]) / p.sum()
    return out, exact


CTA = ms.CTA_TILE_Q


@pytest.mark.parametrize("kv_chunk", [None, 0.25, 0.5, 2.0, 4.0, float("inf")])
@pytest.mark.parametrize("heads,lens", [
    (16, [3000]),                                  # one long request: split over many clusters
    (16, [5, 700, 40, 2900, 128, 1]),              # ragged, a zero-work request included
    (128, [900, 60, 2000]),                        # the 2-CTA cluster shape
    (16, [300] * 40),                              # a batch that MLAPlan barely splits
])
def test_a_chunked_schedule_computes_the_attention_the_unchunked_one_does(kv_chunk, heads, lens):
    """Every tuned kv_chunk gives a schedule the kernel's contract turns into exact attention:
    each row's KV covered once, partial rows and merges consistent, chunks within the limit."""
    num_sm = 16                                      # small: more splitting at these lengths
    kv_len = np.array(lens, dtype=np.int32)
    qo = np.arange(len(lens) + 1, dtype=np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(-(-kv_len // 64))]).astype(np.int32)
    sched = ms.mla_schedule(qo, kv_indptr, kv_len, heads, False, num_sm, q_len=1, kv_chunk=kv_chunk)
    if sched is None:       # allowed only where the chunking overflows a buffer: say which
        base = ms.mla_schedule(qo, kv_indptr, kv_len, heads, False, num_sm, q_len=1)
        assert base is not None and kv_chunk is not None and kv_chunk < 1
        return
    base_limit = ms._kv_len_limit(int(kv_len.sum()), sched.num_clusters)
    limit = ms.chunk_limit(base_limit, kv_chunk, int(kv_len.max()))
    assert ((sched.works["kv_end"] - sched.works["kv_start"]) <= limit).all()
    assert sched.num_merges <= num_sm
    if kv_chunk == float("inf"):
        assert sched.num_merges == 0 and sched.num_works == len(lens)
    out, exact = _simulate(sched, qo, kv_len, heads, np.random.default_rng(0))
    ok = kv_len > 0
    rows_ok = np.repeat(ok, heads)
    assert np.allclose(out[rows_ok], exact[rows_ok], atol=1e-12)


def test_finer_chunks_make_more_work_items_and_coarser_fewer():
    kv_len = np.array([5000, 3000, 7000, 100], dtype=np.int32)
    qo = np.arange(5, dtype=np.int32)
    kvi = np.concatenate([[0], np.cumsum(kv_len)]).astype(np.int32)
    n = {c: ms.mla_schedule(qo, kvi, kv_len, 16, False, 132, q_len=1, kv_chunk=c).num_works
         for c in (0.5, None, 2.0, float("inf"))}
    assert n[0.5] > n[None] > n[2.0] > n[float("inf")] == 4


def test_a_chunking_beyond_the_partial_buffer_is_refused_not_written():
    """128 heads fill a 128-row tile per request: 2 x clusters tiles of partial rows is all the
    float workspace holds. A quarter-size chunk over 66 long requests needs more: None (the
    caller then plans untuned), never a schedule that writes past the buffer."""
    kv_len = np.full(66, 4096, dtype=np.int32)
    qo = np.arange(67, dtype=np.int32)
    kvi = np.concatenate([[0], np.cumsum(kv_len)]).astype(np.int32)
    assert ms.mla_schedule(qo, kvi, kv_len, 128, False, 132, q_len=1) is not None
    assert ms.mla_schedule(qo, kvi, kv_len, 128, False, 132, q_len=1, kv_chunk=0.25) is None


def test_chunk_limit_rounds_to_32_and_never_splits_at_infinity():
    assert ms.chunk_limit(256, None, 10_000) == 256
    assert ms.chunk_limit(256, 0.25, 10_000) == 64
    assert ms.chunk_limit(192, 0.25, 10_000) == 64          # 48 rounded up to 32s
    assert ms.chunk_limit(32, 0.25, 10_000) == 32           # never below 32 tokens
    assert ms.chunk_limit(256, 4.0, 10_000) == 1024
    assert ms.chunk_limit(256, float("inf"), 10_000) == 16384
    assert ms.chunk_limit(256, float("inf"), 100) == 256
