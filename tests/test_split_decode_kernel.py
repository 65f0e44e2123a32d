"""The small-work Triton MLA decode kernel (vllm_metax.ops.split_decode) against the torch
reference under Triton's interpreter on the CPU: ragged lengths not a multiple of the page or of
BLOCK_N, both merges (fused one-launch and the separate merge kernel), both score orientations,
both tile loads (pointer gathers; the TMA kernel's descriptors, and its fallback to pointers),
16 and 128 heads, and two runs in a row (the fused merge's counters reset themselves).

The interpreter must be chosen before triton is imported (other tests import it first), so the
checks run in one child process. Triton 3.8's interpreter miscomputes bfloat16 dots (numpy has
no bfloat16), so the problems are float16: the same kernel code, another element type.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from bench_support import load_bench

pytest.importorskip("triton", reason="the kernel is Triton; triton is not installed")

_CHILD = textwrap.dedent("""
    import json
    import torch
    from vllm_metax.ops.split_decode import SplitDecode
    from mla_tune.problem.instance import make_problem
    from mla_tune.problem.reference import mla_decode_reference, relative_error
    from mla_tune.problem.workload import Workload

    def problem(heads, lens, page):
        w = Workload(heads, 512, 64, 192 ** -0.5, len(lens), max(lens), ragged="uniform-random",
                     lengths=tuple(lens), q_dtype="float16", kv_dtype="float16")
        p = make_problem(w, page, "cpu", seed=0)
        ref = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table,
                                   p.seq_lens_cpu, w.softmax_scale)
        return w, p, ref

    def run(k, w, p, seq_lens=None):
        out = torch.full_like(p.q_nope, float("nan"))
        k.run(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table,
              p.seq_lens_cpu if seq_lens is None else seq_lens, w.softmax_scale, out)
        return out

    cases = []
    CONFIGS = [  # heads, lens, page, knobs
        (16, [5, 70, 130], 16, dict(num_splits=4, block_n=32, merge="fused", transposed=False)),
        (16, [5, 70, 130], 16, dict(num_splits=4, block_n=32, merge="kernel", transposed=False)),
        (16, [5, 70, 130], 16, dict(num_splits=3, block_n=64, merge="fused", transposed=True)),
        (16, [5, 70, 130], 16, dict(num_splits=1, block_n=16, merge="fused")),
        (128, [100], 16, dict(num_splits=3, block_n=32, block_h=64, merge="fused", num_warps=8)),
        (128, [100], 16, dict(num_splits=2, block_n=64, block_h=16, merge="kernel", transposed=True,
                              merge_block_d=512)),
        # the TMA kernel: tiles of one page (BLOCK_N <= page), a tail tile past a split's end
        (16, [5, 70, 130, 64], 64, dict(num_splits=4, block_n=16, merge="kernel", load="tma",
                                        transposed=False)),
        (16, [5, 70, 130], 32, dict(num_splits=3, block_n=32, merge="kernel", load="tma", transposed=True)),
        (128, [100, 3], 64, dict(num_splits=2, block_n=32, block_h=64, merge="kernel", load="tma",
                                 num_warps=8)),
        # page ids loaded 2 pages at a time (5 groups a split, the first split's last group partial,
        # the second split starting mid-page), and the block-table load in the tile loop (0)
        (16, [5, 300], 16, dict(num_splits=2, block_n=16, merge="kernel", load="tma", transposed=False,
                                group_pages=2)),
        (16, [70, 130], 32, dict(num_splits=3, block_n=32, merge="kernel", load="tma", transposed=False,
                                 group_pages=0)),
        # 16 heads padded to one 64-row head block (wgmma's M), 32-token tiles of 64-token pages
        (16, [70, 200], 64, dict(num_splits=2, block_n=32, block_h=64, merge="kernel", load="tma",
                                 num_warps=8, group_pages=32)),
    ]
    for heads, lens, page, knobs in CONFIGS:
        w, p, ref = problem(heads, lens, page)
        k = SplitDecode(heads, page, len(lens), device="cpu", **knobs)
        out = run(k, w, p)
        cases.append([f"H{heads} {lens} p{page} {knobs}", relative_error(out, ref),
                      int(torch.count_nonzero(k.counter))])
        if knobs.get("load") == "tma":      # the TMA kernel ran, not the pointer fallback
            assert k._descriptors(p.ckv_cache, p.kpe_cache) is not None, knobs

    # the TMA kernel on a cache whose pages are not rows of one view (a page-padded pool): the
    # pointer kernel serves it, same result
    w, p, ref = problem(16, [5, 70, 130], 32)
    k = SplitDecode(16, 32, 3, num_splits=3, block_n=32, merge="kernel", load="tma", device="cpu")
    pad = torch.zeros(p.ckv_cache.shape[0], 40, 576, dtype=p.ckv_cache.dtype)
    pad[:, :32, :512], pad[:, :32, 512:] = p.ckv_cache, p.kpe_cache
    out = torch.full_like(p.q_nope, float("nan"))
    k.run(p.q_nope, p.q_pe, pad[:, :32, :512], pad[:, :32, 512:], p.block_table, p.seq_lens_cpu,
          w.softmax_scale, out)
    padded = [k._descriptors(pad[:, :32, :512], pad[:, :32, 512:]) is None, relative_error(out, ref)]

    # two runs in a row of one fused kernel: the second finds the counters at 0 again
    w, p, ref = problem(16, [5, 70, 130], 16)
    k = SplitDecode(16, 16, 3, num_splits=4, block_n=32, merge="fused", device="cpu")
    twice = []
    for _ in range(2):
        out = run(k, w, p)
        twice.append([relative_error(out, ref), int(torch.count_nonzero(k.counter))])

    # a request of length 0 gets zeros, and the others are unaffected
    w, p, ref = problem(16, [40, 40], 16)
    k = SplitDecode(16, 16, 2, num_splits=4, block_n=16, merge="fused", device="cpu")
    out = run(k, w, p, torch.tensor([0, 40], dtype=torch.int32))
    empty = [float(out[0].abs().max()), relative_error(out[1], ref[1])]
    k = SplitDecode(16, 16, 2, num_splits=4, block_n=16, merge="kernel", load="tma", device="cpu")
    out = run(k, w, p, torch.tensor([0, 40], dtype=torch.int32))
    empty += [float(out[0].abs().max()), relative_error(out[1], ref[1])]

    # the configuration the plugin serves (split_decode.served: merge kernel, 64-column blocks,
    # up to 128 splits in one tile), with more splits than one tile holds too, and the plugin's
    # own check of it (float32 partials: the interpreter has no bfloat16)
    from vllm_metax.ops.split_decode import allocate_workspace, self_check, served, served_rows
    served_cases = []
    # page 16: the pointer kernel (a 64-token tile spans pages); page 64: the TMA kernel
    for heads, lens, splits, page in ((16, [1, 63, 64, 65, 300], 4, 16), (16, [9000], 160, 16),
                                      (128, [5, 200], 8, 16), (16, [1, 63, 64, 65, 300], 4, 64),
                                      (128, [5, 200], 8, 64)):
        w, p, ref = problem(heads, lens, page)
        ws = allocate_workspace(served_rows(heads), 16 if heads < 64 else heads, 512, torch.float32, "cpu")
        k = served(splits, "float32", heads, page, served_rows(heads), "cpu", workspace=ws)
        served_cases.append([f"H{heads} {lens} S{splits} p{page}", relative_error(run(k, w, p), ref),
                             self_check(k, torch.float16, "cpu"), k.load, k.transposed])
    # the other tuned pipes as served: t32x4 (32-token tiles, 4 stages, grouped page ids, 64 head
    # rows: 16 heads padded) at page 64, on its own served workspace (the real heads only)
    from vllm_metax.ops.split_decode import served_workspace
    for heads, lens, splits in ((16, [1, 63, 64, 65, 300, 2000], 8), (128, [5, 200], 4), (16, [300, 1000], 1)):
        w, p, ref = problem(heads, lens, 64)
        k = served(splits, "float32", heads, 64, served_rows(heads, "t32x4"), "cpu", pipe="t32x4",
                   workspace=served_workspace(heads, 512, "float32", "cpu", "t32x4"))
        served_cases.append([f"H{heads} {lens} S{splits} t32x4", relative_error(run(k, w, p), ref),
                             self_check(k, torch.float16, "cpu"), k.load, k.transposed])

    # a head block wider than the heads writes only the real heads' partial rows: the workspace
    # rows after the batch's last (request, split) keep what they held (an unmasked store writes
    # the padded rows over them: the next split's rows, or past the workspace's end)
    masked = []
    for heads, page, make in ((16, 64, lambda ws: served(4, "float32", 16, 64, 2, "cpu", pipe="t32x4", workspace=ws)),
                              (8, 16, lambda ws: SplitDecode(8, 16, 2, 4, block_n=32, merge="kernel", device="cpu",
                                                             workspace=ws))):
        w, p, ref = problem(heads, [300, 200], page)
        ws = allocate_workspace(2 * 4 + 4, heads, 512, torch.float32, "cpu")
        ws[0].fill_(7.0)
        ws[1].fill_(7.0)
        k = make(ws)
        masked.append([f"H{heads} p{page} bh{k.block_h} {k.load}", relative_error(run(k, w, p), ref),
                       bool(ws[0][8:].eq(7).all()) and bool(ws[1][8:].eq(7).all())])
    # the sweep's correctness gate (mla_tune.measure.trial.check_correctness) on the split family's
    # candidates of each pipe: right where the interpreter runs it, refused (not crashed) for PDL
    from mla_tune.families import Candidate, CandidateInvalid, get_family
    from mla_tune.measure.trial import MeasureSettings, check_correctness
    w = Workload(16, 512, 64, 192 ** -0.5, 2, 700, ragged="uniform-random", lengths=(700, 130),
                 q_dtype="float16", kv_dtype="float16")
    gate = []
    for params in ("num_splits=4,partial=float32", "num_splits=8,partial=float32,pipe=t32x4",
                   "num_splits=1,partial=float32,pipe=t32x4", "num_splits=8,partial=float32,pipe=t64-pdl"):
        try:
            gate.append([params, check_correctness(get_family("split"), w, Candidate.parse("split/triton/p64/" + params),
                                                   MeasureSettings(device="cpu"), seed=1)])
        except CandidateInvalid as e:
            gate.append([params, e.reason])
    print("RESULT " + json.dumps({"cases": cases, "twice": twice, "empty": empty, "served": served_cases,
                                  "padded": padded, "masked": masked, "gate": gate}))
""")


@pytest.mark.slow
def test_kernel_matches_the_reference_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert len(out["cases"]) == 12
    for label, err, counters in out["cases"]:
        assert err < 2e-2, (label, err)
        assert counters == 0, (label, "counters left non-zero", counters)
    (err1, c1), (err2, c2) = out["twice"]
    assert err1 < 2e-2 and err2 < 2e-2, out["twice"]
    assert c1 == 0 and c2 == 0, out["twice"]
    zero_max, other_err, tma_zero_max, tma_other_err = out["empty"]
    assert zero_max == 0.0 and other_err < 2e-2, out["empty"]
    assert tma_zero_max == 0.0 and tma_other_err < 2e-2, out["empty"]
    fell_back, padded_err = out["padded"]
    assert fell_back and padded_err < 2e-2, out["padded"]
    assert len(out["served"]) == 8
    for label, err, check, load, _ in out["served"]:
        assert err < 2e-2 and check is None, (label, err, check)
    # what is served: the pointer kernel below a 64-token page, the TMA kernel from it (tokens as
    # the dots' M at 16 heads, a 64-row head block at 128); t32x4: the TMA kernel, heads as M
    assert [(row[3], row[4]) for row in out["served"]] == [
        ("gather", False), ("gather", False), ("gather", False), ("tma", True), ("tma", False),
        ("tma", False), ("tma", False), ("tma", False)]
    assert len(out["masked"]) == 2
    for label, err, untouched in out["masked"]:
        assert err < 2e-2 and untouched, (label, err, untouched)
    *right, pdl = out["gate"]
    assert len(right) == 3 and all(err < 2e-2 for _, err in right), right
    assert pdl == ["num_splits=8,partial=float32,pipe=t64-pdl", "unsupported"]


def test_knobs_are_checked_before_anything_runs():
    torch = pytest.importorskip("torch")
    from vllm_metax.ops.split_decode import SplitDecode, default_block_h, splits_for
    with pytest.raises(ValueError, match="merge"):
        SplitDecode(16, 16, 1, 4, merge="two", device="cpu")
    with pytest.raises(ValueError, match="load"):
        SplitDecode(16, 16, 1, 4, merge="kernel", load="dma", device="cpu")
    # the TMA kernel: merge kernel only, tiles inside a page
    for bad in (dict(merge="fused"), dict(block_n=64)):
        with pytest.raises(ValueError, match="load 'tma' needs"):
            SplitDecode(16, 32, 1, 4, **dict(dict(merge="kernel", block_n=32, load="tma"), **bad), device="cpu")
    # tokens as the dots' M in one stage: measured wrong on the H200 with either load
    for load in ("gather", "tma"):
        with pytest.raises(ValueError, match="num_stages >= 2"):
            SplitDecode(16, 64, 1, 4, merge="kernel", transposed=True, num_stages=1, load=load, device="cpu")
    with pytest.raises(ValueError, match="block_h"):
        SplitDecode(16, 16, 1, 4, block_h=8, device="cpu")
    with pytest.raises(ValueError, match="power of two"):
        SplitDecode(16, 48, 1, 4, device="cpu")
    # the merge as a programmatic dependent launch: Hopper's grid-dependency PTX, not the interpreter's
    with pytest.raises(ValueError, match="pdl"):
        SplitDecode(16, 64, 1, 4, merge="kernel", load="tma", pdl=True, device="cpu")
    for bad in (3, -2):
        with pytest.raises(ValueError, match="group_pages must be 0 or a power of two"):
            SplitDecode(16, 64, 1, 4, merge="kernel", load="tma", group_pages=bad, device="cpu")
    k = SplitDecode(128, 64, 2, 8, device="cpu")
    assert (k.block_h, k.num_warps, k.head_blocks) == (64, 8, 2)
    assert k.ws_acc.shape == (2 * 8, 128, 512) and k.counter.dtype == torch.int32
    assert default_block_h(16) == 16 and default_block_h(128) == 64
    # BLOCK_N-aligned chunks: 1024 tokens over 64 splits of >= 64 tokens use 16 of them
    assert splits_for(1024, 64, 64) == 16 and splits_for(130, 32, 4) == 3 and splits_for(5, 32, 4) == 1


def test_the_tma_kernel_is_served_only_where_the_device_has_tma(monkeypatch):
    # MetaX GPUs have no tensor-memory accelerator and their Triton may lack tensor descriptors:
    # there, and on NVIDIA GPUs before Hopper, `served` picks the pointer kernel (same knobs)
    torch = pytest.importorskip("torch")
    from vllm_metax.core import device as dev_mod
    from vllm_metax.ops import split_decode as sd
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    for name, metax, want in (("NVIDIA H200", False, True), ("MetaX C500", True, False)):
        monkeypatch.setattr(dev_mod, "detect_device", lambda n=name, m=metax: dev_mod.DeviceInfo(n, "test", m))
        assert sd.tma_supported(cuda) is want, name
    monkeypatch.setattr(dev_mod, "detect_device", lambda: dev_mod.DeviceInfo("NVIDIA A100", "torch", False))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert sd.tma_supported(cuda) is False
    assert sd.tma_supported("cpu") is True                   # Triton's interpreter
    assert sd.served(16, "float32", 16, 64, 2, "cpu").load == "tma"
    monkeypatch.setattr(sd, "_TensorDescriptor", None)       # a Triton without tensor descriptors
    assert sd.tma_supported("cpu") is False
    k = sd.served(16, "float32", 16, 64, 2, "cpu")
    assert (k.load, k.transposed) == ("gather", False)


def test_compiled_for_hopper_the_grouped_page_ids_let_copies_overlap_the_dots(tmp_path):
    """bench/experiments/split_kernel_compile.py on the installed Triton (no GPU: ahead-of-time for sm_90a):
    the served 16-head kernel issues each tile's copy only after the previous tile's dots (0 in
    flight), and with page ids loaded ahead of the loop 32-token tiles at 4 stages keep 2 copies in
    flight; with the block-table load in the loop the pipeliner leaves the copies 2 buffers."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    from pathlib import Path
    from vllm_metax.ops import split_decode as sd, split_kernels
    if sd._TensorDescriptor is None:
        pytest.skip("this Triton has no tensor descriptors")
    skc = load_bench("split_kernel_compile")
    import triton
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("this Triton ships no cuobjdump")
    rows = {v: skc.compile_one(split_kernels.tma_kernel, v, 90, str(cuobjdump), tmp_path)
            for v in ((16, 16, 64, 8, 2, True, 0), (128, 64, 32, 8, 4, False, 32), (128, 64, 32, 8, 4, False, 0))}
    served, grouped, in_loop = rows.values()
    assert all(r["status"] == "ok" and r["fits"] for r in rows.values()), rows
    assert (served["kv_buffers"], served["copies_in_flight_during_dots"]) == (2, 0), served
    assert (grouped["kv_buffers"], grouped["copies_in_flight_during_dots"]) == (4, 2), grouped
    assert grouped["stack_bytes"] == 0, grouped
    assert in_loop["kv_buffers"] == 2, in_loop
    # pdl: the split kernel lets the merge grid launch early, and the merge waits for it
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    k = split_kernels.merge_kernel
    const = dict(HP=16, R=512, BLOCK_N=64, DC=64, ST=128, PDL=True)
    sig = {n: "constexpr" if n in const else {"WS_ACC": "*bf16", "WS_LSE": "*fp32", "SEQ": "*i32",
                                              "OUT": "*bf16"}.get(n, "i32") for n in k.arg_names}
    c = triton.compile(ASTSource(k, sig, const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=1, launch_pdl=True))
    assert "griddepcontrol.wait" in c.asm["ptx"] and c.metadata.launch_pdl
    # only the request's length (the step's input) is read before the wait; the workspace after
    lines = c.asm["ptx"].splitlines()
    wait_at = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    assert sum("ld.global" in ln for ln in lines[:wait_at]) == 1
    assert sum("ld.global" in ln for ln in lines[wait_at:]) >= 2
    const = dict(H=16, HP=16, R=512, P=64, PAGE=64, BLOCK_H=16, BLOCK_N=64, TRANS=True, GROUP_PAGES=0, PDL=True)
    k = split_kernels.tma_kernel
    c = triton.compile(ASTSource(k, skc.signature(k, const, 64), const), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=8, num_stages=2))
    assert "griddepcontrol.launch_dependents" in c.asm["ptx"]
