"""The best p50 TPOT ratio against vLLM's own server (FLASH_ATTN_MLA) that any measured decode
kernel allows (issue 51's goal: tuned / vLLM's own <= 0.90 geomean at 16 heads).

Only attention differs between the two servers' decode steps, so with attention a share `a` of
vLLM's own step and the served kernel `s` times faster than vLLM's FA3-MLA on that step's bucket,
the step takes 1 - a * (1 - 1/s) of vLLM's time. The kernel side comes from a
`bench/tuned_vs_auto.py` run (one GPU, one process, every kernel on the same buckets): per bucket
the fastest of every kernel it timed (the tuned config's, FlashInfer's auto, vLLM's Triton MLA,
vLLM's FA3-MLA) over FA3-MLA. That is optimistic (the minimum of noisy medians is biased low).
The share comes from the serving benchmark's torch profiles (`serve_bench.py --profile`, given
with --share); the bound is also given at a share of 100%, where the kernels alone decide.

    python3 bench/experiments/serve_tpot_bound.py bench/results/tuned_vs_auto_h100.json \
        --share 0.39 --heads 16 --goal 0.90
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def best_over_fa3(rows, heads: int) -> list[tuple[str, float]]:
    """Per bucket of `heads` heads with a FA3-MLA time: FA3-MLA's time over the fastest kernel's."""
    out = []
    for r in rows:
        if r["heads"] != heads or r.get("fa3_status") != "ok" or not r.get("fa3_us"):
            continue
        times = [r[k] for k in ("tuned_us", "auto_us", "vllm_us", "fa3_us")
                 if r.get(k) and r.get(k.replace("_us", "_status")) == "ok"]
        out.append((r["workload"], r["fa3_us"] / min(times)))
    return out


def tpot_ratio(share: float, speedup: float) -> float:
    return 1 - share * (1 - 1 / speedup)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tuned_vs_auto_json")
    ap.add_argument("--share", type=float, action="append", required=True,
                    help="attention's share of vLLM's own decode step (from a profile); repeatable")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--goal", type=float, default=0.90)
    args = ap.parse_args()
    data = json.load(open(args.tuned_vs_auto_json))
    speedups = best_over_fa3(data["rows"], args.heads)
    if not speedups:
        print(f"no {args.heads}-head bucket with a FA3-MLA time in {args.tuned_vs_auto_json}",
              file=sys.stderr)
        return 2
    s = [x for _, x in speedups]
    g = geomean(s)
    print(f"# The TPOT bound at {args.heads} heads ({args.tuned_vs_auto_json})\n")
    print(f"{len(s)} buckets. The fastest measured kernel over vLLM's FA3-MLA, per bucket: "
          f"geomean {g:.3f}x, min {min(s):.3f}x, max {max(s):.3f}x.\n")
    print("| attention share of vLLM's own step | best TPOT ratio (geomean over buckets) | "
          f"best TPOT ratio (the best bucket) | goal <= {args.goal} |")
    print("|---|---|---|---|")
    for a in [*args.share, 1.0]:
        geo = geomean([tpot_ratio(a, x) for x in s])
        best = tpot_ratio(a, max(s))
        print(f"| {a:.0%} | {geo:.3f} | {best:.3f} | {'reachable' if geo <= args.goal else 'out of reach'} |")
    need = {a: 1 / (1 - (1 - args.goal) / a) if a > 1 - args.goal else math.inf for a in args.share}
    print()
    for a, n in need.items():
        print(f"- at a share of {a:.0%}, the goal needs every step's kernel {n:.2f}x faster than "
              "FA3-MLA" if math.isfinite(n) else f"- at a share of {a:.0%} no kernel reaches the goal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
