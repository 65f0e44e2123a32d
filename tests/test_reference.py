"""The torch reference against an unpaged computation: shuffled pages, ragged lengths, lengths not
divisible by the page size, causal q_len > 1."""

import math

import pytest
import torch

from mla_tune.problem.workload import Workload
from mla_tune.problem.instance import make_problem
from mla_tune.problem.reference import gather_pages, mla_decode_reference, mla_decode_unpaged, relative_error

SCALE = 192 ** -0.5


def _contiguous(problem):
    ckv, kpe = [], []
    for b, n in enumerate(problem.seq_lens_cpu.tolist()):
        ckv.append(gather_pages(problem.ckv_cache, problem.block_table[b], n))
        kpe.append(gather_pages(problem.kpe_cache, problem.block_table[b], n))
    return ckv, kpe


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
@pytest.mark.parametrize("ragged", ["uniform", "uniform-random", "lognormal"])
def test_paged_matches_unpaged(page_size, ragged):
    w = Workload(num_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, softmax_scale=SCALE,
                 batch_size=5, context_len=37, ragged=ragged, seed=3, q_dtype="bfloat16", kv_dtype="bfloat16")
    p = make_problem(w, page_size, seed=7)
    out = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table,
                               p.seq_lens_cpu, SCALE)
    # independent: gather through a python loop over token positions, no page arithmetic reuse
    ckv, kpe = [], []
    for b, n in enumerate(p.seq_lens_cpu.tolist()):
        rows = [p.ckv_cache[p.block_table[b, t // page_size], t % page_size] for t in range(n)]
        krows = [p.kpe_cache[p.block_table[b, t // page_size], t % page_size] for t in range(n)]
        ckv.append(torch.stack(rows))
        kpe.append(torch.stack(krows))
    outs = [mla_decode_unpaged(p.q_nope[b:b + 1], p.q_pe[b:b + 1], [ckv[b]], [kpe[b]], SCALE)[0]
            for b in range(w.batch_size)]
    ref = torch.stack(outs)
    assert relative_error(out, ref) < 1e-2    # out is bf16, ref float64


def test_page_table_is_shuffled_and_lengths_not_multiples():
    w = Workload(4, 32, 8, SCALE, batch_size=6, context_len=50, ragged="uniform-random", seed=1)
    p = make_problem(w, 16, seed=2)
    used = torch.cat([p.block_table[b, : -(-n // 16)] for b, n in enumerate(p.seq_lens_cpu.tolist())])
    assert len(set(used.tolist())) == len(used)          # no page shared
    assert used.tolist() != sorted(used.tolist())        # not in order
    assert any(n % 16 for n in p.seq_lens_cpu.tolist())  # some partial last pages


def test_wrong_page_table_is_detected():
    w = Workload(4, 32, 8, SCALE, batch_size=3, context_len=40)
    p = make_problem(w, 8, seed=4)
    good = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table, p.seq_lens_cpu, SCALE)
    # attention is order-invariant within a request, so swapping its pages changes nothing;
    # pointing one entry at a page the request does not own must change the result
    bt = p.block_table.clone()
    unused = set(range(p.ckv_cache.shape[0])) - set(bt.flatten().tolist())
    bt[0, 0] = min(unused)
    bad = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, bt, p.seq_lens_cpu, SCALE)
    assert relative_error(bad, good) > 1e-2


def test_causal_q_len():
    w = Workload(2, 16, 8, SCALE, batch_size=2, context_len=20, q_len=3)
    p = make_problem(w, 4, seed=5)
    out, lse = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table,
                                    p.seq_lens_cpu, SCALE, q_len=3, return_lse=True)
    ckv, kpe = _contiguous(p)
    for b in range(2):
        for i in range(3):
            n = 20 - 3 + i + 1     # query i sees positions [0, L-q+i]
            row = b * 3 + i
            ref = mla_decode_unpaged(p.q_nope[row:row + 1], p.q_pe[row:row + 1], [ckv[b][:n]], [kpe[b][:n]], SCALE)[0]
            assert relative_error(out[row], ref) < 1e-2
            s = (p.q_nope[row].double() @ ckv[b][:n].double().T + p.q_pe[row].double() @ kpe[b][:n].double().T) * SCALE
            assert torch.allclose(lse[row].double(), torch.logsumexp(s, -1), atol=1e-3)


def test_scale_matters():
    w = Workload(2, 16, 8, SCALE, batch_size=1, context_len=30)
    p = make_problem(w, 4, seed=6)
    a = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table, p.seq_lens_cpu, SCALE)
    b = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table, p.seq_lens_cpu, 576 ** -0.5)
    assert relative_error(a, b) > 1e-2


def test_relative_error_nan_is_inf():
    x = torch.ones(3)
    y = x.clone()
    y[1] = float("nan")
    assert math.isinf(relative_error(y, x))
