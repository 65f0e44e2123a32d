"""Roofline arithmetic: bytes and FLOPs of a workload, and % of floor."""

import pytest

from mla_tune.problem import roofline
from mla_tune.problem.workload import Workload, custom_model, model_preset, workload_for
from mla_tune.problem.reference import mla_decode_reference  # noqa: F401  (the semantics counted below)


def _v3(tp=1, b=128, L=32768, q_len=1, ragged="uniform"):
    return workload_for(model_preset("deepseek-v3"), tp, b, L, q_len=q_len, ragged=ragged)


def test_flops_match_design_formula_for_deepseek_v3():
    w = _v3()
    assert roofline.workload_flops(w) == 128 * 128 * 32768 * (2 * 576 + 2 * 512)


def test_bytes_are_kv_plus_q_plus_out():
    w = _v3(tp=8, b=4, L=1000)
    kv = 4 * 1000 * 576 * 2
    q = 4 * 16 * 576 * 2
    out = 4 * 16 * 512 * 2
    assert roofline.workload_bytes(w) == kv + q + out


def test_intensity_h128_compute_bound_h16_memory_bound():
    # 242 FLOP/B at 128 heads (compute-bound on the H200, docs/tuning.md), far less at 16
    assert roofline.arithmetic_intensity(_v3()) == pytest.approx(242, rel=0.01)
    assert roofline.arithmetic_intensity(_v3(tp=8)) == pytest.approx(30.2, rel=0.01)
    f = roofline.floor_of(_v3(), 4261, 789)
    assert f.bound == "compute"
    assert roofline.floor_of(_v3(tp=8), 4261, 789).bound == "memory"


def test_causal_q_len_counts_visible_positions_like_the_reference_mask():
    w = workload_for(custom_model(2, 32, 16), 1, 3, 10, q_len=4, ragged="uniform-random", seed=5)
    # brute force: query i of a request with L positions sees positions 0..L-q_len+i
    visible = sum(L - w.q_len + i + 1 for L in w.seq_lens for i in range(w.q_len))
    assert roofline.workload_flops(w) == 2 * visible * (2 * (32 + 16) + 2 * 32)


def test_ragged_uses_actual_lengths():
    w = _v3(tp=8, b=16, L=2048, ragged="lognormal")
    assert roofline.workload_bytes(w) == (sum(w.seq_lens) * 576 * 2 + 16 * 16 * (576 + 512) * 2)


def test_pct_of_floor():
    w = _v3(tp=8, b=64, L=4096)
    floor = roofline.floor_of(w, 4000.0, 800.0)
    assert floor.memory_us == pytest.approx(roofline.workload_bytes(w) / 4e6)   # bytes / (GB/s * 1e3) = us
    assert roofline.pct_of_floor(floor.us, w, 4000.0, 800.0) == pytest.approx(100.0)
    assert roofline.pct_of_floor(2 * floor.us, w, 4000.0, 800.0) == pytest.approx(50.0)
    assert roofline.pct_of_floor(10.0, w, None, 800.0) is None
    gbps, tflops = roofline.achieved(floor.us, w)
    assert gbps == pytest.approx(4000.0)


def test_float16_and_fp8_item_sizes():
    w = Workload(16, 512, 64, 0.1, 2, 100, q_dtype="float16", kv_dtype="float16")
    assert roofline.workload_bytes(w) == 2 * 100 * 576 * 2 + 2 * 16 * 1088 * 2
