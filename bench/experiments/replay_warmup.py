"""Which runs of a timed CUDA graph are slow, and what removes it: the per-run times of the first
three replays of freshly captured timed graphs (the sweep's (flush, event, run, event) x 10 of
`mla_tune.measure.timing.KernelTimer`), for FlashInfer fa3 candidates, with four variants:

    plain        the timed graph as the sweep captures it
    upload       plain, uploaded to the device (cudaGraphUpload) before its first replay
    lead         one untimed (flush, run) ahead of the ten timed ones
    lead+upload  both

Between two graphs the L2-flush buffer is filled for 30 ms, as the sweep's clock warm-up does
between capture and sampling. Prints, per variant, replay and run index, the median (and p90)
of run time / the candidate's reference median (runs 4-9 of the third replay), over every
candidate and repetition. Writes <out>/replay_warmup_h200.{txt,json}.

    source bench/tools/device-setup.sh && python3 bench/experiments/replay_warmup.py --out $OUT
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = [(16, 1, 1024), (16, 8, 4096), (16, 64, 8192), (128, 1, 4096), (128, 16, 4096)]
VARIANTS = ("plain", "upload", "lead", "lead+upload")
RUNS = 10


def _graph_upload():
    """cudaGraphUpload(exec, stream) through cuda-bindings or the loaded libcudart; None if neither."""
    try:
        from cuda.bindings import runtime as rt

        def up(graph, stream):
            err, = rt.cudaGraphUpload(graph.raw_cuda_graph_exec(), stream.cuda_stream)
            if int(err) != 0:
                raise RuntimeError(f"cudaGraphUpload: {err}")
        return up, "cuda.bindings"
    except Exception:
        pass
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "libcudart.so" in path:
            lib = ctypes.CDLL(path)

            def up(graph, stream, lib=lib):
                rc = lib.cudaGraphUpload(ctypes.c_void_p(graph.raw_cuda_graph_exec()),
                                         ctypes.c_void_p(stream.cuda_stream))
                if rc != 0:
                    raise RuntimeError(f"cudaGraphUpload rc={rc}")
            return up, path
    return None, "no cudaGraphUpload found"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("replay_warmup: needs a CUDA GPU", file=sys.stderr)
        return 2
    from mla_tune.families import Candidate
    from mla_tune.families.flashinfer import FlashInferFamily
    from mla_tune.measure import timing
    from mla_tune.problem.instance import make_problem
    from mla_tune.problem.workload import model_preset, workload_for
    torch.cuda.init()
    upload, how = _graph_upload()
    dev = torch.device("cuda")
    buf = timing.flush_buffer(dev)
    fam = FlashInferFamily()
    ratios: dict = {}          # (variant, replay, run) -> [ratio]
    lines = [f"# replay warm-up on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
             f"graph upload via {how}"]
    for heads, batch, ctx in SHAPES:
        tp = 128 // heads
        w = workload_for(model_preset("deepseek-v3"), tp, batch, ctx)
        problem = make_problem(w, 64, "cuda", seed=0, min_pool_bytes=timing.default_pool_bytes())
        prepared = fam.prepare(w, Candidate("flashinfer", "fa3", 64), problem)
        for _ in range(3):
            prepared.run()
        torch.cuda.synchronize()
        for rep in range(args.reps):
            for variant in VARIANTS:
                if "upload" in variant and upload is None:
                    continue
                events = [(torch.cuda.Event(enable_timing=True, external=True),
                           torch.cuda.Event(enable_timing=True, external=True)) for _ in range(RUNS)]
                graph = torch.cuda.CUDAGraph()
                side = timing.capture_stream(dev)
                with timing.capturing(graph, dev):
                    if variant.startswith("lead"):
                        buf.zero_()
                        prepared.run()
                    for s, e in events:
                        buf.zero_()
                        s.record()
                        prepared.run()
                        e.record()
                if "upload" in variant:
                    upload(graph, side)
                    torch.cuda.synchronize()
                timing.warm_up([_Sync()], min_s=0.03, fill=buf.zero_)
                per = []
                for _ in range(3):
                    graph.replay()
                    torch.cuda.synchronize()
                    per.append([s.elapsed_time(e) * 1e3 for s, e in events])
                ref = statistics.median(per[2][4:])
                for r, runs in enumerate(per):
                    for i, x in enumerate(runs):
                        ratios.setdefault((variant, r, i), []).append(x / ref)
                del graph
        lines.append(f"H{heads} B{batch} L{ctx}: reference median {ref:.1f} us (last variant)")
    out = {}
    for variant in VARIANTS:
        for r in range(3):
            cells = []
            for i in range(RUNS):
                xs = sorted(ratios.get((variant, r, i), []))
                if not xs:
                    continue
                med, p90 = xs[len(xs) // 2], xs[(9 * len(xs)) // 10]
                out[f"{variant} replay{r} run{i}"] = {"median": med, "p90": p90, "n": len(xs)}
                cells.append(f"{i}:{med:.3f}/{p90:.3f}")
            if cells:
                lines.append(f"{variant:12s} replay {r}: " + " ".join(cells))
    text = "\n".join(lines)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "replay_warmup_h200.txt").write_text(text + "\n")
    Path(args.out, "replay_warmup_h200.json").write_text(json.dumps(out, indent=1))
    return 0


class _Sync:
    cuda = True

    def _sync(self):
        import torch
        torch.cuda.synchronize()


if __name__ == "__main__":
    raise SystemExit(main())
