"""FlashMLA's dense decode (vllm/_flashmla_C, loaded by vllm_metax.ops.flashmla without importing
vllm) through the "flashmla" family on a Hopper GPU: correct against the torch reference at 16 and
128 heads (DeepSeek-V3 TP8/TP1), uniform and ragged lengths, q_len 2 (causal); a new step's
schedule lands in the tensors a captured graph replays; timed through the tool's measure path."""

from __future__ import annotations

import pytest
import torch

from mla_tune.families import Candidate, get_family
from mla_tune.measure import timing
from mla_tune.measure.trial import MeasureSettings, check_correctness, measure
from mla_tune.problem.instance import make_problem
from mla_tune.problem.reference import mla_decode_reference, relative_error
from mla_tune.problem.workload import model_preset, workload_for

pytestmark = [pytest.mark.gpu]

V3 = model_preset("deepseek-v3")
CAND = Candidate("flashmla", "flashmla", 64)


@pytest.fixture(scope="module")
def fm():
    b = get_family("flashmla")
    a = b.available("cuda")
    if not a.ok:
        pytest.skip(f"flashmla unavailable here: {a.reason}")
    return b


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("ragged", ["uniform", "lognormal"])
def test_flashmla_matches_the_reference(fm, tp, ragged):
    w = workload_for(V3, tp, 5, 1000, ragged=ragged, seed=11)
    err = check_correctness(fm, w, CAND, MeasureSettings(device="cuda"), seed=3)
    assert err < 2e-2, (w.label(), err)


def test_q_len_2_causal_matches_the_reference(fm):
    w = workload_for(V3, 8, 3, 700, q_len=2, ragged="uniform-random", seed=5)
    err = check_correctness(fm, w, CAND, MeasureSettings(device="cuda"), seed=4)
    assert err < 2e-2, err


def test_a_new_steps_schedule_is_what_the_captured_graph_replays(fm):
    w = workload_for(V3, 8, 4, 3000, ragged="uniform", seed=2)
    p = make_problem(w, 64, "cuda", seed=1)
    prepared = fm.prepare(w, CAND, p)
    ref = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table,
                               p.seq_lens_cpu, w.softmax_scale, w.q_len)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        prepared.run()
    kernel = prepared.kernel
    before = kernel.tile_scheduler_metadata.data_ptr()
    prepared.plan()                         # new step: same shapes, copied into the same tensors
    assert kernel.tile_scheduler_metadata.data_ptr() == before
    prepared.out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert relative_error(prepared.out, ref) < 2e-2


def test_measure_times_a_graph_captured_candidate(fm):
    w = workload_for(V3, 8, 4, 4096)
    r = measure(fm, w, CAND, MeasureSettings(device="cuda", warmup=2, samples=10))
    assert r.status == "ok", r.message
    ks = r.samples["kernel_us"]
    assert len(ks) == 10 and all(t > 0 for t in ks)
    assert r.max_rel_error < 2e-2
    assert r.samples.method not in (timing.METHOD_EVENTS, timing.METHOD_WALL), r.samples.note
