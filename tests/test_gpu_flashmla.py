"""FlashMLA's dense decode (vllm/_flashmla_C, loaded by vllm_metax.ops.flashmla without importing
vllm) through the "flashmla" family on a Hopper GPU: correct against the torch reference at 16 and
128 heads (DeepSeek-V3 TP8/TP1), uniform and ragged lengths, q_len 2 (causal); a new step's
schedule lands in the tensors a captured graph replays; timed through the tool's measure path;
served per bucket by FLASHINFER_MLA's builder and impl (eagerly and under a full CUDA graph)."""

from __future__ import annotations

import types

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


# ---------------------------------------------------------------- served by FLASHINFER_MLA's builder

import os  # noqa: E402

import plugin_support as ps  # noqa: E402
from vllm_metax.core import choices, tuned_config as tc  # noqa: E402

TOL = 2e-2


def _entry():
    """Every bucket FlashMLA's, 1.5x faster than FlashInfer's choice (`decisions.flashmla_serves`)."""
    return ps.side_kernel_entry("flashmla", {"backend": "flashmla"})


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    os.environ.setdefault("VLLM_METAX_FORCE", "1")
    tc.clear_cache()
    return ps.make_vllm_config(tmp_path_factory.mktemp("model"))


def _builder(base, monkeypatch, cudagraph):
    """FLASHINFER_MLA's builder and impl on this GPU, serving `_entry()` (its FlashMLA ops are
    made with the builder, so the entry is what the builder finds, not swapped in after)."""
    import vllm_metax.backend.flashinfer_mla as fb
    vc = ps.page64_config(base, cudagraph)
    monkeypatch.setattr(fb, "served_entry", lambda *a, **kw: _entry())
    builder = ps.make_builder(vc, device="cuda")
    assert builder.choice.serves_flashmla(), "FlashMLA was turned off: see the warning above"
    return builder, ps.make_impl(vc)


def _reference(q, kv, bt, lens, q_len=1):
    return mla_decode_reference(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], bt, lens,
                                ps.softmax_scale(), q_len)


@pytest.mark.vllm
def test_flashinfer_mla_serves_a_tuned_flashmla_bucket_eagerly(fm, model_root, monkeypatch):
    from vllm_metax.ops.flashmla import FlashMLAStep
    builder, impl = _builder(model_root, monkeypatch, cudagraph=False)
    for seed, seq_lens in ((1, [1, 300, 4096]), (2, [5000, 64]), (3, [700] * 16)):
        bt, lens, common, num_pages = ps.ragged_batch(seq_lens, 64, device="cuda", seed=seed)
        md = builder.build(0, common)
        assert md.decode.backend == choices.FLASHMLA and isinstance(md.decode.kernel, FlashMLAStep)
        q, kv = ps.decode_inputs(len(seq_lens), num_pages, seed)
        out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), kv, md, None)
        later, _ = impl.forward_mqa(q, kv, md, None)          # the next layer: the step's schedule
        ref = _reference(q, kv, bt, lens)
        assert lse is None and relative_error(out, ref) < TOL, seed
        assert relative_error(later, ref) < TOL, seed
    # q_len 2 (speculative decode): causal, FlashMLA's own output copied
    # (built as vLLM's MLA build() builds a decode batch: with no speculative config, build() itself
    # would count 2-token requests as prefills)
    md, bt, lens, num_pages = ps.build_decode(builder, [700, 33, 2000], 64, q_len=2, seed=4, device="cuda")
    assert md.backend == choices.FLASHMLA and md.q_len == 2
    q, kv = ps.decode_inputs(6, num_pages, 4)
    out, _ = impl.forward_mqa(q, kv, types.SimpleNamespace(decode=md), None)
    assert relative_error(out, _reference(q, kv, bt, lens, q_len=2)) < TOL
    assert builder.choice.flashmla_enabled


@pytest.mark.vllm
def test_flashmla_bucket_under_full_cudagraph_capture_and_replay(fm, model_root, monkeypatch):
    builder, impl = _builder(model_root, monkeypatch, cudagraph=True)
    step = ps.GraphStep(builder)
    static_q, static_kv = step.q, step.kv

    def forward(md):
        """Two layers, as a step runs them: the first schedules, the second reuses it."""
        step.forward(impl, md)
        return step.forward(impl, md)

    lens1 = [100, 7, 3000, 64, 1, 512, 2047, 900]
    md, bt, lens = step(lens1, seed=1)
    assert md.decode.cuda_graph and md.decode.backend == choices.FLASHMLA
    eager = forward(md)
    torch.cuda.synchronize()
    ref = _reference(static_q, static_kv, bt, lens)
    assert relative_error(eager, ref) < TOL
    # vLLM builds a step's metadata right before capturing it: the capture schedules in the graph
    md, bt, lens = step(lens1, seed=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward(md)
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(captured, ref) < TOL
    for seed, seq_lens in ((2, [4096, 4096, 1, 1, 70, 800, 33, 1000]), (3, [5] * 8),
                           (4, [2000, 10, 10, 10, 10, 10, 10, 5000])):
        md2, bt2, lens2 = step(seq_lens, seed)
        assert md2.decode.backend == choices.FLASHMLA and md2.decode.kernel.kernel is md.decode.kernel.kernel
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(captured, _reference(static_q, static_kv, bt2, lens2)) < TOL, seed
