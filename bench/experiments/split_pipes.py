"""The split family's pipes side by side, from a results DB (no GPU: it reads what a sweep stored).

    python3 bench/experiments/split_pipes.py --db results.db [--run N] [--out bench/results]

Per decode bucket of the run (default: the newest run with split trials carrying `pipe`): each
pipe's best median kernel time (its split count in brackets) and FlashInfer's best, and which pipe
was fastest. Writes <out>/split_pipes_h200.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import sqlite3
import statistics
import sys
from pathlib import Path

PIPES = ("t64", "t64-pdl", "t32x4", "t32x4-pdl")


def newest_pipe_run(db) -> int | None:
    row = db.execute("select max(run_id) from trials where family='split' and params like '%\"pipe\"%'").fetchone()
    return row[0] if row else None


def table(db, run: int) -> list[dict]:
    med = collections.defaultdict(list)
    for tid, v in db.execute("select s.trial_id, s.value from samples s join trials t on t.id = s.trial_id "
                             "where t.run_id = ? and s.metric = 'kernel_us'", (run,)):
        med[tid].append(v)
    best = collections.defaultdict(dict)
    for h, b, ctx, ragged, fam, params, tid in db.execute(
            "select w.num_heads, w.batch_size, w.context_len, w.ragged, t.family, t.params, t.id from trials t "
            "join workloads w on w.id = t.workload_id where t.run_id = ? and t.status = 'ok' and w.q_len = 1",
            (run,)):
        if tid not in med or fam not in ("flashinfer", "split"):
            continue
        p = json.loads(params) if params else {}
        key = "flashinfer" if fam == "flashinfer" else p.get("pipe", "t64")
        m = statistics.median(med[tid])
        if fam == "split":
            best[(h, ragged, b, ctx)].setdefault("at", {})[(key, p.get("num_splits"))] = m
        if m < best[(h, ragged, b, ctx)].get(key, (float("inf"),))[0]:
            best[(h, ragged, b, ctx)][key] = (m, p.get("num_splits"))
    return [{"heads": h, "lengths": r, "batch": b, "context": c, **d} for (h, r, b, c), d in sorted(best.items())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default="results.db")
    ap.add_argument("--run", type=int)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not Path(args.db).is_file():
        print(f"error: {args.db} is not a file", file=sys.stderr)
        return 2
    db = sqlite3.connect(f"file:{args.db}?mode=ro", uri=True)
    run = args.run or newest_pipe_run(db)
    if run is None:
        print(f"error: {args.db} holds no split trial with a pipe", file=sys.stderr)
        return 2
    device = db.execute("select device_name, started_at from runs where id = ?", (run,)).fetchone()
    rows = table(db, run)
    wins = collections.Counter()
    lines = [f"# Split-kernel pipes side by side ({device[0]}, run {run} of `{args.db}`, {device[1]})", "",
             f"`python3 bench/experiments/split_pipes.py --db {args.db} --run {run}`: per bucket each pipe's best median "
             "kernel time (us; its split count) and FlashInfer's best; `best/fi` is the fastest pipe over "
             "FlashInfer's best (below 1: split is faster).", "",
             "| bucket | flashinfer | " + " | ".join(PIPES) + " | fastest pipe | best/fi |",
             "|---|---|" + "---|" * len(PIPES) + "---|---|"]
    per_token = collections.defaultdict(list)
    for r in rows:
        pipes = {p: r[p] for p in PIPES if p in r}
        if not pipes or "flashinfer" not in r:
            continue
        fastest = min(pipes, key=lambda p: pipes[p][0])
        wins[fastest] += 1
        at = r.get("at", {})
        for pipe, n in at:
            if pipe != "t64" and ("t64", n) in at:
                per_token[(pipe, r["heads"])].append(at[(pipe, n)] / at[("t64", n)])
        cells = [f"{pipes[p][0]:.1f} (S{pipes[p][1]})" if p in pipes else "" for p in PIPES]
        lines.append(f"| H{r['heads']} B{r['batch']} L{r['context']} {r['lengths']} | {r['flashinfer'][0]:.1f} | "
                     + " | ".join(cells) + f" | {fastest} | {pipes[fastest][0] / r['flashinfer'][0]:.2f} |")
    lines += ["", "Fastest pipe per bucket: " + ", ".join(f"{p} {n}" for p, n in wins.most_common()) + "."]
    for (pipe, h), ratios in sorted(per_token.items()):
        lines.append(f"{pipe} / t64 time at {h} heads, same bucket and split count: geomean "
                     f"{statistics.geometric_mean(ratios):.3f}, {min(ratios):.2f}-{max(ratios):.2f}, "
                     f"{len(ratios)} pairs.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "split_pipes_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1 - len(per_token):]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
