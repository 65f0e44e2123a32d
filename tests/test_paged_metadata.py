"""build_paged_metadata against the reference's page-table semantics."""

import pytest
import torch

from mla_tune.problem import Workload
from mla_tune.problem_data import make_problem
from vllm_metax.ops.paged_metadata import build_paged_metadata


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("q_len", [1, 3])
def test_csr_covers_exactly_the_pages_the_reference_reads(page_size, q_len):
    w = Workload(4, 32, 8, 0.1, batch_size=7, context_len=100, q_len=q_len, ragged="uniform-random", seed=9)
    p = make_problem(w, page_size, seed=1)
    m = build_paged_metadata(p.block_table, p.seq_lens_cpu, page_size, q_len)
    lens = p.seq_lens_cpu.tolist()
    assert m.qo_indptr.tolist() == list(range(0, (7 + 1) * q_len, q_len))
    assert m.kv_len.tolist() == lens
    for b, n in enumerate(lens):
        pages = -(-n // page_size)
        lo, hi = m.kv_indptr[b].item(), m.kv_indptr[b + 1].item()
        assert hi - lo == pages
        assert m.kv_indices[lo:hi].tolist() == p.block_table[b, :pages].tolist()
    assert m.num_pages_used == m.kv_indptr[-1].item() == len(m.kv_indices)
    assert m.kv_indices.dtype == torch.int32 and m.kv_indptr.dtype == torch.int32


def test_out_buffer_for_graphs():
    bt = torch.tensor([[5, 6, 0], [9, 0, 0]], dtype=torch.int32)
    buf = torch.full((16,), -1, dtype=torch.int32)
    m = build_paged_metadata(bt, torch.tensor([20, 3]), 8, out_kv_indices=buf)
    assert buf[:4].tolist() == [5, 6, 0, 9] and buf[4].item() == -1
    assert m.kv_indices.data_ptr() == buf.data_ptr()


def test_rejects_device_seq_lens_and_short_tables():
    bt = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="pages"):
        build_paged_metadata(bt, torch.tensor([17, 1]), 16)
    with pytest.raises(ValueError, match="does not cover"):
        build_paged_metadata(bt[:1], torch.tensor([1, 1]), 16)


def test_too_small_out_buffer_is_an_error_not_a_silent_resize():
    bt = torch.tensor([[5, 6, 7]], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs 3"):
        build_paged_metadata(bt, torch.tensor([20]), 8, out_kv_indices=torch.zeros(2, dtype=torch.int32))
