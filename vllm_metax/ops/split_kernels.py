"""The split-KV Triton MLA decode kernels (paged KV, q_len 1): what runs on the GPU. Their launch,
knobs, workspaces and the served configuration are `vllm_metax.ops.split_decode`'s.

Absorbed MLA, q_len 1: per head, scores = (q_nope . ckv + q_pe . kpe) * scale over the request's
tokens, softmax, out = P @ ckv. The grid is (splits, head blocks, batch); a program reduces one
contiguous token range of one request (BLOCK_N tokens an iteration, read through the page table,
tl.dot with fp32 accumulation for QK and PV) into a normalised partial (acc / l, log2-sum-exp) in
a workspace. How the partials are merged:

* "fused" (`pointer_kernel` with FUSED, one launch): after writing its partial, a program bumps a
  per-(request, head block) int32 counter (CTA barrier, then one acq_rel atomic); the last one to
  arrive merges every split's partial from the workspace into the output and resets the counter
  to 0, so a CUDA-graph replay needs no memset. That one program reads all S partials of its
  (request, head block): S x BLOCK_H x R x 4 bytes through one SM, so it suits few splits.
* "kernel" (`merge_kernel`, a second launch): spread over (head, 512/DC column blocks, request)
  programs, so no single program reads all partials of a request.

The merge is a runtime flag, not a constexpr: one compile serves both. A request whose range fits
one split writes the output directly (no partial, no counter). Splits past a request's length
do nothing. `pointer_kernel` loads every tile through registers; `tma_kernel` has the
tensor-memory accelerator copy them into shared memory (Hopper).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _split_range(seq_len, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Tokens per split (a multiple of BLOCK_N, at least BLOCK_N) and the splits holding any."""
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, BLOCK_N)
    return chunk, tl.cdiv(seq_len, chunk)


@triton.jit
def _request(SEQ, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """A program's request (the grid's third axis, in every kernel here), its length, and its
    split rule (`_split_range`)."""
    b = tl.program_id(2)
    seq_len = tl.load(SEQ + b)
    chunk, n_active = _split_range(seq_len, NUM_SPLITS, BLOCK_N)
    return b, seq_len, chunk, n_active


@triton.jit
def _split_program(SEQ, NUM_SPLITS, H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """A split kernel's program: its split and head block (the grid's first two axes), its
    request (`_request`) and that request's row offset as int64, its heads and their mask."""
    split = tl.program_id(0)
    hb = tl.program_id(1)
    b, seq_len, chunk, n_active = _request(SEQ, NUM_SPLITS, BLOCK_N)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    return split, hb, b, b.to(tl.int64), seq_len, chunk, n_active, offs_h, offs_h < H


@triton.jit
def _merge_splits(WS_ACC, WS_LSE, out_rows, ws_b, n_active, offs_h, hmask,
                  HP: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, MERGE_D: tl.constexpr):
    """The fused merge, run by the last split of a (request, head block): every split's partial
    from the workspace (its own too: the accumulator is dead by now, so the merge costs no
    registers beyond its tiles), MERGE_D columns at a time, the next split's tile loaded before
    the current one is folded in. Loads are .cg: from L2, never a stale L1 line."""
    offs_hp = tl.arange(0, BLOCK_H)
    for d0 in tl.static_range(0, R, MERGE_D):
        offs_d = d0 + tl.arange(0, MERGE_D)
        big_m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, MERGE_D], tl.float32)
        row = ws_b * HP + offs_h
        nxt_lse = tl.load(WS_LSE + row, cache_modifier=".cg")
        nxt_acc = tl.load(WS_ACC + row[:, None] * R + offs_d[None, :], cache_modifier=".cg")
        for s_i in range(0, n_active):
            cur_lse = nxt_lse
            cur_acc = nxt_acc
            row = (ws_b + s_i + 1) * HP + offs_h
            ok = (offs_hp >= 0) & (s_i + 1 < n_active)
            nxt_lse = tl.load(WS_LSE + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
            nxt_acc = tl.load(WS_ACC + row[:, None] * R + offs_d[None, :], mask=ok[:, None], other=0.0,
                              cache_modifier=".cg")
            m_new = tl.maximum(big_m, cur_lse)
            alpha = tl.exp2(big_m - m_new)
            w = tl.exp2(cur_lse - m_new)
            acc = acc * alpha[:, None] + cur_acc.to(tl.float32) * w[:, None]
            total = total * alpha + w
            big_m = m_new
        tl.store(out_rows[:, None] + offs_d[None, :], (acc / total[:, None]).to(out_rows.dtype.element_ty),
                 mask=hmask[:, None])


@triton.jit
def _store_partial(WS_ACC, WS_LSE, ws_row, offs_r, acc, m, l, hmask, R: tl.constexpr, HP: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """A split's normalised partial and its log2-sum-exp (m + log2 l) into the workspace rows of
    its heads. A workspace of whole head blocks (HP a multiple of BLOCK_H: the heads fill their
    blocks) takes the tile unmasked; else only the real heads are written (the rows past them
    belong to the next split)."""
    if HP % BLOCK_H == 0:
        tl.store(WS_ACC + ws_row[:, None] * R + offs_r[None, :], acc.to(WS_ACC.dtype.element_ty))
        tl.store(WS_LSE + ws_row, m + tl.log2(l))
    else:
        tl.store(WS_ACC + ws_row[:, None] * R + offs_r[None, :], acc.to(WS_ACC.dtype.element_ty),
                 mask=hmask[:, None])
        tl.store(WS_LSE + ws_row, m + tl.log2(l), mask=hmask)


@triton.jit
def _tile_update(qa, qb, ckv, kpe, m, l, acc, qk_scale, t0, end, BLOCK_N: tl.constexpr,
                 TRANS: tl.constexpr, MASKED: tl.constexpr):
    """One BLOCK_N-token tile folded into the running (max, sum, accumulator) of a split.
    TRANS: tokens as the dots' M (`qa`, `qb` are q^T, `acc` is [R, BLOCK_H]); MASKED: the tile
    runs past the split's end (only a split's last tile can)."""
    offs_n = t0 + tl.arange(0, BLOCK_N)
    if TRANS:
        s_t = tl.dot(kpe, qb, tl.dot(ckv, qa)) * qk_scale
        if MASKED:
            s_t = tl.where((offs_n < end)[:, None], s_t, float("-inf"))
        m_new = tl.maximum(m, tl.max(s_t, 0))
        alpha = tl.exp2(m - m_new)
        p_t = tl.exp2(s_t - m_new[None, :])
        l = l * alpha + tl.sum(p_t, 0)
        acc = tl.dot(tl.trans(ckv), p_t.to(ckv.dtype), acc * alpha[None, :])
    else:
        s = tl.dot(qb, tl.trans(kpe), tl.dot(qa, tl.trans(ckv))) * qk_scale
        if MASKED:
            s = tl.where((offs_n < end)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(ckv.dtype), ckv, acc * alpha[:, None])
    return m_new, l, acc


@triton.jit
def _tma_tile(CKV_DESC, KPE_DESC, row, qa, qb, m, l, acc, qk_scale, t0, end, BLOCK_N: tl.constexpr,
              TRANS: tl.constexpr):
    """A whole tile of the TMA kernel (cache rows row .. row + BLOCK_N) folded in."""
    ckv = CKV_DESC.load([row, 0])
    kpe = KPE_DESC.load([row, 0])
    return _tile_update(qa, qb, ckv, kpe, m, l, acc, qk_scale, t0, end, BLOCK_N, TRANS, False)


@triton.jit
def _split_init(QN, QP, b64, offs_h, hmask, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
                R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr, TRANS: tl.constexpr):
    """A split's queries in the dots' orientation (TRANS: q^T, tokens as the dots' M) and its
    empty running (max, sum, accumulator)."""
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, P)
    q_nope = tl.load(QN + b64 * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_r[None, :],
                     mask=hmask[:, None], other=0.0)
    q_pe = tl.load(QP + b64 * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_p[None, :],
                   mask=hmask[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    if TRANS:
        return tl.trans(q_nope), tl.trans(q_pe), m, l, tl.zeros([R, BLOCK_H], tl.float32)
    else:
        return q_nope, q_pe, m, l, tl.zeros([BLOCK_H, R], tl.float32)


@triton.jit(do_not_specialize=["NUM_SPLITS", "stride_bt", "FUSED"])
def pointer_kernel(
    QN, QP, CKV, KPE, BT, SEQ, OUT, WS_ACC, WS_LSE, COUNTER,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
    stride_c_p, stride_c_t, stride_k_p, stride_k_t, stride_bt,
    stride_o_b, stride_o_h,
    qk_scale, NUM_SPLITS, FUSED,
    H: tl.constexpr, HP: tl.constexpr, R: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MERGE_D: tl.constexpr,
    TRANS: tl.constexpr,
):
    split, hb, b, b64, seq_len, chunk, n_active, offs_h, hmask = _split_program(SEQ, NUM_SPLITS, H, BLOCK_H,
                                                                                BLOCK_N)
    offs_r = tl.arange(0, R)
    offs_p = tl.arange(0, P)
    out_rows = OUT + b64 * stride_o_b + offs_h * stride_o_h
    out_ptrs = out_rows[:, None] + offs_r[None, :]

    if split < n_active:
        # tokens as the dots' M where TRANS (BLOCK_N >= 64: Hopper's wgmma, operands from shared memory)
        qa, qb, m, l, acc = _split_init(QN, QP, b64, offs_h, hmask, stride_qn_b, stride_qn_h, stride_qp_b,
                                        stride_qp_h, R, P, BLOCK_H, TRANS)
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)
        bt_row = BT + b64 * stride_bt
        for t0 in range(start, end, BLOCK_N):
            offs_n = t0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            page = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
            slot = offs_n % PAGE
            ckv = tl.load(CKV + (page * stride_c_p + slot * stride_c_t)[:, None] + offs_r[None, :],
                          mask=nmask[:, None], other=0.0)
            kpe = tl.load(KPE + (page * stride_k_p + slot * stride_k_t)[:, None] + offs_p[None, :],
                          mask=nmask[:, None], other=0.0)
            m, l, acc = _tile_update(qa, qb, ckv, kpe, m, l, acc, qk_scale, t0, end, BLOCK_N, TRANS, True)
        if TRANS:
            acc = tl.trans(acc)
        acc = acc / l[:, None]
        if n_active == 1:
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=hmask[:, None])
        else:
            ws_row = (b64 * NUM_SPLITS + split) * HP + offs_h
            _store_partial(WS_ACC, WS_LSE, ws_row, offs_r, acc, m, l, hmask, R, HP, BLOCK_H)
            if FUSED != 0:
                # every thread's partial is written before one thread's release of the counter
                tl.debug_barrier()
                cnt = COUNTER + b * (HP // BLOCK_H) + hb
                arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
                if arrived == n_active - 1:
                    _merge_splits(WS_ACC, WS_LSE, out_rows, b64 * NUM_SPLITS, n_active, offs_h, hmask,
                                  HP, R, BLOCK_H, MERGE_D)
                    tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
    if (seq_len == 0) & (split == 0):
        tl.store(out_ptrs, tl.zeros([BLOCK_H, R], tl.float32).to(OUT.dtype.element_ty), mask=hmask[:, None])


@triton.jit(do_not_specialize=["NUM_SPLITS", "stride_bt"])
def tma_kernel(
    QN, QP, CKV_DESC, KPE_DESC, BT, SEQ, OUT, WS_ACC, WS_LSE,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_bt, stride_o_b, stride_o_h,
    qk_scale, NUM_SPLITS,
    H: tl.constexpr, HP: tl.constexpr, R: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, TRANS: tl.constexpr, GROUP_PAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The split kernel with its KV tiles fetched by the tensor-memory accelerator: the caches
    are [pages x PAGE, R] / [.., P] row views (`CKV_DESC`, `KPE_DESC`, block [BLOCK_N, R|P]),
    a tile is BLOCK_N rows of one page (PAGE % BLOCK_N == 0), so Triton's pipeliner
    double-buffers the copies in shared memory and both dots read them there (wgmma, no register
    copy of the tile). The pointer kernel above loads each tile into registers unpipelined
    (sm_90a ptxas: 255 registers and spills at 16 and 128 heads). The tail tile past a split's
    end is zeroed in registers (stale cache slots never reach the PV dot). Partials go to the
    workspace for `merge_kernel`; a request of one split writes the output directly."""
    if PDL:
        # the merge grid may launch once every program here has started (it waits for this
        # grid's completion before it reads the workspace): its launch overlaps this grid's work
        tl.extra.cuda.gdc_launch_dependents()
    split, hb, b, b64, seq_len, chunk, n_active, offs_h, hmask = _split_program(SEQ, NUM_SPLITS, H, BLOCK_H,
                                                                                BLOCK_N)
    offs_r = tl.arange(0, R)
    # the output's pointers are formed only where stored: a [BLOCK_H, R] tile of 64-bit pointers
    # live across the loop costs 64 registers a thread at 8 warps (ptxas: spills)
    out_row = OUT + b64 * stride_o_b
    if split < n_active:
        qa, qb, m, l, acc = _split_init(QN, QP, b64, offs_h, hmask, stride_qn_b, stride_qn_h, stride_qp_b,
                                        stride_qp_h, R, P, BLOCK_H, TRANS)
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)
        full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
        bt_row = BT + b64 * stride_bt
        # GROUP_PAGES 0: one block-table load a tile, in the loop. sm_90a TTGIR (Triton 3.6): at 2
        # stages the next tile's copy is issued after this tile's dots and its block-table load,
        # so copies and dots never overlap; at 3-4 stages the pipeliner spends a stage on the
        # block-table load and the copies still get 2 buffers. Else the page ids of GROUP_PAGES
        # pages are loaded ahead of their tiles (one tile's page picked out in registers): no
        # global load feeds a copy's address, and 3-4 stages give the copies 3-4 buffers (2-3
        # copies in flight during a tile's dots; the PV dot is left async across iterations)
        if GROUP_PAGES == 0:
            for t0 in range(start, full_end, BLOCK_N):
                row = tl.load(bt_row + t0 // PAGE) * PAGE + t0 % PAGE
                m, l, acc = _tma_tile(CKV_DESC, KPE_DESC, row, qa, qb, m, l, acc, qk_scale, t0, end, BLOCK_N, TRANS)
        else:
            offs_g = tl.arange(0, GROUP_PAGES)
            for g0 in range(start - start % PAGE, full_end, GROUP_PAGES * PAGE):
                g_pages = tl.load(bt_row + g0 // PAGE + offs_g, mask=g0 + offs_g * PAGE < full_end, other=0)
                for t0 in range(tl.maximum(g0, start), tl.minimum(g0 + GROUP_PAGES * PAGE, full_end), BLOCK_N):
                    pg = tl.sum(tl.where(offs_g == (t0 - g0) // PAGE, g_pages, 0), 0)
                    m, l, acc = _tma_tile(CKV_DESC, KPE_DESC, pg * PAGE + t0 % PAGE, qa, qb, m, l, acc, qk_scale,
                                          t0, end, BLOCK_N, TRANS)
        if full_end < end:
            row = tl.load(bt_row + full_end // PAGE) * PAGE + full_end % PAGE
            keep = (full_end + tl.arange(0, BLOCK_N)) < end
            ckv = tl.where(keep[:, None], CKV_DESC.load([row, 0]), 0.0)
            kpe = tl.where(keep[:, None], KPE_DESC.load([row, 0]), 0.0)
            m, l, acc = _tile_update(qa, qb, ckv, kpe, m, l, acc, qk_scale, full_end, end, BLOCK_N, TRANS,
                                     True)
        if TRANS:
            acc = tl.trans(acc)
        acc = acc / l[:, None]
        if n_active == 1:
            tl.store(out_row + offs_h[:, None] * stride_o_h + offs_r[None, :], acc.to(OUT.dtype.element_ty),
                     mask=hmask[:, None])
        else:
            ws_row = (b64 * NUM_SPLITS + split) * HP + offs_h
            _store_partial(WS_ACC, WS_LSE, ws_row, offs_r, acc, m, l, hmask, R, HP, BLOCK_H)
    if (seq_len == 0) & (split == 0):
        tl.store(out_row + offs_h[:, None] * stride_o_h + offs_r[None, :],
                 tl.zeros([BLOCK_H, R], tl.float32).to(OUT.dtype.element_ty), mask=hmask[:, None])


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def merge_kernel(
    WS_ACC, WS_LSE, SEQ, OUT, stride_o_b, stride_o_h, NUM_SPLITS,
    HP: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, DC: tl.constexpr, ST: tl.constexpr,
    PDL: tl.constexpr = False,
):
    h = tl.program_id(0)
    dc = tl.program_id(1)
    b, seq_len, chunk, n_active = _request(SEQ, NUM_SPLITS, BLOCK_N)
    if PDL:
        # launched as the split kernel's programmatic dependent: every program waits for the
        # split grid's completion (and its workspace writes) before it reads the workspace, so
        # this grid never completes before it. The lengths are the step's input, written before
        # the split grid started: read above, while the split grid still runs
        tl.extra.cuda.gdc_wait()
    if n_active > 1:
        b64 = b.to(tl.int64)
        offs_s = tl.arange(0, ST)
        offs_d = dc * DC + tl.arange(0, DC)
        big_m = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([DC], tl.float32)
        for s0 in range(0, n_active, ST):
            ss = s0 + offs_s
            smask = ss < n_active
            row = (b64 * NUM_SPLITS + ss) * HP + h
            lse = tl.load(WS_LSE + row, mask=smask, other=float("-inf"))
            part = tl.load(WS_ACC + row[:, None] * R + offs_d[None, :], mask=smask[:, None], other=0.0)
            m_new = tl.maximum(big_m, tl.max(lse, 0))
            alpha = tl.exp2(big_m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + tl.sum(part.to(tl.float32) * w[:, None], 0)
            total = total * alpha + tl.sum(w, 0)
            big_m = m_new
        tl.store(OUT + b64 * stride_o_b + h * stride_o_h + offs_d, (acc / total).to(OUT.dtype.element_ty))
