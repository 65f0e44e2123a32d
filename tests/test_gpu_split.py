"""The split-KV Triton decode (`vllm_metax.ops.split_decode`) on a real GPU: the family the sweep
measures against the torch reference, the plugin's check of it, and FLASHINFER_MLA serving a tuned
split bucket through vLLM 0.33.0's own builder and impl, eager and under full CUDA-graph capture
and replay (the graph binds vLLM's persistent block table and sequence lengths, so a replay with
next step's contents must match the reference for them).

On the GPU machine vLLM is carried as Python files only: VLLM_METAX_FORCE=1 makes the plugin the
platform.
"""

from __future__ import annotations

import os

import pytest
import torch

import plugin_support as ps
from mla_tune.families import Candidate, get_family
from mla_tune.problem.instance import make_problem
from mla_tune.problem.reference import mla_decode_reference, relative_error
from mla_tune.problem.workload import Workload
from vllm_metax.core import choices, decisions, tuned_config as tc
from vllm_metax.ops import split_decode as op

pytestmark = [pytest.mark.gpu]

TOL = 2e-2
DEVICE = "cuda"


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("knobs", [(4, "bfloat16"), (64, "bfloat16"), (16, "float32"), (32, "bfloat16", "t32x4"),
                                   (8, "bfloat16", "t64-pdl"), (16, "bfloat16", "t32x4-pdl")])
def test_family_matches_the_reference_on_ragged_lengths(heads, knobs):
    lens = (1, 63, 64, 65, 700, 4096, 130, 2049)
    w = Workload(heads, 512, 64, 192 ** -0.5, len(lens), max(lens), ragged="uniform-random", lengths=lens)
    p = make_problem(w, 64, DEVICE, seed=heads)
    fam = get_family("split")
    assert fam.available(DEVICE).ok
    params = {"num_splits": knobs[0], "partial": knobs[1], **({"pipe": knobs[2]} if len(knobs) > 2 else {})}
    cand = Candidate("split", "triton", 64, params)
    prepared = fam.prepare(w, cand, p)
    ref = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table, p.seq_lens_cpu,
                               w.softmax_scale)
    for _ in range(2):
        prepared.out.fill_(float("nan"))
        out = prepared.run()
        torch.cuda.synchronize()
        assert relative_error(out, ref) < TOL, relative_error(out, ref)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("partial", ["bfloat16", "float32"])
def test_the_plugins_check_passes_here(heads, partial):
    k = op.served(32, partial, heads, 16, op.served_rows(heads), DEVICE)
    assert op.self_check(k, torch.bfloat16, DEVICE) is None


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("pipe", sorted(op.PIPES))
def test_every_pipe_passes_the_plugins_check_at_page_64(heads, pipe):
    k = op.served(32, "bfloat16", heads, 64, op.served_rows(heads, pipe), DEVICE, pipe=pipe,
                  workspace=op.served_workspace(heads, 512, "bfloat16", DEVICE, pipe))
    assert k.load == "tma" and (k.block_n, k.num_stages, k.pdl) == (
        op.PIPES[pipe].block_n, op.PIPES[pipe].num_stages, op.PIPES[pipe].pdl)
    assert op.self_check(k, torch.bfloat16, DEVICE, lens=(1, 77, 300, 4100)) is None


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    os.environ.setdefault("VLLM_METAX_FORCE", "1")
    tc.clear_cache()
    return ps.make_vllm_config(tmp_path_factory.mktemp("model"))


def _builder(vc, split_params):
    from vllm_metax.backend.plan_choice import PlanChoice
    builder = ps.make_builder(vc, device=DEVICE)
    builder.choice = PlanChoice(ps.side_kernel_entry("split", split_params),
                                decisions.FlashInferBackends(("fa3", "fa2"), "fa3"))
    return builder


def _reference(q, kv, bt, lens):
    return mla_decode_reference(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], bt, lens,
                                ps.softmax_scale())


@pytest.mark.vllm
def test_flashinfer_mla_serves_a_tuned_split_bucket_eagerly(model_root):
    vc = ps.page64_config(model_root, cudagraph=False)
    builder = _builder(vc, {"backend": "triton", "num_splits": 32, "partial": "bfloat16"})
    impl = ps.make_impl(vc)
    for seed, seq_lens in ((1, [1, 300, 4096]), (2, [5000, 64])):
        bt, lens, common, num_pages = ps.ragged_batch(seq_lens, 64, device=DEVICE, seed=seed)
        md = builder.build(0, common)
        assert md.decode.backend == choices.SPLIT and md.decode.paged is None
        q, kv = ps.decode_inputs(len(seq_lens), num_pages, seed)
        out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), kv, md, None)
        assert lse is None and relative_error(out, _reference(q, kv, bt, lens)) < TOL
    # batch 8 is tuned to split too; a batch of 16 snaps to it: the same kernel
    bt, lens, common, num_pages = ps.ragged_batch([700] * 16, 64, device=DEVICE, seed=3)
    md = builder.build(0, common)
    assert md.decode.backend == choices.SPLIT and len(builder._split_kernels) == 1
    q, kv = ps.decode_inputs(16, num_pages, 3)
    out, _ = impl.forward_mqa((q[..., :512], q[..., 512:]), kv, md, None)
    assert relative_error(out, _reference(q, kv, bt, lens)) < TOL


@pytest.mark.vllm
@pytest.mark.parametrize("pipe", ["t64", "t32x4-pdl"])
def test_split_under_full_cudagraph_capture_and_replay(model_root, pipe):
    vc = ps.page64_config(model_root, cudagraph=True)
    builder = _builder(vc, {"backend": "triton", "num_splits": 64, "partial": "bfloat16",
                            **({"pipe": pipe} if pipe != "t64" else {})})
    impl = ps.make_impl(vc)
    # vLLM's persistent buffers: the block table and lengths a captured graph reads every replay
    step = ps.GraphStep(builder, device=DEVICE)
    static_q, static_kv = step.q, step.kv

    def forward(md):
        return step.forward(impl, md)

    md, bt, lens = step([100, 7, 3000, 64, 1, 512, 2047, 900], seed=1)
    assert md.decode.cuda_graph and md.decode.backend == choices.SPLIT
    k = md.decode.kernel.kernel          # the tuned pipe's kernel (PDL: the merge a dependent launch)
    assert (k.block_n, k.pdl) == (op.PIPES[pipe].block_n, op.PIPES[pipe].pdl)
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
        assert md2.decode.backend == choices.SPLIT and md2.decode.kernel.kernel is md.decode.kernel.kernel
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(captured, _reference(static_q, static_kv, bt2, lens2)) < TOL, seed


def test_the_background_compile_of_split_kernels_is_what_the_worker_then_finds(tmp_path):
    """jit_prebuild's Triton pool compiles the split family's kernels (TMA split kernel, merge
    kernel, PDL launch) without launching; a fresh process checking those candidates on the real
    ragged batch-4 workload then adds nothing to Triton's on-disk cache."""
    import json
    import subprocess
    import sys
    from mla_tune.measure.jit_prebuild import triton_jobs
    from mla_tune.problem.workload import model_preset, workload_for
    w = workload_for(model_preset("deepseek-v3"), 8, 4, 3000, ragged="lognormal", seed=2)
    keys = ["num_splits=8,partial=bfloat16,pipe=t32x4", "num_splits=16,partial=bfloat16,pipe=t64-pdl"]
    jobs = triton_jobs([(w, [Candidate.parse("split/triton/p64/" + k) for k in keys])])
    assert len(jobs) == 2
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), VLLM_METAX_FORCE="1")
    code = ("import json, sys; from mla_tune.measure.jit_prebuild import main_triton; "
            "print(main_triton(2, json.loads(sys.argv[1])))")
    r = subprocess.run([sys.executable, "-c", code, json.dumps(jobs)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.stdout.strip().splitlines()[-1] == "2", r.stderr[-2000:]
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) >= 4, built            # two split kernels, two merge kernels (one PDL)
    measure_code = ("import sys\n"
                    "from mla_tune.families import Candidate, get_family\n"
                    "from mla_tune.measure.trial import MeasureSettings, check_correctness\n"
                    "from mla_tune.problem.workload import model_preset, workload_for\n"
                    "w = workload_for(model_preset('deepseek-v3'), 8, 4, 3000, ragged='lognormal', seed=2)\n"
                    "for k in sys.argv[1:]:\n"
                    "    c = Candidate.parse('split/triton/p64/' + k)\n"
                    "    print(check_correctness(get_family('split'), w, c, MeasureSettings(device='cuda'), seed=1))\n")
    r = subprocess.run([sys.executable, "-c", measure_code, *keys], env=env, capture_output=True, text=True,
                       timeout=600)
    errs = [float(x) for x in r.stdout.split()]
    assert len(errs) == 2 and all(e < TOL for e in errs), r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == built
