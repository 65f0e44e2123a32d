"""vLLM's FA3 MLA decode (vllm/vllm_flash_attn/_vllm_fa3_C, loaded by vllm_metax.ops.fa3_mla without
importing vllm) through the "fa3_mla" family on a Hopper GPU: correct against the torch reference
at 16 and 128 heads, uniform and ragged lengths, q_len 2 (causal), every split bound and both
schedules; a new step's metadata lands in the buffer a captured graph replays; the same result as
vLLM's own wrapper call; timed through the tool's measure path."""

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


@pytest.fixture(scope="module")
def fam():
    f = get_family("fa3_mla")
    a = f.available("cuda")
    if not a.ok:
        pytest.skip(f"fa3_mla unavailable here: {a.reason}")
    return f


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("ragged", ["uniform", "lognormal"])
@pytest.mark.parametrize("knobs", ["num_splits=0", "num_splits=32", "num_splits=4",
                                   "num_splits=0,schedule=none"])
def test_fa3_matches_the_reference(fam, tp, ragged, knobs):
    w = workload_for(V3, tp, 5, 3000, ragged=ragged, seed=11)
    err = check_correctness(fam, w, Candidate.parse(f"fa3_mla/fa3/p64/{knobs}"),
                            MeasureSettings(device="cuda"), seed=3)
    assert err < 2e-2, (w.label(), knobs, err)


@pytest.mark.parametrize("page", [16, 64])
def test_q_len_2_causal_and_page_16_match_the_reference(fam, page):
    w = workload_for(V3, 8, 3, 700, q_len=2, ragged="uniform-random", seed=5)
    err = check_correctness(fam, w, Candidate.parse(f"fa3_mla/fa3/p{page}/num_splits=0"),
                            MeasureSettings(device="cuda"), seed=4)
    assert err < 2e-2, err


def test_same_output_as_vllms_own_wrapper(fam):
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    w = workload_for(V3, 8, 4, 5000, ragged="lognormal", seed=2)
    p = make_problem(w, 64, "cuda", seed=1)
    prepared = fam.prepare(w, Candidate.parse("fa3_mla/fa3/p64/num_splits=0,schedule=none"), p)
    prepared.run()
    seq = p.seq_lens_cpu.cuda()
    cu = torch.arange(0, w.batch_size + 1, dtype=torch.int32, device="cuda")
    theirs = flash_attn_varlen_func(
        q=p.q_pe, k=p.kpe_cache.unsqueeze(-2), v=p.ckv_cache.unsqueeze(-2), q_v=p.q_nope,
        max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=int(p.seq_lens_cpu.max()), seqused_k=seq,
        block_table=p.block_table, softmax_scale=w.softmax_scale, causal=True, fa_version=3)
    torch.cuda.synchronize()
    assert torch.equal(prepared.out, theirs)


def test_a_new_steps_metadata_lands_in_the_buffer_the_captured_graph_replays(fam):
    w = workload_for(V3, 8, 4, 3000, ragged="uniform", seed=2)
    p = make_problem(w, 64, "cuda", seed=1)
    prepared = fam.prepare(w, Candidate.parse("fa3_mla/fa3/p64/num_splits=32"), p)
    ref = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table,
                               p.seq_lens_cpu, w.softmax_scale, w.q_len)
    kernel = prepared.kernel
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        prepared.run()
    before = kernel.metadata.data_ptr()
    kernel._buffer.fill_(-1)                # a stale schedule the next plan must overwrite
    prepared.plan()                         # the next step: metadata copied into the same buffer
    assert kernel.metadata.data_ptr() == before
    prepared.out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert relative_error(prepared.out, ref) < 2e-2


def test_measure_times_a_graph_captured_candidate(fam):
    w = workload_for(V3, 8, 4, 4096)
    r = measure(fam, w, Candidate.parse("fa3_mla/fa3/p64/num_splits=32"),
                MeasureSettings(device="cuda", warmup=2, samples=10))
    assert r.status == "ok", r.message
    ks = r.samples["kernel_us"]
    assert len(ks) == 10 and all(t > 0 for t in ks)
    assert r.max_rel_error < 2e-2
    assert r.samples.method not in (timing.METHOD_EVENTS, timing.METHOD_WALL), r.samples.note


# ---------------------------------------------------------------- served by FLASHINFER_MLA's builder

import os  # noqa: E402

import plugin_support as ps  # noqa: E402
from vllm_metax.core import choices, decisions, tuned_config as tc  # noqa: E402

TOL = 2e-2


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    os.environ.setdefault("VLLM_METAX_FORCE", "1")
    tc.clear_cache()
    return ps.make_vllm_config(tmp_path_factory.mktemp("model"))


def _builder(base, params, cudagraph):
    from vllm_metax.backend.plan_choice import PlanChoice
    vc = ps.page64_config(base, cudagraph)
    builder = ps.make_builder(vc, device="cuda")
    builder.choice = PlanChoice(ps.side_kernel_entry("fa3_mla", params),
                                decisions.FlashInferBackends(("fa3", "fa2"), "fa3"))
    return builder, ps.make_impl(vc)


def _reference(q, kv, bt, lens):
    return mla_decode_reference(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], bt, lens,
                                ps.softmax_scale())


@pytest.mark.vllm
@pytest.mark.parametrize("params", [{"backend": "fa3", "num_splits": 0},
                                    {"backend": "fa3", "num_splits": 8, "schedule": "none"}])
def test_flashinfer_mla_serves_a_tuned_fa3_bucket_eagerly(fam, model_root, params):
    builder, impl = _builder(model_root, params, cudagraph=False)
    for seed, seq_lens in ((1, [1, 300, 4096]), (2, [5000, 64]), (3, [700] * 16)):
        bt, lens, common, num_pages = ps.ragged_batch(seq_lens, 64, device="cuda", seed=seed)
        md = builder.build(0, common)
        assert md.decode.backend == choices.FA3 and md.decode.paged is None
        q, kv = ps.decode_inputs(len(seq_lens), num_pages, seed)
        out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), kv, md, None)
        assert lse is None and relative_error(out, _reference(q, kv, bt, lens)) < TOL, seed
    assert builder.choice.fa3_enabled and len(builder._fa3_kernels) == 1


@pytest.mark.vllm
def test_fa3_under_full_cudagraph_capture_and_replay(fam, model_root):
    builder, impl = _builder(model_root, {"backend": "fa3", "num_splits": 0}, cudagraph=True)
    step = ps.GraphStep(builder)
    static_q, static_kv = step.q, step.kv

    def forward(md):
        return step.forward(impl, md)

    md, bt, lens = step([100, 7, 3000, 64, 1, 512, 2047, 900], seed=1)
    assert md.decode.cuda_graph and md.decode.backend == choices.FA3
    assert md.decode.kernel.kernel.num_splits == 32        # vLLM's bound in graphs for FA3's heuristic
    eager = forward(md)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward(md)
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference(static_q, static_kv, bt, lens)
    assert relative_error(eager, ref) < TOL and relative_error(captured, ref) < TOL
    for seed, seq_lens in ((2, [4096, 4096, 1, 1, 70, 800, 33, 1000]), (3, [5] * 8),
                           (4, [2000, 10, 10, 10, 10, 10, 10, 5000])):
        md2, bt2, lens2 = step(seq_lens, seed)
        assert md2.decode.backend == choices.FA3 and md2.decode.kernel.kernel is md.decode.kernel.kernel
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(captured, _reference(static_q, static_kv, bt2, lens2)) < TOL, seed
