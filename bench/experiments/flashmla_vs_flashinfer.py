"""FlashMLA vs FlashInfer per bucket, from a results DB the sweep wrote with both families
(`bench/tools/h200_flashmla.sh`): per bucket the median kernel time of flashmla/flashmla/p64, of
FlashInfer's untuned default (fa3 at page 64 on Hopper) and of the fastest valid FlashInfer
candidate at page 64; geomeans per head count and length distribution.

    python3 bench/experiments/flashmla_vs_flashinfer.py bench/results/flashmla_vs_flashinfer_h200.db > bench/results/flashmla_vs_flashinfer_h200.md
"""

from __future__ import annotations

import math
import sqlite3
import statistics
import sys
from collections import defaultdict


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main(db: str) -> int:
    c = sqlite3.connect(db)
    rows = c.execute("""
        select w.num_heads, w.batch_size, w.context_len, w.ragged, t.family, t.candidate, t.status,
               t.is_default, t.max_rel_error, t.invalid_reason, t.id
        from trials t join workloads w on w.id = t.workload_id
        where t.page_size = 64 and w.q_len = 1 and w.ragged in ('uniform', 'zipf')""").fetchall()
    med = {tid: statistics.median(v for (v,) in c.execute(
        "select value from samples where trial_id = ? and metric = 'kernel_us'", (tid,)))
        for *_, status, _d, _e, _r, tid in rows if status == "ok"}
    buckets = defaultdict(dict)
    for h, b, l, rg, fam, cand, status, dflt, err, why, tid in rows:
        d = buckets[(h, rg, b, l)]
        if fam == "flashmla":
            d["fm"] = med.get(tid) if status == "ok" else None
            d["fm_err"], d["fm_why"] = err, why
        elif fam == "flashinfer" and status == "ok":
            if dflt:
                d["fi_default"] = med[tid]
            if med[tid] < d.get("fi_best", math.inf):
                d["fi_best"], d["fi_best_key"] = med[tid], cand
    run = c.execute("select device_name, torch, flashinfer, started_at from runs order by id desc limit 1").fetchone()
    print(f"# FlashMLA (vLLM 0.33.0's _flashmla_C) vs FlashInfer MLA on {run[0]}\n")
    print(f"From `{db}`: `mla-tune sweep --family flashinfer --family flashmla` over the default "
          f"buckets (bench/tools/h200_flashmla.sh), run {run[3]}, torch {run[1]}, flashinfer {run[2]}. Median "
          "kernel time per call (CUDA-graph replays, cold L2, the sweep's timer), page 64. "
          "`fi default` = FlashInfer's untuned fa3, `fi best` = the fastest valid FlashInfer candidate "
          "(kv_chunk variants included); ratio > 1: FlashMLA faster.\n")
    print("| heads | lengths | B | L | flashmla us | fi default us | fi best us | fi best | default/flashmla | best/flashmla |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    groups = defaultdict(lambda: ([], []))
    invalid = []
    for (h, rg, b, l), d in sorted(buckets.items()):
        fm = d.get("fm")
        if fm is None:
            invalid.append(f"H{h} {rg} B{b} L{l}: {d.get('fm_why')}")
            continue
        r_def = d["fi_default"] / fm if "fi_default" in d else None
        r_best = d["fi_best"] / fm if "fi_best" in d else None
        print(f"| {h} | {rg} | {b} | {l} | {fm:.1f} | {d.get('fi_default', float('nan')):.1f} | "
              f"{d.get('fi_best', float('nan')):.1f} | {d.get('fi_best_key', '').replace('flashinfer/', '')} | "
              f"{r_def:.3f} | {r_best:.3f} |")
        for key in (("all",), (f"H{h}",), (rg,)):
            if r_def and r_best:
                groups[key][0].append(r_def)
                groups[key][1].append(r_best)
    print("\n| group | buckets | FlashInfer default / FlashMLA (geomean) | FlashInfer best / FlashMLA (geomean) | buckets FlashMLA faster than fi best |")
    print("|---|---|---|---|---|")
    for key, (rd, rb) in sorted(groups.items()):
        print(f"| {key[0]} | {len(rd)} | {geomean(rd):.3f} | {geomean(rb):.3f} | {sum(r > 1 for r in rb)} |")
    if invalid:
        print("\nFlashMLA invalid in " + str(len(invalid)) + " buckets: " + "; ".join(invalid[:10]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
