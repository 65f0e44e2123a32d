"""How many trials TPE needs against the exhaustive grid on a large search space (replay, no GPU).

The space is synthetic and says so in every row it writes (device "synthetic landscape", run kind
"synthetic"): a Triton-like split-KV kernel with four knobs (num_kv_splits 1-256, block_n,
num_warps, page size: 432 points per bucket) beside three FlashInfer-like backends (12 points).
Its times follow a roofline-shaped model (work over the parallelism the splits buy, a stage-2
cost per split, a launch floor, small knob factors) with 2% lognormal sample noise. No GPU
number is invented here: the point is the search, which `mla-tune sweep --replay` runs exactly
as it runs over a real results.db.

    python bench/experiments/tpe_vs_grid.py [--seeds 5] [--out bench/results/tpe_vs_grid.json]

For every bucket it replays the grid (every point) and TPE (default budget: a quarter of the
space, patience 24) over the same stored samples and reports, per TPE seed: trials spent, the
trial at which TPE first evaluated the grid's winner, and the chosen time's excess over the
grid's choice.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's mla_tune, as the other scripts

from mla_tune.families.base import Candidate  # noqa: E402
from mla_tune.problem.defaults import KERNEL_METRIC  # noqa: E402
from mla_tune.problem.workload import model_preset, workload_for  # noqa: E402
from mla_tune.problem.roofline import workload_bytes, workload_flops  # noqa: E402
from mla_tune.store.results import ResultsStore  # noqa: E402

DEVICE = "synthetic landscape"
SMS = 132
SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BLOCK_N = {16: 1.12, 32: 1.0, 64: 0.96, 128: 1.07}
WARPS = {2: 1.06, 4: 1.0, 8: 1.02}
PAGES = {16: 1.0, 32: 0.995, 64: 1.0, 128: 1.012}
FLASHINFER = {"auto": 1.35, "fa3": 1.3, "fa2": 1.8}   # x the best split-KV point
NOISE = 0.02
SAMPLES = 10


def triton_us(batch: int, context: int, heads: int, splits: int, block_n: int, warps: int,
              page: int) -> float:
    """Modelled time of the split-KV kernel: work / usable parallelism + stage 2 + floor."""
    work = batch * context * heads * 2.2e-5                  # us of perfectly parallel work
    ctas = batch * math.ceil(heads / 16) * splits
    eff = min(1.0, ctas / (2 * SMS)) ** 0.85
    tokens_per_split = context / splits
    if tokens_per_split < 32:                                # splits finer than one tile: waste
        eff *= tokens_per_split / 32
    stage2 = 0.004 * batch * heads * splits
    bn = BLOCK_N[block_n] if block_n != 64 or context >= 4096 else 1.04
    return (work / max(eff, 1e-3) + stage2 + 9.0) * bn * WARPS[warps] * PAGES[page]


def default_splits(context: int) -> int:
    return max(1, min(256, 1 << max(0, math.ceil(math.log2(max(1, context // 512))))))


def landscape(batch: int, context: int, heads: int) -> dict:
    """candidate -> modelled median time (us), and which candidates are the family defaults."""
    out = {}
    for s in SPLITS:
        if s > context // 16:
            continue
        for bn in BLOCK_N:
            for w in WARPS:
                for p in PAGES:
                    c = Candidate("synth", "triton", p, {"num_kv_splits": s, "block_n": bn, "num_warps": w})
                    out[c] = triton_us(batch, context, heads, s, bn, w, p)
    best_triton = min(out.values())
    for b, f in FLASHINFER.items():
        for p in (16, 64):
            out[Candidate("synthfi", b, p)] = best_triton * f * (1.0 if p == 64 else 1.004)
    defaults = {Candidate("synth", "triton", p, {"num_kv_splits": default_splits(context),
                                                 "block_n": 32, "num_warps": 4}) for p in PAGES}
    defaults |= {Candidate("synthfi", "auto", p) for p in (16, 64)}
    return {"times": out, "defaults": defaults}


BUCKETS = [(b, c) for b in (1, 8, 64) for c in (1024, 8192, 32768)]


def build_landscape_db(path: str | Path, buckets=BUCKETS, tp: int = 8, seed: int = 0) -> dict:
    """Write the synthetic landscape as trials (10 noisy samples each); returns bucket -> size."""
    rng = random.Random(seed)
    model = model_preset("deepseek-v3")
    sizes = {}
    with ResultsStore(path) as store:
        run = store.add_run({"kind": "synthetic", "device_name": DEVICE, "host": "bench",
                             "command": "bench/experiments/tpe_vs_grid.py (modelled times, not measurements)"})
        for b, c in buckets:
            w = workload_for(model, tp, b, c)
            wid = store.workload_id(w, workload_bytes(w), workload_flops(w))
            land = landscape(b, c, w.num_heads)
            sizes[(b, c)] = len(land["times"])
            for cand, t in land["times"].items():
                samples = [t * math.exp(rng.gauss(0.0, NOISE)) for _ in range(SAMPLES)]
                store.add_trial(run, wid, cand, "ok", {KERNEL_METRIC: samples}, sweep="synthetic",
                                is_default=cand in land["defaults"])
    return sizes


def compare(path: str | Path, seeds=(0, 1, 2, 3, 4), **policy) -> list[dict]:
    """Replay grid once and TPE per seed over the DB; one row per (bucket, seed)."""
    from mla_tune.tune.sweep.replay import replay_sweep
    from mla_tune.tune.sweep.config import SweepConfig

    grid = replay_sweep(path, SweepConfig(buckets=[], mode="grid", emit=False))
    grid_by = {(b.bucket.workload.batch_size, b.bucket.workload.context_len): b for b in grid.buckets}
    grid_choice = {(m.num_heads, bk.batch_size, bk.context_len): bk for m in grid.choice.models
                   for bk in m.buckets}
    rows = []
    for seed in seeds:
        tpe = replay_sweep(path, SweepConfig(buckets=[], mode="tpe", seed=seed, emit=False, **policy))
        tpe_choice = {(m.num_heads, bk.batch_size, bk.context_len): bk for m in tpe.choice.models
                      for bk in m.buckets}
        for bo in tpe.buckets:
            w = bo.bucket.workload
            g = grid_by[(w.batch_size, w.context_len)]
            winner = g.search.best.candidate.key
            gk = grid_choice[(w.num_heads, w.batch_size, w.context_len)]
            tk = tpe_choice[(w.num_heads, w.batch_size, w.context_len)]
            rows.append({
                "batch": w.batch_size, "context": w.context_len, "seed": seed,
                "space": bo.search.space_size, "grid_trials": len(g.search.evaluations),
                "tpe_trials": len(bo.search.evaluations), "tpe_stopped": bo.search.stopped,
                "trials_to_grid_best": bo.search.trials_to_reach(winner),
                "best_excess_pct": 100 * (bo.search.best.value / g.search.best.value - 1),
                "chosen_excess_pct": 100 * (tk.time_us / gk.time_us - 1),
                "same_choice": tk.families[tk.best_family].chosen.key
                == gk.families[gk.best_family].chosen.key,
            })
    return rows


def summarize(rows: list[dict]) -> dict:
    reached = [r["trials_to_grid_best"] for r in rows if r["trials_to_grid_best"]]
    return {
        "cases": len(rows),
        "space_mean": statistics.fmean(r["space"] for r in rows),
        "grid_trials_mean": statistics.fmean(r["grid_trials"] for r in rows),
        "tpe_trials_mean": statistics.fmean(r["tpe_trials"] for r in rows),
        "tpe_found_grid_best": f"{len(reached)}/{len(rows)}",
        "trials_to_grid_best_median": statistics.median(reached) if reached else None,
        "best_excess_pct_median": statistics.median(r["best_excess_pct"] for r in rows),
        "best_excess_pct_max": max(r["best_excess_pct"] for r in rows),
        "chosen_excess_pct_max": max(r["chosen_excess_pct"] for r in rows),
        "same_choice": f"{sum(r['same_choice'] for r in rows)}/{len(rows)}",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "tpe_vs_grid.json"))
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "landscape.db"
        t0 = time.time()
        sizes = build_landscape_db(db)
        rows = compare(db, seeds=range(args.seeds))
        s = summarize(rows)
    print(f"synthetic landscape: {len(sizes)} buckets, {min(sizes.values())}-{max(sizes.values())} "
          f"candidates each; TPE seeds: {args.seeds}; {time.time() - t0:.1f} s")
    print(f"{'B':>3} {'L':>6} {'seed':>4} {'space':>5} {'grid':>5} {'tpe':>4} {'to best':>7} "
          f"{'best +%':>7} {'chosen +%':>9} same  stopped")
    for r in rows:
        print(f"{r['batch']:>3} {r['context']:>6} {r['seed']:>4} {r['space']:>5} {r['grid_trials']:>5} "
              f"{r['tpe_trials']:>4} {str(r['trials_to_grid_best'] or '-'):>7} "
              f"{r['best_excess_pct']:>7.2f} {r['chosen_excess_pct']:>9.2f} "
              f"{'yes' if r['same_choice'] else 'no':>4}  {r['tpe_stopped']}")
    print(json.dumps(s, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": s, "rows": rows, "note": "synthetic landscape, replayed; "
                               "not GPU measurements"}, indent=1) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
