"""The sweep's own overhead on the CPU: a live sweep (worker process, optuna journal, results.db)
over a stand-in family with the H200 default space's candidate structure, so what the sweep
machinery costs per bucket and per trial can be compared between two checkouts without a GPU.

The stand-in ("gpulike") declares what FlashInfer and Triton declare on an H200: 8 FlashInfer-like
backends x 3 page sizes, of which 6 refuse the device (as cutlass, cutile, trtllm-gen, xqa and the
cute-dsl pair refuse SM90), and 9 Triton-like split counts x 3 page sizes, page 1 refused (as
TRITON_MLA refuses KV blocks that are not multiples of 16). A valid candidate's run() copies the
reference output (microseconds), so the wall is the sweep's machinery, the correctness gate and
the CPU reference, not a kernel.

    PYTHONPATH=<checkout> python bench/sweep_overhead.py [--batches 1,2,4] [--contexts 64,128,256,512]

Prints one line: wall, buckets, trials measured, refusals measured, and the sweep's `time:` split
(its timed samples are the copies' wall-clock). Measured 2026-12-03 on the shared 2-core CPU box,
12 buckets, samples 20, old = 132b857 (the parent of this work), new = s4-sweep: the trial count
is exact, 585 (297 of them refusals of the same 27 candidates) before vs 315 (27 refusals) after;
the wall is at the mercy of the box's load (two other engineers' test suites): 14.1 s vs 9.4 s
lightly loaded, 193.0 s vs 88.5 s heavily loaded, and alternating runs later 35.9 / 70.7 s (old)
vs 45.3 / 33.1 s (new). On the CPU a trial's worker side is the torch reference (twice per
candidate here, in prepare and gate), which says nothing of the GPU's fixed costs (clock warm-up,
correctness instances, discarded graph samples) that this work removed; those show only in the
H200 run's `time:` line (bench/tools/h200_sweep.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):        # PYTHONPATH=<checkout> measures that checkout
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

FLASHINFER_LIKE = ("fa2", "fa3", "cutlass", "cutile", "trtllm-gen", "xqa", "cute-dsl-monolithic",
                   "cute-dsl-modular")
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class GpuLike:
    """The stand-in family (module-level, so the worker process can import it by name)."""

    family = "gpulike"

    def available(self, device):
        from mla_tune.families.base import Availability
        return Availability(True)

    def space(self, workload, page_sizes):
        from mla_tune.families.base import Candidate
        out = [Candidate(self.family, b, p) for b in FLASHINFER_LIKE for p in page_sizes]
        out += [Candidate(self.family, "triton", p, {"num_kv_splits": s}) for s in SPLITS
                for p in page_sizes]
        return out

    def default_candidate(self, workload, page_size):
        from mla_tune.families.base import Candidate
        return Candidate(self.family, "fa3", page_size)

    def prepare(self, workload, candidate, problem):
        import torch
        from mla_tune.families.base import CandidateInvalid, Prepared
        from mla_tune.problem.reference import mla_decode_reference
        if candidate.backend not in ("fa2", "fa3", "triton"):
            raise CandidateInvalid("unsupported", f"{candidate.backend} refuses this device")
        from vllm_metax.core.choices import SPECS, TRITON
        page = SPECS[TRITON].page         # the Triton kernel's page rule, as its family refuses
        if candidate.backend == "triton" and not page.allows(candidate.page_size):
            raise CandidateInvalid("unsupported", f"KV block sizes must be {page}")
        ref = mla_decode_reference(problem.q_nope, problem.q_pe, problem.ckv_cache,
                                   problem.kpe_cache, problem.block_table, problem.seq_lens_cpu,
                                   workload.softmax_scale, workload.q_len)
        out = torch.empty_like(ref)

        def run():
            out.copy_(ref)
            return out

        return Prepared(run=run, plan=None, out=out, compile_s=0.0, graphable=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--contexts", default="64,128,256,512")
    ap.add_argument("--samples", type=int, default=20)
    args = ap.parse_args()
    from mla_tune.families import register_family
    from mla_tune.tune.sweep.run import run_sweep
    from mla_tune.tune.sweep.request import SweepRequest
    # the worker process imports the stand-in by name: bench/ (and the checkout) on its path
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent)] + [p for p in sys.path if p])
    register_family("gpulike", "sweep_overhead:GpuLike")
    with tempfile.TemporaryDirectory() as d:
        cfg = SweepRequest(model="deepseek-v3", tp=[8], batches=args.batches,
                           contexts=args.contexts, device="cpu", family=["gpulike"],
                           db=Path(d) / "r.db", samples=args.samples, emit=False,
                           isolation="process").config()
        t = time.monotonic()
        out = run_sweep(cfg)
        wall = time.monotonic() - t
    refused = sum(e.reason == "unsupported" for b in out.buckets for e in b.search.evaluations
                  if not e.cached)
    line = getattr(out, "time_line", lambda: "")()
    print(f"wall {wall:.1f} s, {len(out.buckets)} buckets, {out.measured} trials measured, "
          f"{refused} refusals measured" + (f"; {line}" if line else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
