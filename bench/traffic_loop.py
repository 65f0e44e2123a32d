"""Issue 54's loop, judged: a server's p50 TPOT with the shipped config (recording its traffic)
against the same workload served with the config re-tuned for that traffic, beside what
`mla-tune report --traffic` predicted for the change. `bench/tools/traffic_loop.sh` runs the loop
on a lent GPU and calls this at the end; it runs anywhere on its files (CPU).

    python3 bench/traffic_loop.py --before B/serve_bench.json --after A/serve_bench.json \
        --report-before RB.json --report-after RA.json [--out DIR]

Per workload-rate cell: the p50 TPOT median over the repeats before and after, after/before, and
whether the change is beyond noise (serve_bench's rule: one-sided Mann-Whitney over the repeats'
p50 TPOTs, p < 0.1, and medians 5% apart). The prediction is the expected per-step attention time
(one layer call) of the re-tuned config over the shipped one's on the recorded traffic; a TPOT
also holds everything that is not attention, so the predicted TPOT change is that ratio applied
to attention's share of a step, which this comparison takes from --attention-share (a profile's
number, e.g. serve_bench --profile's; without it only the attention ratio is shown).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402  (bench/ is not a package)


def _rec(run: dict, setup: str = "tuned") -> dict:
    """The one record of `setup` in a serve_bench.json (any model)."""
    recs = [r for k, r in run.get("runs", {}).items() if k.endswith(f"/{setup}")]
    if len(recs) != 1:
        raise SystemExit(f"expected one {setup!r} server in the file, found {len(recs)}")
    return recs[0]


def compare(before: dict, after: dict, report_before: dict | None = None,
            report_after: dict | None = None, attention_share: float | None = None) -> dict:
    """The loop's numbers: per cell before/after TPOT medians, their ratio and verdict; the
    predicted attention ratio (and TPOT ratio with `attention_share`)."""
    b, a = _rec(before), _rec(after)
    cells = []
    for cell in sorted(set(b.get("runs", {})) & set(a.get("runs", {}))):
        tb, ta = sb.tpots(b, cell), sb.tpots(a, cell)
        if not tb or not ta:
            continue
        mb, ma = statistics.median(tb), statistics.median(ta)
        verdict = ("faster" if sb.beyond_noise(tb, ta) else "slower" if sb.beyond_noise(ta, tb)
                   else "within noise")
        cells.append({"cell": cell, "before_ms": tb, "after_ms": ta, "before_p50": mb,
                      "after_p50": ma, "ratio": ma / mb, "verdict": verdict})
    out = {"cells": cells}
    if report_before and report_after and report_before.get("tuned_us") and report_after.get("tuned_us"):
        att = report_after["tuned_us"] / report_before["tuned_us"]
        out["predicted_attention_ratio"] = att
        if attention_share is not None:
            out["predicted_tpot_ratio"] = 1 - attention_share + attention_share * att
        out["far_share_before"] = report_before.get("far_share")
        out["far_share_after"] = report_after.get("far_share")
    return out


def render(result: dict) -> str:
    lines = ["| cell | p50 TPOT before (ms) | after (ms) | after/before | verdict |",
             "| --- | --- | --- | --- | --- |"]
    for c in result["cells"]:
        rng = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}" if len(xs) > 1 else ""   # noqa: E731
        lines.append(f"| {c['cell']} | {c['before_p50']:.3f} {rng(c['before_ms'])} | "
                     f"{c['after_p50']:.3f} {rng(c['after_ms'])} | {c['ratio']:.3f} | {c['verdict']} |")
    if "predicted_attention_ratio" in result:
        lines.append("")
        lines.append(f"predicted by `report --traffic`: attention per step after/before "
                     f"{result['predicted_attention_ratio']:.3f}"
                     + (f", p50 TPOT {result['predicted_tpot_ratio']:.3f} (attention share given)"
                        if "predicted_tpot_ratio" in result else "")
                     + f"; steps outside or far from the tuned buckets: "
                       f"{100 * (result.get('far_share_before') or 0):.1f}% before, "
                       f"{100 * (result.get('far_share_after') or 0):.1f}% after")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="serve_bench.json, shipped config")
    ap.add_argument("--after", type=Path, required=True, help="serve_bench.json, re-tuned config")
    ap.add_argument("--report-before", type=Path, help="report --traffic --format json, shipped")
    ap.add_argument("--report-after", type=Path, help="report --traffic --format json, re-tuned")
    ap.add_argument("--attention-share", type=float, default=None,
                    help="attention's share of a decode step (0-1), from a profile")
    ap.add_argument("--out", type=Path, default=None, help="folder for traffic_loop.{json,md}")
    args = ap.parse_args()
    load = lambda p: json.loads(p.read_text()) if p else None   # noqa: E731
    result = compare(load(args.before), load(args.after), load(args.report_before),
                     load(args.report_after), args.attention_share)
    text = render(result)
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "traffic_loop.json").write_text(json.dumps(result, indent=1))
        (args.out / "traffic_loop.md").write_text(text)


if __name__ == "__main__":
    main()
