"""vLLM's Triton MLA decode (the TRITON_MLA kernel) beside FlashInfer fa3, DeepSeek-V3 TP1 / TP8.

    source .carry/device-env.sh && python3 bench/experiments/triton_vs_flashinfer.py --out $OUT

Per bucket (128 heads = TP1, 16 heads = TP8; batch 1-128; context 1K-32K; page 64) it measures,
in one interleaved set through the tuner's own harness (mla_tune.measure.trial.measure_interleaved:
correctness gate against the torch reference, CUDA-graph replays timed with events, cold L2):

* FlashInfer fa3 (`get_family("flashinfer")`, the plugin's op);
* Triton with vLLM's own num_kv_splits rule (the family's default candidate, `rule=vllm`);
* Triton at every num_kv_splits of the family's space (the tuned best is the fastest of them);
* Triton's default at page 16 (TRITON_MLA takes multiples of 16 only).

It writes <out>/triton_vs_flashinfer.json (every sample), .md (the table and verdict) and .db (a
results store `mla-tune report` reads), and prints the table. "Wins" and "gains" count only when a
one-sided Mann-Whitney test gives p < 0.002 and the median ratio is >= 1.05 (mla_tune.tune.verdict);
where scipy is missing the test is skipped and `--analyze <json>` redoes the summary elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.shape_run import add_shape_run_options, ints, read_earlier_run  # noqa: E402
from mla_tune.families.triton_mla import vllm_compiled_ops_missing  # noqa: E402
from mla_tune.problem.defaults import KERNEL_METRIC  # noqa: E402
from mla_tune.problem.workload import model_preset, workload_for  # noqa: E402

# vLLM's compiled ops are absent where only its Python files were carried (the H200 machine): its
# built-in CUDA platform cannot load there, so the project's platform plugin must be the active one.
if vllm_compiled_ops_missing():
    os.environ.setdefault("VLLM_METAX_FORCE", "1")

V3 = model_preset("deepseek-v3")
NAME = "triton_vs_flashinfer"
FA3 = "flashinfer/fa3"
LOG: list[str] = []


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


# ---------------------------------------------------------------- measuring

def measure_all(args) -> dict:
    import torch

    from mla_tune.families import get_family
    from mla_tune.measure.environment import capture_environment
    from mla_tune.measure.trial import MeasureSettings
    from mla_tune.problem.roofline import workload_bytes, workload_flops
    from mla_tune.measure.timing import default_pool_bytes
    from mla_tune.measure.trial import measure_interleaved

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = capture_environment("gpu", " ".join(sys.argv))
    fi, tr = get_family("flashinfer"), get_family("triton")
    avail = {"flashinfer": fi.available("cuda").__dict__, "triton": tr.available("cuda").__dict__}
    say(f"device {env['device_name']} ({env['sm_count']} SMs), torch {env['torch']}, "
        f"flashinfer {env['flashinfer']}, vllm {env['vllm']}")
    for fam, a in avail.items():
        say(f"  {fam}: {'available' if a['ok'] else 'UNAVAILABLE'} ({a['reason']})")
    doc = {"environment": env, "availability": avail, "settings": vars(args), "rows": [],
           "skipped": [], "log": LOG}
    if not avail["triton"]["ok"] or not avail["flashinfer"]["ok"]:
        return doc

    store = run_id = None
    try:
        from mla_tune.store.results import ResultsStore
        store = ResultsStore(out / f"{NAME}.db")
        run_id = store.add_run({**env, "notes": "bench/experiments/triton_vs_flashinfer.py"})
    except ImportError as e:
        say(f"  (no results DB: {e})")

    settings = MeasureSettings(device="cuda", warmup=args.warmup, samples=args.samples,
                               min_pool_bytes=default_pool_bytes("cuda"), check=True)
    shapes = [(tp, b, L) for L in args.contexts for b in args.batches for tp in args.tp]
    t_start = time.perf_counter()
    for i, (tp, b, L) in enumerate(shapes):
        w = workload_for(V3, tp, b, L)
        if time.perf_counter() - t_start > args.budget_s:
            doc["skipped"].append(w.label())
            continue
        default = tr.default_candidate(w, args.page)
        fa3 = next((c for c in fi.space(w, [args.page]) if c.backend == "fa3"), None)
        entries = ([(fi, fa3)] if fa3 else []) + [(tr, c) for c in tr.space(w, [args.page])]
        if args.page16 and args.page != 16:
            entries.append((tr, tr.default_candidate(w, 16)))
        t0 = time.perf_counter()
        try:
            results = measure_interleaved(entries, w, settings, rounds=args.rounds)
        except Exception as e:  # a shape that cannot even be set up (e.g. OOM) is data too
            say(f"[{i + 1}/{len(shapes)}] {w.label()}: FAILED {type(e).__name__}: {e}")
            doc["skipped"].append(w.label())
            torch.cuda.empty_cache()
            continue
        wid = store.workload_id(w, workload_bytes(w), workload_flops(w)) if store else None
        for r in results:
            c = r.candidate
            is_default = c == default or (c.family == "triton" and c.params.get("rule") == "vllm")
            ks = r.samples.get(KERNEL_METRIC, []) if r.status == "ok" else []
            doc["rows"].append({
                "heads": w.num_heads, "tp": tp, "batch": b, "context": L, "workload": w.label(),
                "family": c.family, "backend": c.backend, "page_size": c.page_size, "params": c.params,
                "candidate": c.key, "is_default": bool(is_default), "status": r.status,
                "invalid_reason": r.invalid_reason, "message": (r.message or "")[:400],
                "compile_s": r.compile_s, "max_rel_error": r.max_rel_error,
                "method": getattr(r.samples, "method", None), "median_us": statistics.median(ks) if ks else None,
                "kernel_us": ks,
            })
            if store:
                store.add_trial(run_id, wid, c, r.status, dict(r.samples) if r.status == "ok" else None,
                                r.invalid_reason, r.message, r.compile_s, r.max_rel_error, sweep=NAME,
                                is_default=bool(is_default))
        say(f"[{i + 1}/{len(shapes)}] {w.label()}: {len(results)} candidates in "
            f"{time.perf_counter() - t0:.1f}s  " + one_line(doc["rows"], w.label(), args.page))
        (out / f"{NAME}.json").write_text(json.dumps(doc, indent=1, default=str))
        del results
        torch.cuda.empty_cache()
    if store:
        store.close()
    return doc


def one_line(rows, label, page) -> str:
    s = shape_summary([r for r in rows if r["workload"] == label], page, test=False)
    if not s.get("fa3_us") or not s.get("default_us"):
        return "(incomplete)"
    best = f"{s['best_us']:.1f}us@{s['best_splits']}" if s.get("best_us") else "-"
    return (f"fa3 {s['fa3_us']:.1f}us  triton default {s['default_us']:.1f}us@{s['default_splits']}  "
            f"best {best}")


# ---------------------------------------------------------------- analysis

def _compare():
    try:
        from mla_tune.tune.verdict import compare
        import scipy  # noqa: F401
        return compare
    except ImportError:
        return None


def _gmean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def shape_summary(rows: list[dict], page: int, test: bool = True) -> dict:
    """fa3, Triton default and Triton best at the run's page size, and the verdicts, for one shape."""
    compare = _compare() if test else None
    ok = [r for r in rows if r["status"] == "ok" and r["median_us"]]
    fa3 = next((r for r in ok if r["candidate"].startswith(FA3)), None)
    tri = [r for r in ok if r["family"] == "triton" and r["page_size"] == page]
    default = next((r for r in tri if r["is_default"]), None)
    best = min(tri, key=lambda r: r["median_us"]) if tri else None
    d16 = next((r for r in ok if r["family"] == "triton" and r["is_default"] and r["page_size"] == 16
                and page != 16), None)
    s = {"workload": rows[0]["workload"] if rows else None,
         "heads": rows[0]["heads"] if rows else None, "batch": rows[0]["batch"] if rows else None,
         "context": rows[0]["context"] if rows else None,
         "fa3_us": fa3 and fa3["median_us"], "default_us": default and default["median_us"],
         "default_splits": default and default["params"].get("num_kv_splits"),
         "best_us": best and best["median_us"], "best_splits": best and best["params"].get("num_kv_splits"),
         "default_p16_us": d16 and d16["median_us"],
         "invalid": [f"{r['candidate']}: {r['invalid_reason']}" for r in rows if r["status"] != "ok"]}
    if fa3 and default:
        s["default_over_fa3"] = default["median_us"] / fa3["median_us"]
    if fa3 and best:
        s["best_over_fa3"] = best["median_us"] / fa3["median_us"]
    if default and best:
        s["tuning_gain"] = default["median_us"] / best["median_us"]
    if d16 and default:
        s["p16_over_p64"] = d16["median_us"] / default["median_us"]
    if compare:
        if fa3 and best:     # does Triton (tuned) beat fa3 beyond noise?
            sig, p, _ = compare(fa3["kernel_us"], best["kernel_us"])
            s["triton_wins"], s["triton_wins_p"] = sig, p
        if default and best and best is not default:
            sig, p, _ = compare(default["kernel_us"], best["kernel_us"])
            s["tuning_significant"], s["tuning_p"] = sig, p
        elif default and best:
            s["tuning_significant"] = False
        if d16 and default:
            faster16, _, _ = compare(default["kernel_us"], d16["kernel_us"])
            faster64, _, _ = compare(d16["kernel_us"], default["kernel_us"])
            s["page_verdict"] = "p16 faster" if faster16 else "p64 faster" if faster64 else "no difference"
    return s


def summarize(doc: dict) -> dict:
    by_shape: dict = {}
    for r in doc["rows"]:
        by_shape.setdefault(r["workload"], []).append(r)
    page = doc["settings"]["page"]
    shapes = sorted((shape_summary(rows, page) for rows in by_shape.values()),
                    key=lambda s: (-s["heads"], s["batch"], s["context"]))
    full = [s for s in shapes if s.get("default_over_fa3") and s.get("best_over_fa3")]

    def agg(sel):
        if not sel:
            return None
        d = [s["default_over_fa3"] for s in sel]
        b = [s["best_over_fa3"] for s in sel]
        g = [s["tuning_gain"] for s in sel]
        return {"n": len(sel), "default_over_fa3_geomean": _gmean(d), "default_over_fa3_min": min(d),
                "default_over_fa3_max": max(d), "best_over_fa3_geomean": _gmean(b),
                "best_over_fa3_min": min(b), "best_over_fa3_max": max(b), "tuning_gain_geomean": _gmean(g),
                "tuning_gain_max": max(g)}

    p16 = [s["p16_over_p64"] for s in shapes if s.get("p16_over_p64")]
    comp = [r["compile_s"] for r in doc["rows"] if r["family"] == "triton" and r["compile_s"]
            and r["compile_s"] > 0.2]   # first use of a (heads, splits, page) config: the JIT
    tested = any("triton_wins" in s for s in shapes)
    wins = [s["workload"] for s in shapes if s.get("triton_wins")]
    return {
        "shapes": shapes, "all": agg(full),
        "by_heads": {str(h): agg([s for s in full if s["heads"] == h]) for h in sorted({s["heads"] for s in full})},
        "p16_over_p64_geomean": _gmean(p16),
        "p16_verdicts": {v: sum(1 for s in shapes if s.get("page_verdict") == v)
                         for v in ("p16 faster", "p64 faster", "no difference")},
        "triton_jit_s": {"n": len(comp), "median": statistics.median(comp) if comp else None,
                         "min": min(comp, default=None), "max": max(comp, default=None)},
        "significance_tested": tested, "triton_wins": wins,
        "tuning_significant": sum(1 for s in shapes if s.get("tuning_significant")),
    }


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def render(doc: dict, summ: dict) -> str:
    env = doc.get("environment", {})
    lines = [f"# Triton MLA (vLLM {env.get('vllm')}) vs FlashInfer fa3 ({env.get('flashinfer')}) on "
             f"{env.get('device_name')}", "",
             f"DeepSeek-V3 absorbed decode, bf16, page {doc['settings'].get('page')}, q_len 1, uniform "
             f"lengths; {doc['settings'].get('samples')} CUDA-graph samples per candidate, interleaved; "
             "times are medians in us. def = vLLM's num_kv_splits rule, best = fastest split of the space.",
             "",
             "| H | B | L | fa3 | Triton def (splits) | Triton best (splits) | def/fa3 | best/fa3 | gain def/best | p16/p64 (def) | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summ["shapes"]:
        if s.get("triton_wins"):
            verdict = f"Triton wins (p={s['triton_wins_p']:.1e})"
        elif "triton_wins" in s:
            verdict = "fa3"
        else:
            verdict = "untested" if s.get("best_over_fa3") else "incomplete"
        if s.get("tuning_significant"):
            verdict += ", tuning significant"
        lines.append(
            f"| {s['heads']} | {s['batch']} | {s['context']} | {_f(s['fa3_us'])} | "
            f"{_f(s['default_us'])} ({_f(s['default_splits'], '{}')}) | {_f(s['best_us'])} "
            f"({_f(s['best_splits'], '{}')}) | {_f(s.get('default_over_fa3'), '{:.2f}')} | "
            f"{_f(s.get('best_over_fa3'), '{:.2f}')} | {_f(s.get('tuning_gain'), '{:.2f}')} | "
            f"{_f(s.get('p16_over_p64'), '{:.3f}')} | {verdict} |")
    a = summ["all"]
    lines.append("")
    if a:
        lines.append(f"Geomean over {a['n']} shapes: Triton default {a['default_over_fa3_geomean']:.2f}x fa3's time "
                     f"({a['default_over_fa3_min']:.2f}-{a['default_over_fa3_max']:.2f}x); Triton tuned "
                     f"{a['best_over_fa3_geomean']:.2f}x ({a['best_over_fa3_min']:.2f}-{a['best_over_fa3_max']:.2f}x); "
                     f"tuning num_kv_splits gains {a['tuning_gain_geomean']:.2f}x over vLLM's rule "
                     f"(up to {a['tuning_gain_max']:.2f}x; significant in {summ['tuning_significant']} shapes).")
        for h, g in summ["by_heads"].items():
            if g:
                lines.append(f"* {h} heads: default {g['default_over_fa3_geomean']:.2f}x fa3, tuned "
                             f"{g['best_over_fa3_geomean']:.2f}x fa3, gain {g['tuning_gain_geomean']:.2f}x ({g['n']} shapes)")
    if summ["p16_over_p64_geomean"]:
        lines.append(f"* Triton default at page 16 vs 64: {summ['p16_over_p64_geomean']:.3f}x geomean; "
                     f"verdicts {summ['p16_verdicts']}")
    j = summ["triton_jit_s"]
    if j["n"]:
        lines.append(f"* Triton JIT on first use of a config: {j['min']:.2f}-{j['max']:.2f} s "
                     f"(median {j['median']:.2f} s, {j['n']} configs)")
    if not summ["significance_tested"]:
        lines.append("* Significance not tested (scipy missing here): rerun with --analyze <json>.")
    elif summ["triton_wins"]:
        lines.append(f"* Triton beats fa3 beyond noise at: {', '.join(summ['triton_wins'])}")
    else:
        from mla_tune.tune.verdict import MIN_RATIO, P_THRESHOLD
        lines.append(f"* Triton never beats fa3 beyond noise (Mann-Whitney p < {P_THRESHOLD:g} and "
                     f">= {MIN_RATIO:g}x).")
    if doc.get("skipped"):
        lines.append(f"* Not measured (time budget or setup failure): {', '.join(doc['skipped'])}")
    bad = [(s["workload"], x) for s in summ["shapes"] for x in s["invalid"]]
    if bad:
        lines.append("* Invalid candidates: " + "; ".join(f"{w}: {x}" for w, x in bad))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tp", type=ints, default=(1, 8), help="DeepSeek-V3 TP sizes (1: 128 heads, 8: 16)")
    ap.add_argument("--batches", type=ints, default=(1, 8, 32, 128))
    ap.add_argument("--contexts", type=ints, default=(1024, 4096, 32768))
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--no-page16", dest="page16", action="store_false",
                    help="skip Triton's default at page 16")
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    add_shape_run_options(ap, budget_s=1e9, quick="B 1,32,128 x L 1K,32K (12 shapes)",
                          analyze="recompute the summary of an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.contexts = (1, 32, 128), (1024, 32768)
    for v in args.batches + args.contexts:
        if v < 1:
            ap.error(f"batch and context must be positive, got {v}")
    if args.analyze:
        doc = read_earlier_run(args.analyze)
        if doc is None:
            return 2
        text = render(doc, summarize(doc))
        print(text)
        return 0
    out = Path(args.out)
    try:
        doc = measure_all(args)
    except Exception:
        traceback.print_exc()
        return 1
    summ = summarize(doc)
    doc["summary"] = summ
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(doc, indent=1, default=str))
    text = render(doc, summ)
    (out / f"{NAME}.md").write_text(text)
    print(text)
    return 0 if doc["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
