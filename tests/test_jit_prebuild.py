"""The background FlashInfer JIT build: which modules, the switch, the child's work (no nvcc here)."""

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
