"""FlashInfer MLA on a real GPU against the torch reference (run on the H200: pytest -m gpu).

Every backend value the installed FlashInfer accepts x page sizes 1/16/64/128 x 16 and 128 heads
x ragged lengths, through the same op the vLLM plugin calls; both API forms; CUDA-graph replans.
"""

import math

import pytest
import torch
from vllm_metax.ops import fast_replan as fr

pytestmark = pytest.mark.gpu

PAGES = (1, 16, 64, 128)
HEADS = (16, 128)


def _fi():
    from vllm_metax.ops import flashinfer_mla as op
    ok, why = op.flashinfer_available()
    if not ok:
        pytest.skip(why)
    return op


def _backends():
    # importing flashinfer is slow and fails on GPU-less hosts: only ask where the tests can run
    if not torch.cuda.is_available():
        return ("fa2", "fa3")
    from vllm_metax.ops import flashinfer_mla as op
    return op.concrete_backends() if op.flashinfer_available()[0] else ("fa2", "fa3")


def _keyword_api(op) -> bool:
    """FlashInfer 0.7's keyword API; the flat 0.2.x one (MetaX's build) plans through the public
    plan() every step, since the fast re-plan reads 0.7's internals."""
    return op.flashinfer_api().form == op.API_KEYWORD


def _needs_fast_path(op):
    if not _keyword_api(op):
        pytest.skip(f"flashinfer {op.flashinfer_api().version}: the fast re-plan and the numpy "
                    "schedule need 0.7's keyword API internals")


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] == 9


def _workload(heads, batch=5, context=300, q_len=1, ragged="lognormal", seed=7):
    from mla_tune.problem.workload import custom_model, workload_for
    return workload_for(custom_model(heads), 1, batch, context, q_len=q_len, ragged=ragged, seed=seed)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("backend", _backends())
def test_every_backend_page_heads_ragged_matches_reference(backend, page, heads):
    op = _fi()
    if not _keyword_api(op) and backend not in ("fa2", "fa3", "auto"):
        # seen on the H200 with 0.2.6.post1: its Blackwell cutlass MLA raises AttributeError in plan()
        pytest.skip(f"flashinfer {op.flashinfer_api().version}: {backend} is not an SM90/MetaX backend")
    from mla_tune.families import Candidate, CandidateInvalid
    from mla_tune.families.flashinfer import FlashInferFamily
    from mla_tune.measure.trial import MeasureSettings, check_correctness
    w = _workload(heads)
    try:
        err = check_correctness(FlashInferFamily(), w, Candidate("flashinfer", backend, page),
                                MeasureSettings(device="cuda"), seed=11)
    except CandidateInvalid as e:
        if e.reason == "unsupported" and not (_sm90() and backend in ("fa2", "fa3")):
            assert e.message      # FlashInfer's reason is kept
            pytest.skip(f"{backend} refused here: {e.message[:200]}")
        raise
    assert err < 2e-2


@pytest.mark.parametrize("api", ["flat", "keyword"])
@pytest.mark.parametrize("backend", ["fa2", "fa3", "auto"])
def test_both_api_forms(api, backend):
    op = _fi()
    if api == "keyword" and not _keyword_api(op):
        pytest.skip(f"flashinfer {op.flashinfer_api().version} has the flat API only")
    if backend == "fa3" and not _sm90():
        pytest.skip("fa3 needs SM90")
    from mla_tune.families import Candidate
    from mla_tune.families.flashinfer import FlashInferFamily
    from mla_tune.measure.trial import MeasureSettings, check_correctness
    for heads, page in ((16, 64), (128, 16)):
        err = check_correctness(FlashInferFamily(api=api), _workload(heads, ragged="uniform-random"),
                                Candidate("flashinfer", backend, page), MeasureSettings(device="cuda"), seed=3)
        assert err < 2e-2


@pytest.mark.parametrize("q_len", [2, 4])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_speculative_q_len_causal(backend, q_len):
    _fi()
    if backend == "fa3" and not _sm90():
        pytest.skip("fa3 needs SM90")
    from mla_tune.families import Candidate, CandidateInvalid
    from mla_tune.families.flashinfer import FlashInferFamily
    from mla_tune.measure.trial import MeasureSettings, check_correctness
    try:
        err = check_correctness(FlashInferFamily(), _workload(16, batch=4, q_len=q_len),
                                Candidate("flashinfer", backend, 16), MeasureSettings(device="cuda"), seed=5)
    except CandidateInvalid as e:      # FlashInfer refuses some causal tile boundaries by design
        assert e.reason == "unsupported", e.message
        pytest.skip(e.message[:200])
    assert err < 2e-2


def _packed_problem(heads, page, lens, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = sum(math.ceil(n / page) for n in lens)
    num_blocks = pages + 17
    kv = torch.randn(num_blocks, page, 576, device="cuda", generator=g).to(torch.bfloat16)  # vLLM layout
    perm = torch.randperm(num_blocks, device="cuda", generator=g)[:pages].to(torch.int32)
    width = max(math.ceil(n / page) for n in lens) + 3
    bt = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    o = 0
    for b, n in enumerate(lens):
        k = math.ceil(n / page)
        bt[b, :k] = perm[o:o + k]
        o += k
    q = torch.randn(len(lens), heads, 576, device="cuda", generator=g).to(torch.bfloat16)
    return kv, bt, q


def test_plugin_path_packed_cache_lse_and_cuda_graph_replan():
    """What the plugin does: packed vLLM cache views, plan every step into graph buffers, replay."""
    op = _fi()
    from mla_tune.problem.reference import mla_decode_reference, relative_error
    from vllm_metax.ops.paged_metadata import build_paged_metadata
    backend = "fa3" if _sm90() else "fa2"
    heads, page, scale = 16, 64, 192 ** -0.5
    kv, bt, q = _packed_problem(heads, page, [700, 64, 1, 3000])
    ckv, kpe = kv[..., :512], kv[..., 512:]
    gb = op.GraphBuffers.allocate(4, bt.shape[1] * 4, "cuda")
    kern = op.MLADecodeKernel(op.make_workspace("cuda"), backend, use_cuda_graph=True, graph_buffers=gb)
    out = torch.empty(4, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(4, heads, dtype=torch.float32, device="cuda")
    qn, qp = q[..., :512].contiguous(), q[..., 512:].contiguous()   # independent split tensors

    def plan(lens):
        seq = torch.tensor(lens, dtype=torch.int32)
        meta = build_paged_metadata(bt, seq, page, out_kv_indices=gb.kv_indices)
        kern.plan(meta, heads, 512, 64, page, False, scale, torch.bfloat16, torch.bfloat16, return_lse=True)
        return seq

    seq = plan([700, 64, 1, 3000])
    kern.run(qn, qp, ckv, kpe, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern.run(qn, qp, ckv, kpe, out=out, lse=lse, return_lse=True)
    for lens in ([700, 64, 1, 3000], [701, 65, 2, 2999], [1, 1, 1, 1]):
        seq = plan(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = mla_decode_reference(qn, qp, ckv, kpe, bt, seq, scale, return_lse=True)
        assert relative_error(out, ref) < 2e-2, lens
        assert torch.allclose(lse * math.log(2.0), ref_lse, atol=2e-2, rtol=1e-3), lens


def test_tuner_and_plugin_share_the_op():
    _fi()
    from mla_tune.families import Candidate
    from mla_tune.families.flashinfer import FlashInferFamily
    from mla_tune.problem.instance import make_problem
    from vllm_metax.ops.flashinfer_mla import MLADecodeKernel
    w = _workload(16)
    p = FlashInferFamily().prepare(w, Candidate("flashinfer", "auto", 64), make_problem(w, 64, "cuda"))
    assert type(p.kernel) is MLADecodeKernel
    if _sm90():
        assert p.kernel.resolved_backend == "fa3"


def test_refused_backends_report_flashinfers_reason():
    op = _fi()
    support = op.backend_support("cuda")
    assert support["fa2"] is None
    if _sm90():
        assert support["fa3"] is None
    for b, why in support.items():
        assert why is None or (isinstance(why, str) and why), b


def test_time_prepared_uses_graphs_and_is_positive():
    _fi()
    from mla_tune.families import Candidate
    from mla_tune.families.flashinfer import FlashInferFamily
    from mla_tune.measure.trial import MeasureSettings, measure
    from mla_tune.measure.timing import METHOD_GRAPH, METHOD_GRAPH_EVENTS, default_pool_bytes
    w = _workload(16, batch=8, context=2048, ragged="uniform")
    s = MeasureSettings(device="cuda", samples=20, plan_samples=10, min_pool_bytes=default_pool_bytes())
    r = measure(FlashInferFamily(), w, Candidate("flashinfer", "fa2", 64), s)
    assert r.status == "ok", r.message
    assert r.samples.method in (METHOD_GRAPH_EVENTS, METHOD_GRAPH), r.samples.note
    assert len(r.samples["kernel_us"]) == 20 and min(r.samples["kernel_us"]) > 0
    assert len(r.samples["plan_us"]) == 10


@pytest.mark.parametrize("graph_events", [True, False])
def test_a_candidate_is_captured_once_and_keeps_the_allocator_cache(monkeypatch, graph_events):
    """One CUDA graph capture per candidate (the timed graph, or the one-run graph when in-graph
    events are off), and none of torch.cuda.graph's empty_cache(): the memory the caching
    allocator holds is not handed back to the driver by a capture."""
    _fi()
    from mla_tune.families import Candidate
    from mla_tune.families.flashinfer import FlashInferFamily
    from mla_tune.measure import timing
    from mla_tune.problem.instance import make_problem
    w = _workload(16, batch=8, context=2048, ragged="uniform")
    problem = make_problem(w, 64, "cuda", seed=1)
    prepared = FlashInferFamily().prepare(w, Candidate("flashinfer", "fa2", 64), problem)
    spare = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del spare                               # a cached, unused block empty_cache would release
    reserved = torch.cuda.memory_reserved()
    begun = []
    original = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin",
                        lambda self, *a, **k: begun.append(1) or original(self, *a, **k))
    timer = timing.KernelTimer(prepared, "cuda", warmup=2, plan_samples=2, graph_events=graph_events)
    assert len(begun) == 1
    assert timer.method == (timing.METHOD_GRAPH_EVENTS if graph_events else timing.METHOD_GRAPH), timer.note
    assert torch.cuda.memory_reserved() >= reserved
    xs = timer.sample(12)
    assert len(xs) == 12 and min(xs) > 0
    timer.close()


@pytest.mark.parametrize("compact", [True, False])
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_fast_replan_equals_reference_over_changing_lengths(backend, graph, compact):
    """The fast re-plan path (what the plugin runs every step) against the reference, eager and
    graphed, from compact metadata and from strided metadata (the block table itself as the page
    list, whose columns past a row's pages point at a NaN page that must never be read)."""
    op = _fi()
    if backend == "fa3" and not _sm90():
        pytest.skip("fa3 needs SM90")
    from mla_tune.problem.reference import mla_decode_reference, relative_error
    from vllm_metax.ops.paged_metadata import build_paged_metadata
    heads, page, scale = 128, 16, 0.1
    steps = ([300, 17, 4000, 1, 64, 65], [301, 18, 4001, 2, 65, 66], [5, 5, 5, 5, 5, 5],
             [1000, 2000, 3000, 4000, 100, 1])
    kv, bt, q = _packed_problem(heads, page, [4001] * 6, seed=4)
    kv = torch.cat([kv, torch.full_like(kv[:1], float("nan"))])
    bt[:, -(bt.shape[1] - math.ceil(4001 / page)):] = kv.shape[0] - 1
    ckv, kpe = kv[..., :512], kv[..., 512:]
    gb = op.GraphBuffers.allocate(6, bt.shape[1] * 6, "cuda") if graph else None
    kern = op.MLADecodeKernel(op.make_workspace("cuda"), backend, use_cuda_graph=graph, graph_buffers=gb)
    out = torch.empty(6, heads, 512, dtype=torch.bfloat16, device="cuda")
    g = None
    for i, lens in enumerate(steps):
        seq = torch.tensor(lens, dtype=torch.int32)
        meta = build_paged_metadata(bt, seq, page, compact=compact,
                                    out_kv_indices=gb.kv_indices if graph and compact else None)
        assert meta.compact == compact
        kern.plan(meta, heads, 512, 64, page, False, scale, torch.bfloat16, torch.bfloat16)
        out.fill_(float("nan"))
        if graph and g is None:
            kern.run(q[..., :512], q[..., 512:], ckv, kpe, out=out)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                kern.run(q[..., :512], q[..., 512:], ckv, kpe, out=out)
            out.fill_(float("nan"))
        if graph:
            g.replay()
        else:
            kern.run(q[..., :512], q[..., 512:], ckv, kpe, out=out)
        torch.cuda.synchronize()
        ref = mla_decode_reference(q[..., :512], q[..., 512:], ckv, kpe, bt, seq, scale)
        assert relative_error(out, ref) < 2e-2, (i, lens)
    # every plan after the first took the fast path (0.7); the flat 0.2.x API plans publicly
    assert kern.fast_replans == (len(steps) - 1 if _keyword_api(op) else 0)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_fast_replans_queued_behind_a_busy_gpu_keep_their_own_schedules(backend):
    """Twelve steps planned and run back to back while the GPU is still busy with a long kernel:
    every plan's schedule travels to the device from a ring of pinned buffers, so a later plan
    must never overwrite a schedule whose upload is still queued (each step checked against the
    reference after one final sync)."""
    op = _fi()
    _needs_fast_path(op)
    if backend == "fa3" and not _sm90():
        pytest.skip("fa3 needs SM90")
    from mla_tune.problem.reference import mla_decode_reference, relative_error
    from vllm_metax.ops.paged_metadata import build_paged_metadata
    heads, page, scale = 16, 64, 0.1
    kv, bt, q = _packed_problem(heads, page, [3000] * 5, seed=11)
    ckv, kpe = kv[..., :512], kv[..., 512:]
    kern = op.MLADecodeKernel(op.make_workspace("cuda"), backend)
    kern.plan(build_paged_metadata(bt, torch.tensor([3000] * 5, dtype=torch.int32), page, compact=False),
              heads, 512, 64, page, False, scale, torch.bfloat16, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    steps = [torch.randint(1, 3001, (5,), generator=g, dtype=torch.int32) for _ in range(12)]
    outs = []
    torch.cuda._sleep(200_000_000)                 # keep the stream busy for ~0.1 s
    for seq in steps:
        kern.plan(build_paged_metadata(bt, seq, page, compact=False), heads, 512, 64, page, False,
                  scale, torch.bfloat16, torch.bfloat16)
        outs.append(kern.run(q[..., :512], q[..., 512:], ckv, kpe))
    torch.cuda.synchronize()
    assert kern.fast_replans == len(steps)
    assert any(r.waits for r in fr._STAGING.values()), "the ring never had to wait: GPU was not busy"
    for i, (seq, out) in enumerate(zip(steps, outs)):
        ref = mla_decode_reference(q[..., :512], q[..., 512:], ckv, kpe, bt, seq, scale)
        assert relative_error(out, ref) < 2e-2, (i, seq.tolist())


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 1), (16, 3), (64, 3)])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_numpy_schedule_runs_the_kernel_as_flashinfers_mlaplan_would(backend, heads, q_len, graph,
                                                                     monkeypatch):
    """From batch 16 on the fast re-plan computes FlashInfer's MLA schedule with numpy. Ragged
    batches of 16-160 requests (split and unsplit KV, one and several query tiles per request,
    causal speculative steps): the schedule must give the kernel the same work items and merges as
    FlashInfer's own MLAPlan for the same batch, and the output must match the reference, eager
    and replayed from a graph captured on a native plan. (64 heads x 3 tokens is two query tiles
    per request; causal 128-head steps never take the fast re-plan.)"""
    op = _fi()
    _needs_fast_path(op)
    monkeypatch.setattr(fr, "_LAYOUTS", {})        # step 0 plans publicly, step 1 natively (learns)
    if backend == "fa3" and not _sm90():
        pytest.skip("fa3 needs SM90")
    from mla_tune.problem.reference import mla_decode_reference, relative_error
    from vllm_metax.ops import mla_schedule as ms
    from vllm_metax.ops.paged_metadata import build_paged_metadata
    page, scale, batch = 64, 0.1, 160
    causal = q_len > 1
    g = torch.Generator().manual_seed(heads * 10 + q_len)
    steps = [torch.randint(q_len, 9000, (batch,), generator=g, dtype=torch.int32),
             torch.randint(q_len, 300, (batch,), generator=g, dtype=torch.int32),
             torch.cat([torch.full((1,), 30000), torch.randint(q_len, 40, (batch - 1,), generator=g)]).int(),
             torch.randint(q_len, 9000, (batch,), generator=g, dtype=torch.int32)]
    kv, bt, q = _packed_problem(heads, page, [30000] * batch, seed=3)
    q = torch.randn(batch * q_len, heads, 576, device="cuda", dtype=torch.bfloat16)
    ckv, kpe = kv[..., :512], kv[..., 512:]
    gb = op.GraphBuffers.allocate(batch, bt.shape[1] * batch, "cuda") if graph else None
    kern = op.MLADecodeKernel(op.make_workspace("cuda"), backend, use_cuda_graph=graph, graph_buffers=gb)
    out = torch.empty(batch * q_len, heads, 512, dtype=torch.bfloat16, device="cuda")
    cap = None
    numpy_before = fr.SCHEDULES["numpy"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for i, seq in enumerate(steps):
        meta = build_paged_metadata(bt, seq, page, q_len, compact=False)
        kern.plan(meta, heads, 512, 64, page, causal, scale, torch.bfloat16, torch.bfloat16)
        be = kern.wrapper._planned_backend
        key = fr._layout_key(be, 512, q_len, heads)
        if i > 0:
            assert fr._LAYOUTS.get(key) is not None, "layout not learnt from the first native plan"
            # what FlashInfer's MLAPlan makes of the same batch, into a scratch pinned buffer
            scratch = torch.empty_like(be._pin_memory_int_workspace_buffer)
            info, _ = be._cached_module._module.plan(
                be._float_workspace_buffer, be._int_workspace_buffer, scratch, meta.qo_indptr,
                meta.kv_indptr, meta.kv_len, heads, 512, causal)
            native = ms.read_schedule(info, scratch.view(torch.uint8).numpy().view("int32"), sms)
            ours = ms.mla_schedule(meta.qo_indptr.numpy(), meta.kv_indptr.numpy(), meta.kv_len.numpy(),
                                   heads, causal, sms, q_len=q_len)
            assert ms.same_schedule(ours, native) is None, i
        out.fill_(float("nan"))
        if graph and cap is None:
            kern.run(q[..., :512], q[..., 512:], ckv, kpe, out=out)
            torch.cuda.synchronize()
            cap = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cap):
                kern.run(q[..., :512], q[..., 512:], ckv, kpe, out=out)
            out.fill_(float("nan"))
        if graph:
            cap.replay()
        else:
            kern.run(q[..., :512], q[..., 512:], ckv, kpe, out=out)
        torch.cuda.synchronize()
        ref = mla_decode_reference(q[..., :512], q[..., 512:], ckv, kpe, bt, seq, scale, q_len=q_len)
        assert not out.isnan().any(), i
        assert relative_error(out, ref) < 2e-2, i
    assert kern.fast_replans == len(steps) - 1
    assert fr.SCHEDULES["numpy"] - numpy_before == len(steps) - 2, "later steps were planned by MLAPlan, not the numpy schedule"


def test_tuner_times_the_kernel_on_the_schedule_the_plugin_serves():
    """The sweep must time what vLLM runs: from the second step on the plugin's kernel runs on the
    numpy schedule (B >= 16), so the tuner re-plans to that state before timing, plan samples or
    not."""
    op = _fi()
    _needs_fast_path(op)
    from mla_tune.families import Candidate
    from mla_tune.families.flashinfer import FlashInferFamily
    from mla_tune.measure.trial import MeasureSettings, measure
    before = fr.SCHEDULES["numpy"]
    r = measure(FlashInferFamily(), _workload(16, batch=64, context=2048),
                Candidate("flashinfer", "fa2", 64), MeasureSettings(device="cuda", samples=5, plan_samples=0))
    assert r.status == "ok", r.message
    assert fr.SCHEDULES["numpy"] > before, "the timed kernel ran on MLAPlan's schedule"


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
def test_tuned_kv_chunking_equals_reference(backend, heads, graph):
    """Every kv_chunk a tuned config may name, through the real kernel, eager and graphed, over
    ragged steps of a small and a large batch: from the second plan on the numpy schedule cuts
    the KV with that limit ("chunked"), and the output matches the reference; a chunking the
    batch cannot take is planned untuned, never wrong."""
    op = _fi()
    if backend == "fa3" and not _sm90():
        pytest.skip("fa3 needs SM90")
    if not _keyword_api(op):
        pytest.skip("kv_chunk needs the fast re-plan (FlashInfer 0.7's keyword API)")
    from mla_tune.problem.reference import mla_decode_reference, relative_error
    from vllm_metax.core.choices import kv_chunk_factor
    from vllm_metax.ops.paged_metadata import build_paged_metadata
    from vllm_metax.core.choices import KV_CHUNKS
    page, scale = 64, 192 ** -0.5
    for lens in ([9000, 3, 700], [1500 + 37 * i for i in range(40)]):
        kv, bt, q = _packed_problem(heads, page, [max(lens) + 1] * len(lens), seed=7)
        ckv, kpe = kv[..., :512], kv[..., 512:]
        n = len(lens)
        out = torch.empty(n, heads, 512, dtype=torch.bfloat16, device="cuda")
        for chunk in KV_CHUNKS:
            factor = kv_chunk_factor(chunk)
            gb = op.GraphBuffers.allocate(n, bt.shape[1] * n, "cuda") if graph else None
            kern = op.MLADecodeKernel(op.make_workspace("cuda"), backend, use_cuda_graph=graph,
                                      graph_buffers=gb)
            g = None
            made = []
            for step in range(3):
                seq = torch.tensor([x + step for x in lens], dtype=torch.int32)
                meta = build_paged_metadata(bt, seq, page, out_kv_indices=gb.kv_indices if graph else None)
                kern.plan(meta, heads, 512, 64, page, False, scale, torch.bfloat16, torch.bfloat16,
                          kv_chunk=factor)
                made.append(kern.last_schedule)
                out.fill_(float("nan"))
                if graph and g is None:
                    kern.run(q[..., :512], q[..., 512:], ckv, kpe, out=out)
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        kern.run(q[..., :512], q[..., 512:], ckv, kpe, out=out)
                    out.fill_(float("nan"))
                if graph:
                    g.replay()
                else:
                    kern.run(q[..., :512], q[..., 512:], ckv, kpe, out=out)
                torch.cuda.synchronize()
                ref = mla_decode_reference(q[..., :512], q[..., 512:], ckv, kpe, bt, seq, scale)
                assert relative_error(out, ref) < 2e-2, (chunk, lens[:3], step, made)
            assert made[0] == "public"
            assert made[1] in ("chunked", "numpy", "mlaplan") and made[2] == made[1], (chunk, made)
            # the quarter/half chunks may overflow the 128-head partial buffer; coarser never do
            if factor >= 1:
                assert made[1] == "chunked", (chunk, made)
