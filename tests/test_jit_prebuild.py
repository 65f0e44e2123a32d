"""The background FlashInfer JIT build: which modules, the switch, the child's work (no nvcc here)."""

import pytest

from mla_tune.measure import jit_prebuild
from mla_tune.problem.workload import model_preset, workload_for

V3 = model_preset("deepseek-v3")


def test_one_module_per_dtype_and_head_dims_not_per_bucket():
    ws = [workload_for(V3, tp, b, c) for tp in (1, 8) for b in (1, 64) for c in (1024, 4096)]
    ws.append(workload_for(V3, 8, 1, 1024, q_dtype="float16", kv_dtype="float16"))
    assert jit_prebuild.module_specs(ws) == [("bfloat16", "bfloat16", 512, 64),
                                             ("float16", "float16", 512, 64)]


def test_switched_off_or_nothing_to_build(monkeypatch):
    w = [workload_for(V3, 8, 1, 1024)]
    monkeypatch.setenv(jit_prebuild.ENV, "0")
    assert jit_prebuild.start_prebuild(w) is None
    monkeypatch.delenv(jit_prebuild.ENV)
    assert jit_prebuild.start_prebuild([]) is None
    assert jit_prebuild.start_prebuild(w, backends=("cutlass",)) is None
    jit_prebuild.finish_prebuild(None)


def test_the_child_builds_every_module_in_parallel_and_survives_failures(monkeypatch):
    built = []

    def build(backend, spec):
        built.append((backend, tuple(spec)))
        if backend == "fa2":
            raise RuntimeError("nvcc: not found")

    monkeypatch.setattr(jit_prebuild, "_build", build)
    jit_prebuild.main('["fa2", "fa3"]', '[["bfloat16", "bfloat16", 512, 64]]')
    assert sorted(built) == [("fa2", ("bfloat16", "bfloat16", 512, 64)),
                             ("fa3", ("bfloat16", "bfloat16", 512, 64))]


def test_started_in_the_background_and_ended(monkeypatch):
    proc = jit_prebuild.start_prebuild([workload_for(V3, 8, 1, 1024)])
    assert proc is not None and "fa3" in proc.args[-1] and "512" in proc.args[-1]
    jit_prebuild.finish_prebuild(proc)
    assert proc.poll() is not None


# ---------------------------------------------------------------- vLLM's Triton kernels

def _triton(page, splits, **more):
    from mla_tune.families.base import Candidate
    return Candidate("triton", "triton", page, {"num_kv_splits": splits, **more})


def test_one_triton_job_per_kernel_specialisation_in_first_use_order():
    from mla_tune.families.base import Candidate
    tp8_small, tp8_big = workload_for(V3, 8, 4, 1024), workload_for(V3, 8, 64, 4096)
    tp1 = workload_for(V3, 1, 4, 1024)
    fi = Candidate("flashinfer", "fa3", 64, {})
    jobs = jit_prebuild.triton_jobs([
        (tp8_small, [fi, _triton(64, 4, rule="vllm"), _triton(64, 8), _triton(16, 4)]),
        # same heads, page, splits and a table width that is again a multiple of 16: no new job;
        # the vLLM-rule mark is not part of the kernel
        (tp8_big, [_triton(64, 4), _triton(64, 8, rule="vllm"), _triton(64, 2)]),
        (tp1, [_triton(64, 4)]),                                    # 128 heads: a new kernel
    ])
    assert [(j["num_heads"], j["page_size"], j["params"]["num_kv_splits"]) for j in jobs] == [
        (16, 64, 4), (16, 64, 8), (16, 16, 4), (16, 64, 2), (128, 64, 4)]
    assert all(j["context_len"] in (1024, 4096) for j in jobs)
    # a table one page wide (Triton specialises an integer argument equal to 1) is its own job
    one_page = workload_for(V3, 8, 4, 64)
    assert len(jit_prebuild.triton_jobs([(tp8_small, [_triton(64, 4)]),
                                         (one_page, [_triton(64, 4)])])) == 2


def test_triton_prebuild_switched_off_or_nothing_to_do(monkeypatch):
    jobs = jit_prebuild.triton_jobs([(workload_for(V3, 8, 1, 1024), [_triton(64, 1)])])
    monkeypatch.setenv(jit_prebuild.ENV, "0")
    assert jit_prebuild.start_triton_prebuild(jobs) is None
    monkeypatch.delenv(jit_prebuild.ENV)
    assert jit_prebuild.start_triton_prebuild([]) is None
    assert 1 <= jit_prebuild.triton_procs() <= jit_prebuild.MAX_TRITON_PROCS


def test_the_triton_child_compiles_every_job_and_counts_failures(monkeypatch):
    done = []
    monkeypatch.setattr(jit_prebuild, "compile_only", lambda: done.append("compile-only"))
    monkeypatch.setattr(jit_prebuild, "compile_triton", lambda j: done.append(j["page_size"]) or j["page_size"] != 16)
    jobs = jit_prebuild.triton_jobs([(workload_for(V3, 8, 1, 1024), [_triton(64, 1), _triton(16, 1)])])
    assert jit_prebuild.main_triton(1, jobs) == 1
    assert done == ["compile-only", 64, 16]


def test_a_triton_job_that_cannot_compile_is_reported_not_raised():
    # no GPU here (or a broken job): False, and the worker compiles it as without the prebuild
    job = jit_prebuild.triton_jobs([(workload_for(V3, 8, 1, 1024), [_triton(64, 1)])])[0]
    assert jit_prebuild.compile_triton({**job, "page_size": 0}) is False


def test_the_triton_background_process_is_started_and_ended_with_its_group():
    jobs = jit_prebuild.triton_jobs([(workload_for(V3, 8, 1, 1024), [_triton(64, 1)])])
    proc = jit_prebuild.start_triton_prebuild(jobs, procs=1)
    assert proc is not None and "main_triton(1)" in proc.args[-1]
    jit_prebuild.finish_prebuild(proc)
    assert proc.poll() is not None


def test_split_kernels_are_compiled_once_per_heads_pipe_and_partials():
    from mla_tune.families import get_family
    fam = get_family("split")
    buckets = [(w, fam.space(w, [64])) for w in (workload_for(V3, 8, 1, 1024), workload_for(V3, 8, 8, 32768),
                                                 workload_for(V3, 1, 1, 1024))]
    jobs = [j for j in jit_prebuild.triton_jobs(buckets) if j["family"] == "split"]
    keys = [(j["num_heads"], j["params"].get("pipe", "t64"), j["params"]["partial"], j["params"]["num_splits"] > 1)
            for j in jobs]
    assert len(keys) == len(set(keys))
    # every pipe and partial the space names, at both head counts: nothing the worker would compile
    want = {(w.num_heads, c.params.get("pipe", "t64"), c.params["partial"], c.params["num_splits"] > 1)
            for w, cs in buckets for c in cs}
    assert set(keys) == want and {k[1] for k in keys} == {"t64", "t32x4", "t64-pdl", "t32x4-pdl"}
    # no GPU here: the job fails (the worker compiles it, as without the prebuild), it does not raise
    assert jit_prebuild.compile_triton(jobs[0]) is False
    assert jit_prebuild.compile_triton({**jobs[0], "family": "flashinfer"}) is False


def test_compile_only_warms_up_and_builds_each_kernels_launcher(monkeypatch):
    # Triton's warm-up compiles a kernel but not its launcher (built on the first real launch,
    # cached beside the kernel): compile_only also initialises the warmed kernel's handles
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction
    calls = []

    class Compiled:
        def _init_handles(self):
            calls.append("handles")

    def fake_run(self, *args, grid, warmup, **kwargs):
        calls.append(("run", warmup))
        return Compiled()
    monkeypatch.setattr(JITFunction, "run", fake_run)
    jit_prebuild.compile_only()
    jit_prebuild.compile_only()                       # once per process: not wrapped twice
    JITFunction.run(object(), 1, grid=(1,), warmup=False)
    assert calls == [("run", True), "handles"]
