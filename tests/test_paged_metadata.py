"""build_paged_metadata against the reference's page-table semantics."""

import pytest
import torch

from mla_tune.problem.workload import Workload
from mla_tune.problem.instance import make_problem
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


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_strided_layout_is_the_block_table_itself_and_compacts_to_the_same_pages(page_size):
    w = Workload(4, 32, 8, 0.1, batch_size=7, context_len=100, q_len=2, ragged="uniform-random", seed=3)
    p = make_problem(w, page_size, seed=2)
    table = p.block_table
    m = build_paged_metadata(table, p.seq_lens_cpu, page_size, 2, compact=False)
    width = table.shape[1]
    assert not m.compact and m.kv_indices.data_ptr() == table.data_ptr()      # a view, no copy
    assert m.kv_indptr.tolist() == [b * width for b in range(8)]
    assert m.qo_indptr.tolist() == list(range(0, 16, 2)) and m.kv_len.tolist() == p.seq_lens_cpu.tolist()
    compact = build_paged_metadata(table, p.seq_lens_cpu, page_size, 2)
    assert m.num_pages_used == compact.num_pages_used
    for b, n in enumerate(p.seq_lens_cpu.tolist()):           # the same pages, request by request
        pages = -(-n // page_size)
        s = int(m.kv_indptr[b])
        assert m.kv_indices[s:s + pages].tolist() == table[b, :pages].tolist()
    again = m.compacted()
    assert again.compact and again.kv_indptr.tolist() == compact.kv_indptr.tolist()
    assert again.kv_indices.tolist() == compact.kv_indices.tolist() and again.q_len == 2


def test_strided_falls_back_to_compact_where_the_table_cannot_be_handed_over():
    lens = torch.tensor([20, 3])
    wide = torch.arange(12, dtype=torch.int32).reshape(2, 6)
    assert not build_paged_metadata(wide, lens, 8, compact=False).compact
    assert build_paged_metadata(wide[:, :3], lens, 8, compact=False).compact      # rows not contiguous
    assert build_paged_metadata(wide.long(), lens, 8, compact=False).compact      # not int32
    buf = torch.zeros(16, dtype=torch.int32)                                      # graph buffer: gather
    m = build_paged_metadata(wide, lens, 8, out_kv_indices=buf, compact=False)
    assert m.compact and m.kv_indices.data_ptr() == buf.data_ptr()
    assert m.kv_indices.tolist() == [0, 1, 2, 6]


def test_numpy_lengths_are_accepted_and_validated_like_tensors():
    import numpy as np
    bt = torch.tensor([[5, 6, 0], [9, 0, 0]], dtype=torch.int32)
    m = build_paged_metadata(bt, np.array([20, 3], dtype=np.int64), 8)
    assert m.kv_len.dtype == torch.int32 and m.kv_indices.tolist() == [5, 6, 0, 9]
    with pytest.raises(ValueError, match="pages"):
        build_paged_metadata(bt, np.array([25, 3]), 8, compact=False)
