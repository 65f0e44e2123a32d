"""A small results DB with known samples, built through ResultsStore, for report/emit/plot tests.

It holds what a real results.db holds: a CPU reference run, two GPU runs on one device (an H200,
with the roofline ceilings recorded), one run on another device, three kernel families, several
page sizes, and invalid trials with their reasons. Every sample is a known number, so a test can
recompute any statistic the report prints from the DB itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mla_tune.families.base import Candidate
from mla_tune.problem.workload import model_preset, workload_for
from mla_tune.problem.roofline import workload_bytes, workload_flops
from mla_tune.store.results import ResultsStore

H200 = "NVIDIA H200"
METAX = "MetaX C500"
MODEL = "deepseek-v3"
TP = 8                      # 128 heads / 8 = 16 heads per rank
BATCHES = (1, 8)
CONTEXTS = (1024, 4096)
COPY_GBPS = 4000.0
MATMUL_TFLOPS = 800.0


def _samples(base: float, n: int = 12) -> list[float]:
    # a fixed, slightly skewed pattern around `base`: median = base * 1.0025
    pattern = [1.00, 1.01, 0.99, 1.02, 0.98, 1.00, 1.03, 0.995, 1.005, 1.01, 0.99, 1.06]
    return [round(base * p, 4) for p in pattern[:n]]


# candidate key -> time in us as a function of (batch, context); None = invalid (reason, message)
DEFAULTS = {"flashinfer/auto/p64", "triton/triton/p64/num_kv_splits=4,rule=vllm", "reference/torch/p64"}
GPU_CANDIDATES = {
    "flashinfer/auto/p64": lambda b, c: 10.0 + b * c / 2000,          # the family default
    "flashinfer/fa3/p64": lambda b, c: 7.0 + b * c / 2500,            # clearly faster
    "flashinfer/fa2/p64": lambda b, c: 12.0 + b * c / 1500,
    "flashinfer/fa3/p16": lambda b, c: 7.05 + b * c / 2480,           # within noise of p64
    "flashinfer/cutlass/p64": ("unsupported", "cutlass MLA needs SM100; this is SM90"),
    "triton/triton/p64/num_kv_splits=4,rule=vllm": lambda b, c: 40.0 + b * c / 600,   # the family default
    "triton/triton/p64/num_kv_splits=16": lambda b, c: 30.0 + b * c / 700,
    "triton/triton/p64/num_kv_splits=64": ("wrong_result", "relative error 0.31 > 0.02 against the torch reference"),
}
CPU_CANDIDATES = {
    "reference/torch/p16": lambda b, c: 900.0 + b * c / 10,
    "reference/torch/p64": lambda b, c: 880.0 + b * c / 10,
}


@dataclass
class Fixture:
    path: Path
    runs: dict = field(default_factory=dict)          # label -> run id
    trials: dict = field(default_factory=dict)        # (run label, batch, context, candidate) -> trial id
    samples: dict = field(default_factory=dict)       # trial id -> kernel_us samples


def build_fixture_db(path: str | Path) -> Fixture:
    """Write the fixture DB to `path` and return what went in."""
    fx = Fixture(Path(path))
    model = model_preset(MODEL)
    with ResultsStore(fx.path) as store:
        fx.runs["cpu"] = store.add_run({
            "kind": "cpu-reference", "device_name": "cpu", "torch": "2.14.0", "host": "laptop"})
        gpu_env = {"kind": "gpu", "device_name": H200, "sm_count": 132, "torch": "2.11.0+cu130",
                   "flashinfer": "0.7.2.post1", "cuda": "13.0", "copy_gbps": COPY_GBPS,
                   "matmul_tflops": MATMUL_TFLOPS, "host": "h200-box"}
        fx.runs["gpu"] = store.add_run(gpu_env)
        fx.runs["gpu2"] = store.add_run(gpu_env)      # a later sweep that added larger batches
        fx.runs["metax"] = store.add_run({
            "kind": "gpu", "device_name": METAX, "sm_count": 104, "torch": "2.6.0+metax",
            "flashinfer": "0.2.6+metax", "copy_gbps": 1600.0, "matmul_tflops": 280.0})

        def put(label, wl, key, spec, scale=1.0):
            wid = store.workload_id(wl, workload_bytes(wl), workload_flops(wl))
            cand = Candidate.parse(key)
            if isinstance(spec, tuple):
                tid = store.add_trial(fx.runs[label], wid, cand, "invalid",
                                      invalid_reason=spec[0], message=spec[1], sweep=label,
                                      is_default=key in DEFAULTS)
                fx.samples[tid] = []
            else:
                s = _samples(spec(wl.batch_size, wl.context_len) * scale)
                tid = store.add_trial(fx.runs[label], wid, cand, "ok", {"kernel_us": s,
                                      "plan_us": [500.0, 510.0, 490.0]}, compile_s=1.5,
                                      max_rel_error=0.004, sweep=label,
                                      is_default=key in DEFAULTS)
                fx.samples[tid] = s
            fx.trials[(label, wl.batch_size, wl.context_len, key)] = tid

        for b in BATCHES:
            for c in CONTEXTS:
                wl = workload_for(model, TP, b, c)
                for key, spec in GPU_CANDIDATES.items():
                    put("gpu", wl, key, spec)
                if (b, c) == (1, 1024):
                    for key, spec in CPU_CANDIDATES.items():
                        put("cpu", wl, key, spec)
                    put("metax", wl, "flashinfer/auto/p64", GPU_CANDIDATES["flashinfer/auto/p64"], 2.5)
                    put("metax", wl, "flashinfer/fa2/p64", GPU_CANDIDATES["flashinfer/fa2/p64"], 2.0)
        wl = workload_for(model, TP, 64, 4096)
        for key in ("flashinfer/auto/p64", "flashinfer/fa3/p64", "flashinfer/cutlass/p64"):
            put("gpu2", wl, key, GPU_CANDIDATES[key])
    return fx
