"""Where the time of a small MLA decode step goes: the kernels one FlashInfer `run()` launches,
their GPU durations (torch.profiler / CUPTI), and the wall time of the same call replayed from a
CUDA graph with a warm and a cold L2 (CUDA events).

    source bench/tools/device-setup.sh && python3 bench/experiments/small_work_floor.py --out $OUT

Issue #15 asks for small work (B x L <= 8K KV tokens) at <= 12 us per call; the tuned config and
FlashInfer `auto` both sit at 16-21 us there (bench/results/tuned_vs_auto_h200.md). This tells
whether that floor is the attention kernel, the split-merge kernel, or the gaps between them, for
the shapes below, through the plugin's op (`vllm_metax.ops.flashinfer_mla.MLADecodeKernel`).
Writes <out>/small_work_floor_<device>.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = [  # (heads, batch, context)
    (16, 1, 1024), (16, 8, 1024), (16, 1, 8192), (128, 1, 1024), (128, 8, 1024), (128, 1, 8192),
]
CKV, KPE, PAGE = 512, 64, 64


def _setup(torch, heads, batch, ctx, backend, kv_chunk):
    from vllm_metax.ops.flashinfer_mla import GraphBuffers, MLADecodeKernel, make_workspace
    from vllm_metax.ops.paged_metadata import build_paged_metadata

    dev = torch.device("cuda")
    pages_per = (ctx + PAGE - 1) // PAGE
    table = torch.arange(batch * pages_per, dtype=torch.int32, device=dev).view(batch, pages_per)
    cache = torch.randn(batch * pages_per, PAGE, CKV + KPE, dtype=torch.bfloat16, device=dev)
    q = torch.randn(batch, heads, CKV + KPE, dtype=torch.bfloat16, device=dev)
    out = torch.empty(batch, heads, CKV, dtype=torch.bfloat16, device=dev)
    gb = GraphBuffers.allocate(batch, batch * pages_per, dev)
    k = MLADecodeKernel(make_workspace(dev), backend, use_cuda_graph=True, graph_buffers=gb)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    args = (CKV, KPE, PAGE, False, 1 / 192 ** 0.5, torch.bfloat16, torch.bfloat16)
    for _ in range(2):   # the second plan takes the fast re-plan (where kv_chunk applies)
        k.plan(build_paged_metadata(table, lens, PAGE, out_kv_indices=gb.kv_indices), heads, *args,
               kv_chunk=kv_chunk)

    def step():
        k.run(q[..., :CKV], q[..., CKV:], cache[..., :CKV], cache[..., CKV:], out=out)
    return k, step, cache


def _kernels(torch, step):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    per = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.device_time > 0:
            per.setdefault(e.name, []).append(e.device_time)
    return {name: {"calls_per_step": len(ts) / 10, "median_us": statistics.median(ts)}
            for name, ts in per.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--backends", default="fa3,fa2")
    args = ap.parse_args(argv)
    import torch
    from bench.experiments.graph_replay import replay_median_us
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU, and torch sees none here: run it on the GPU machine")
    rows, lines = [], []
    name = torch.cuda.get_device_name()
    lines.append(f"# small-work floor on {name}, torch {torch.__version__}")
    for heads, batch, ctx in SHAPES:
        for backend in args.backends.split(","):
            for kv_chunk in (None, float("inf")):
                try:
                    _, step, _ = _setup(torch, heads, batch, ctx, backend, kv_chunk)
                    kernels = _kernels(torch, step)
                    warm, cold = replay_median_us(step, 50), replay_median_us(step, 50, cold_l2=True)
                except Exception as e:  # noqa: BLE001 - a refusal or failure is reported, not fatal
                    lines.append(f"H{heads} B{batch} L{ctx} {backend} kv_chunk={kv_chunk}: {type(e).__name__}: {e}")
                    continue
                gpu = sum(v["median_us"] * v["calls_per_step"] for v in kernels.values())
                row = {"heads": heads, "batch": batch, "context": ctx, "backend": backend,
                       "kv_chunk": "none" if kv_chunk else "default", "kernels": kernels,
                       "kernel_sum_us": gpu, "graph_warm_us": warm, "graph_cold_us": cold}
                rows.append(row)
                ks = "; ".join(f"{n[:60]} x{v['calls_per_step']:g} {v['median_us']:.1f}us"
                               for n, v in sorted(kernels.items(), key=lambda kv: -kv[1]["median_us"]))
                lines.append(f"H{heads} B{batch} L{ctx} {backend} kv_chunk={row['kv_chunk']}: "
                             f"graph warm {warm:.1f} us, cold L2 {cold:.1f} us; kernels sum "
                             f"{gpu:.1f} us: {ks}")
                print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "h200" if "H200" in name else name.replace(" ", "_").lower()
    (out / f"small_work_floor_{tag}.txt").write_text("\n".join(lines) + "\n")
    (out / f"small_work_floor_{tag}.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
