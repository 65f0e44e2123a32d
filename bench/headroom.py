"""How far tuning can go: per decode bucket, the fastest candidate a sweep measured against
FlashInfer's default (fa3 at page 64, the run's own timer), from results DBs (no GPU).

    python3 bench/headroom.py --db results.db [--run N] [--extra-db OTHER.db ...] [--out bench/results]

The fastest measured median per bucket is what a perfect verdict could serve from the measured
search space (an optimistic bound: the minimum of noisy medians is biased low, and the sweep's
verdict only leaves the default for a significant >= 1.05x win). `--extra-db` adds the buckets'
best from other runs (e.g. the FlashMLA sweep): each DB's candidates are compared only with the
default of the same run, and a bucket's bound is the best ratio any run reached. The bounds are set
against #15's goals: 1.10x geomean over the default, small work (B x L <= 8K tokens) <= 12 us,
16 heads >= 90% of copy bandwidth from 256K KV tokens. Writes <out>/headroom_<device>.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sqlite3
import statistics
import sys
from pathlib import Path

DEFAULT = "flashinfer/fa3/p64"
GOALS = {"geomean": 1.10, "small_us": 12.0, "h16_copy_pct": 90.0}


def newest_decode_run(db) -> int | None:
    row = db.execute("select max(t.run_id) from trials t join workloads w on w.id = t.workload_id "
                     "where w.q_len = 1 and t.candidate = ? and t.status = 'ok'", (DEFAULT,)).fetchone()
    return row[0] if row else None


def bucket_bests(db, run: int) -> dict[tuple, dict]:
    """(heads, batch, context, lengths) -> default and fastest median kernel time of one run."""
    samples = collections.defaultdict(list)
    for tid, v in db.execute("select s.trial_id, s.value from samples s join trials t on t.id = s.trial_id "
                             "where t.run_id = ? and s.metric = 'kernel_us'", (run,)):
        samples[tid].append(v)
    out: dict[tuple, dict] = {}
    for tid, cand, h, b, ctx, lengths, nbytes in db.execute(
            "select t.id, t.candidate, w.num_heads, w.batch_size, w.context_len, w.ragged, w.bytes "
            "from trials t join workloads w on w.id = t.workload_id "
            "where t.run_id = ? and t.status = 'ok' and w.q_len = 1", (run,)):
        if not samples.get(tid):
            continue
        m = statistics.median(samples[tid])
        out.setdefault((h, b, ctx, lengths or "uniform"), {"bytes": nbytes, "all": {}})["all"][cand] = m
    for d in out.values():
        d["best"] = min(((m, cand) for cand, m in d["all"].items()), key=lambda mc: (mc[0], mc[1] != DEFAULT))
        if DEFAULT in d["all"]:
            d["default"] = d["all"][DEFAULT]
    return {k: d for k, d in out.items() if "default" in d}


def geomean(xs: list[float]) -> float:
    return statistics.geometric_mean(xs) if xs else math.nan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default="results.db")
    ap.add_argument("--run", type=int, help="run of --db (default: its newest decode sweep)")
    ap.add_argument("--extra-db", action="append", default=[], help="another results DB; its newest decode run")
    ap.add_argument("--tuned-vs-auto", help="bench/tuned_vs_auto.py's JSON: adds the bound against FlashInfer "
                    "`auto` (its public plan), as auto/tuned there times tuned/fastest in --db's run")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    sources = []
    for i, path in enumerate([args.db, *args.extra_db]):
        if not Path(path).is_file():
            print(f"error: {path} is not a file", file=sys.stderr)
            return 2
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            run = args.run if (i == 0 and args.run) else newest_decode_run(db)
            row = db.execute("select device_name, started_at, copy_gbps from runs where id = ?", (run,)).fetchone()
        except sqlite3.DatabaseError as e:
            print(f"error: {path} is not a results DB ({e})", file=sys.stderr)
            return 2
        if run is None or row is None:
            print(f"error: {path} holds no decode run with {DEFAULT} measured", file=sys.stderr)
            return 2
        bests = bucket_bests(db, run)
        if not bests:
            print(f"error: run {run} of {path} has no decode bucket with {DEFAULT} measured", file=sys.stderr)
            return 2
        sources.append({"path": path, "run": run, "device": row[0], "started": row[1], "copy_gbps": row[2],
                        "bests": bests})
    vs_auto = {}
    if args.tuned_vs_auto:
        try:
            doc = json.loads(Path(args.tuned_vs_auto).read_text())
            vs_auto = {(r["heads"], r["batch"], r["context"], r["lengths"]): r for r in doc["rows"]
                       if r.get("tuned_us") and r.get("auto_us")}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"error: {args.tuned_vs_auto} is not bench/tuned_vs_auto.py's JSON ({e})", file=sys.stderr)
            return 2
    main_src = sources[0]
    if any(s["device"] != main_src["device"] for s in sources):
        print("error: the DBs were measured on different devices: "
              + ", ".join(f"{s['path']}: {s['device']}" for s in sources), file=sys.stderr)
        return 2

    rows = []
    for key, d in sorted(main_src["bests"].items()):
        ratio, cand, src = d["default"] / d["best"][0], d["best"][1], main_src["path"]
        for s in sources[1:]:
            e = s["bests"].get(key)
            if e and e["default"] / e["best"][0] > ratio:
                ratio, cand, src = e["default"] / e["best"][0], e["best"][1], s["path"]
        best_us = d["default"] / ratio
        copy_pct = (100 * d["bytes"] / (best_us * 1e-6) / (main_src["copy_gbps"] * 1e9)
                    if main_src["copy_gbps"] else None)
        a = vs_auto.get(key)
        tuned_here = d["all"].get(a["tuned"]) if a else None
        rows.append({"key": key, "default": d["default"], "best_us": best_us, "ratio": ratio,
                     "candidate": cand, "source": src, "copy_pct": copy_pct,
                     "over_auto": (a["auto_us"] / a["tuned_us"]) * (tuned_here / best_us) if tuned_here else None,
                     "tuned_over_auto": a["auto_us"] / a["tuned_us"] if a else None})

    def name(k):
        h, b, ctx, lengths = k
        return f"H{h} B{b} L{ctx}" + ("" if lengths == "uniform" else f" {lengths}")

    groups = {"all": rows, "uniform": [r for r in rows if r["key"][3] == "uniform"],
              "ragged": [r for r in rows if r["key"][3] != "uniform"],
              **{f"{h} heads": [r for r in rows if r["key"][0] == h] for h in sorted({r["key"][0] for r in rows})}}
    small = [r for r in rows if r["key"][1] * r["key"][2] <= 8192]
    big16 = [r for r in rows if r["key"][0] == 16 and r["key"][1] * r["key"][2] >= 262144 and r["copy_pct"]]
    srcs = "; ".join(f"`{s['path']}` run {s['run']} ({s['started']}, {len(s['bests'])} buckets)" for s in sources)
    lines = [f"# Tuning headroom: the fastest measured candidate vs FlashInfer's default ({main_src['device']})", "",
             f"`python3 bench/headroom.py --db {args.db}"
             + (f" --run {args.run}" if args.run else "")
             + "".join(f" --extra-db {p}" for p in args.extra_db) + "`", "",
             f"From {srcs}. Per decode bucket: the default ({DEFAULT}, FlashInfer's own chunking) and the "
             "fastest correct candidate's median kernel time in the same run (CUDA-graph replays, cold L2, "
             "the sweep's timer). This bounds what any verdict over the measured search space can serve; "
             "the bound is optimistic (the minimum of noisy medians is biased low).", "",
             "| group | buckets | fastest measured / default (geomean) | goal |", "|---|---|---|---|"]
    auto_cols = bool(vs_auto)
    if auto_cols:
        lines[-2:] = ["| group | buckets | fastest measured / default (geomean) | tuned vs auto, measured | "
                      "fastest measured vs auto, estimated | goal |", "|---|---|---|---|---|---|"]
    for g, rs in groups.items():
        if rs:
            cells = [f"{geomean([r['ratio'] for r in rs]):.3f}x"]
            if auto_cols:
                ta = [r["tuned_over_auto"] for r in rs if r["tuned_over_auto"]]
                oa = [r["over_auto"] for r in rs if r["over_auto"]]
                cells += [f"{geomean(ta):.3f}x ({len(ta)})", f"{geomean(oa):.3f}x ({len(oa)})"]
            lines.append(f"| {g} | {len(rs)} | " + " | ".join(cells)
                         + (f" | >= {GOALS['geomean']:.2f}x |" if g == "all" else " | |"))
    if small:
        us = [r["best_us"] for r in small]
        lines += ["", f"Small work (B x L <= 8192 tokens, {len(small)} buckets): fastest measured "
                  f"{min(us):.1f}-{max(us):.1f} us (median {statistics.median(us):.1f}); "
                  f"{sum(u <= GOALS['small_us'] for u in us)} at <= {GOALS['small_us']:.0f} us (goal: all)."]
    if big16:
        pct = sorted(big16, key=lambda r: r["copy_pct"])
        lines += ["", f"16 heads from 256K KV tokens ({len(big16)} buckets, copy {main_src['copy_gbps']:.0f} GB/s "
                  f"from run {main_src['run']}): fastest measured {pct[0]['copy_pct']:.0f}-{pct[-1]['copy_pct']:.0f}% "
                  f"of copy bandwidth; {sum(r['copy_pct'] >= GOALS['h16_copy_pct'] for r in big16)} at >= "
                  f"{GOALS['h16_copy_pct']:.0f}% (goal: all); below: "
                  + (", ".join(f"{name(r['key'])} {r['copy_pct']:.0f}%" for r in pct
                               if r["copy_pct"] < GOALS["h16_copy_pct"]) or "none") + "."]
    header = "| bucket | default us | fastest us | fastest / default | " + (
        "tuned vs auto | fastest vs auto (est.) | " if auto_cols else "") + "fastest candidate | from |"
    lines += ["", header, "|---" * header.count(" | ") + "|---|"]
    for r in rows:
        est = ([f"{r['tuned_over_auto']:.3f}" if r["tuned_over_auto"] else "",
                f"{r['over_auto']:.3f}" if r["over_auto"] else ""] if auto_cols else [])
        lines.append(" | ".join([f"| {name(r['key'])}", f"{r['default']:.1f}", f"{r['best_us']:.1f}",
                                 f"{r['ratio']:.3f}", *est, r["candidate"], f"{r['source']} |"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"headroom_{main_src['device'].lower().replace('nvidia ', '').replace(' ', '_')}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:lines.index(header) - 1]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
