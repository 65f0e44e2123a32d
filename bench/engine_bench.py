"""GPU measurement-engine benchmark (issue 3): one process, one device call.

    source .carry/device-env.sh && python3 bench/engine_bench.py --out $OUT

Measures, through the tuner's own harness (mla_tune.measure.trial.measure_interleaved over
mla_tune.families.flashinfer, i.e. the plugin's op), and writes <out>/engine_bench.json plus a
text summary (<out>/engine_bench.txt, also printed):

* device ceilings (copy GB/s counting read+write, bf16 8192^3 matmul TFLOP/s);
* which FlashInfer backend values run on this device and FlashInfer's refusal for the others;
* fa3 / fa2 / auto at DeepSeek-V3 TP8 (16 heads) and TP1 (128 heads) shapes, % of floor, plan us;
* fa3 page sizes 1/16/64/128; the flat (0.2.x) vs keyword (0.7) API forms;
* repeatability: two back-to-back measure() runs of one candidate;
* the harness against independent measurements: torch profiler kernel time and
  triton.testing.do_bench on the same captured graph;
* the issue-3 performance bars, PASS/MISS with the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_tune.families import Candidate  # noqa: E402
from mla_tune.families.flashinfer import FlashInferFamily  # noqa: E402
from mla_tune.measure.trial import MeasureSettings, measure, measure_interleaved  # noqa: E402
from mla_tune.problem.defaults import KERNEL_METRIC  # noqa: E402
from mla_tune.problem.workload import model_preset, workload_for  # noqa: E402
from mla_tune.problem.instance import make_problem  # noqa: E402
from mla_tune.problem.roofline import achieved, floor_of, measure_ceilings, pct_of_floor  # noqa: E402
from mla_tune.store.stats import stats_of  # noqa: E402
from mla_tune.measure.timing import KernelTimer, flush_buffer, default_pool_bytes  # noqa: E402

V3 = model_preset("deepseek-v3")
LOG: list[str] = []


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def wl(tp, b, L):
    return workload_for(V3, tp, b, L)


def row_of(w, r, ceil, api="keyword", extra=None):
    st = stats_of(r.samples.get(KERNEL_METRIC, [])) if r.status == "ok" else None
    pst = stats_of(r.samples.get("plan_us", [])) if r.status == "ok" else None
    row = {"workload": w.label(), "heads": w.num_heads, "batch": w.batch_size, "context": w.context_len,
           "candidate": r.candidate.key, "api": api, "status": r.status,
           "invalid_reason": r.invalid_reason, "message": (r.message or "")[:500],
           "compile_s": r.compile_s, "max_rel_error": r.max_rel_error,
           "method": getattr(r.samples, "method", None), "note": getattr(r.samples, "note", "")}
    if st:
        gbps, tflops = achieved(st.median, w)
        f = floor_of(w, ceil["copy_gbps"], ceil["matmul_tflops"])
        row.update(median_us=st.median, q1_us=st.q1, q3_us=st.q3, min_us=st.minimum, n=st.n,
                   spread=st.spread, gbps=gbps, tflops=tflops, pct_copy_bw=100 * gbps / ceil["copy_gbps"],
                   pct_floor=pct_of_floor(st.median, w, ceil["copy_gbps"], ceil["matmul_tflops"]),
                   floor_us=f.us, bound=f.bound,
                   plan_us_median=pst.median if pst else None,
                   kernel_us=[round(x, 3) for x in r.samples[KERNEL_METRIC]],
                   plan_us=[round(x, 2) for x in r.samples.get("plan_us", [])])
    row.update(extra or {})
    return row


def fmt_row(r):
    if r["status"] != "ok":
        return f"  {r['workload']:<18} {r['candidate']:<22} {r['api']:<7} INVALID {r['invalid_reason']}: {r['message'][:100]}"
    return (f"  {r['workload']:<18} {r['candidate']:<22} {r['api']:<7} {r['median_us']:>9.1f} us "
            f"IQR {100 * r['spread']:>4.1f}%  {r['gbps']:>6.0f} GB/s ({r['pct_copy_bw']:>5.1f}% copy) "
            f"{r['tflops']:>5.0f} TFLOP/s  floor {r['pct_floor']:>5.1f}% ({r['bound'][:3]})  "
            f"plan {r['plan_us_median'] or 0:>5.0f} us  err {r['max_rel_error']:.1e}  {r['method']}")


def group(title, entries_by_w, settings, ceil, rows, rounds=5):
    say(f"\n== {title}")
    for w, entries in entries_by_w:
        t0 = time.time()
        res = measure_interleaved([(b, c) for b, c, _ in entries], w, settings, rounds)
        for (b, c, api), r in zip(entries, res):
            row = row_of(w, r, ceil, api)
            rows.append(row)
            say(fmt_row(row))
        say(f"  ({time.time() - t0:.1f} s)")


def independent_check(w, backend, cand, settings, n_prof=60):
    """Harness samples vs torch-profiler kernel time and triton do_bench on the same graph."""
    problem = make_problem(w, cand.page_size, "cuda", seed=1, min_pool_bytes=settings.min_pool_bytes)
    prepared = backend.prepare(w, cand, problem)
    replay_timer = KernelTimer(prepared, "cuda", warmup=10, plan_samples=0, graph_events=False)
    harness_replay = statistics.median(replay_timer.sample(200))
    replay_timer.close()
    timer = KernelTimer(prepared, "cuda", warmup=10, plan_samples=0)
    harness = statistics.median(timer.sample(200))
    out = {"workload": w.label(), "candidate": cand.key, "harness_us": harness, "method": timer.method,
           "note": timer.note, "harness_replay_events_us": harness_replay}
    for label, fn in (("profiler", timer.launch), ("profiler_eager", prepared.run)):
        out.update(_profile_kernels(fn, n_prof, label))
    if "profiler_kernel_sum_us" in out:
        out["harness_vs_profiler"] = harness / out["profiler_kernel_sum_us"] - 1
        out["replay_events_vs_profiler"] = harness_replay / out["profiler_kernel_sum_us"] - 1
    elif "profiler_eager_kernel_sum_us" in out:
        out["harness_vs_profiler"] = harness / out["profiler_eager_kernel_sum_us"] - 1
        out["profiler_compared"] = "eager"
    try:
        import triton.testing
        db = triton.testing.do_bench(timer.launch, warmup=25, rep=200, return_mode="median")
        out["do_bench_graph_us"] = db * 1e3
        out["harness_vs_do_bench"] = harness / out["do_bench_graph_us"] - 1
        out["do_bench_eager_us"] = triton.testing.do_bench(prepared.run, warmup=25, rep=200,
                                                            return_mode="median") * 1e3
    except Exception as e:  # noqa: BLE001
        out["do_bench_error"] = f"{type(e).__name__}: {e}"
    timer.close()
    del prepared, problem
    torch.cuda.empty_cache()
    return out


def section(name, fn, result, outdir):
    """Run one part; a failure is recorded and the rest still runs; partial JSON after each."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exc(limit=6)
        result.setdefault("errors", {})[name] = tb
        say(f"!! section {name} failed: {type(e).__name__}: {e}\n{tb}")
    (outdir / "engine_bench.json").write_text(json.dumps(result, indent=1, default=str))
    (outdir / "engine_bench.txt").write_text("\n".join(LOG) + "\n")


def _profile_kernels(fn, n, label):
    """Median per-run sum of kernel durations (CUPTI via torch.profiler), L2 flushed before each run."""
    buf = flush_buffer(torch.device("cuda"))
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                buf.zero_()
                fn()
            torch.cuda.synchronize()
        kern = [e for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA]
        kern = [e for e in kern if not any(x in e.name.lower() for x in ("memset", "fill", "zero"))]
        kern.sort(key=lambda e: e.time_range.start)
        per = len(kern) // n
        res = {f"{label}_kernels_per_run": per, f"{label}_kernel_names": sorted({e.name[:100] for e in kern})}
        if per < 1 or len(kern) != per * n:
            res[f"{label}_error"] = f"{len(kern)} kernel events for {n} runs"
            return res
        sums, spans = [], []
        for i in range(n):
            ks = kern[i * per:(i + 1) * per]
            sums.append(sum(e.time_range.elapsed_us() for e in ks))
            spans.append(ks[-1].time_range.end - ks[0].time_range.start)
        res[f"{label}_kernel_sum_us"] = statistics.median(sums)
        res[f"{label}_span_us"] = statistics.median(spans)
        return res
    except Exception as e:  # noqa: BLE001
        return {f"{label}_error": f"{type(e).__name__}: {e}"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke test)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU, and torch sees none here: run it on the GPU machine")
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    result: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    t_start = time.time()

    from mla_tune.measure.environment import capture_environment
    from vllm_metax.ops import flashinfer_mla as op
    env = capture_environment("gpu", "bench/engine_bench.py")
    api = op.flashinfer_api()
    env["flashinfer_api_form"] = api.form
    env["flashinfer_version_runtime"] = api.version
    result["environment"] = env
    say(f"device {env['device_name']} (SM {env.get('capability')}, {env['sm_count']} SMs), driver {env['driver']}, "
        f"torch {env['torch']} cuda {env['cuda']}, flashinfer {api.version} ({api.form} API)")
    say(f"accepted backend values: {', '.join(api.backends)}")

    ceil = measure_ceilings("cuda")
    result["ceilings"] = ceil
    say(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s (read+write), bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s")

    def support():
        t0 = time.time()
        sup = op.backend_support("cuda")
        result["backend_support"] = sup
        say(f"\n== backend support on this device ({time.time() - t0:.1f} s incl. JIT)")
        for b, why in sup.items():
            say(f"  {b:<20} {'runs' if why is None else 'refused: ' + why[:160]}")
    section("support", support, result, outdir)

    pool = default_pool_bytes("cuda")
    settings = MeasureSettings(device="cuda", warmup=5, samples=args.samples, plan_samples=50,
                               min_pool_bytes=pool, check=True, seed=0)
    result["settings"] = {"samples": settings.samples, "warmup": settings.warmup,
                          "plan_samples": settings.plan_samples, "min_pool_bytes": pool, "rounds": 5,
                          "timing": "CUDA graph of one run, replayed; events per replay; L2 flushed "
                                    "(2x L2 write) before each sample"}
    say(f"timing: pool >= {pool >> 20} MiB, {settings.samples} samples/candidate in 5 interleaved rounds")
    fi, fi_flat = FlashInferFamily(), FlashInferFamily(api="flat")
    rows: list = []
    result["trials"] = rows

    def C(b, p=64):
        return Candidate("flashinfer", b, p)

    h16 = [(64, 4096), (128, 4096), (32, 32768), (128, 8192), (8, 1024), (1, 4096), (128, 1024)]
    h128 = [(128, 32768), (32, 8192), (8, 4096), (1, 4096)]
    if args.quick:
        h16, h128 = h16[:1], h128[2:3]
    trio = [(fi, C("fa3"), "keyword"), (fi, C("fa2"), "keyword"), (fi, C("auto"), "keyword")]
    pages = [(fi, C("fa3", p), "keyword") for p in (1, 16, 64, 128)]
    forms = [(fi, C("fa3"), "keyword"), (fi_flat, C("fa3"), "flat"), (fi, C("fa2"), "keyword"),
             (fi_flat, C("fa2"), "flat")]
    section("h16", lambda: group("DeepSeek-V3 TP8 (16 heads): fa3 vs fa2 vs auto, page 64",
                                 [(wl(8, b, L), trio) for b, L in h16], settings, ceil, rows), result, outdir)
    section("h128", lambda: group("DeepSeek-V3 TP1 (128 heads): fa3 vs fa2, page 64",
                                  [(wl(1, b, L), trio[:2]) for b, L in h128], settings, ceil, rows), result, outdir)
    section("pages", lambda: group("page size (fa3)", [(wl(8, 64, 4096), pages), (wl(1, 32, 8192), pages)],
                                   settings, ceil, rows), result, outdir)
    section("api", lambda: group("API forms: keyword (0.7) vs flat (0.2.x)",
                                 [(wl(8, 64, 4096), forms), (wl(1, 8, 4096), forms)], settings, ceil, rows),
            result, outdir)

    rep: list = []
    result["repeatability"] = rep

    def repeat():
        say("\n== repeatability: two back-to-back measure() runs (fresh problem, prepare, capture each)")
        for w in (wl(8, 64, 4096), wl(1, 128, 32768), wl(8, 8, 1024), wl(8, 128, 8192)):
            ms = []
            for _ in range(2):
                r = measure(fi, w, C("fa3"), settings)
                ms.append(stats_of(r.samples[KERNEL_METRIC]).median if r.status == "ok" else None)
            d = abs(ms[1] - ms[0]) / ms[0] if None not in ms else None
            rep.append({"workload": w.label(), "candidate": "flashinfer/fa3/p64", "median1_us": ms[0],
                        "median2_us": ms[1], "rel_diff": d})
            say(f"  {w.label():<18} fa3/p64: {ms[0]} us vs {ms[1]} us -> "
                + (f"{100 * d:.2f}%" if d is not None else "n/a"))
    section("repeat", repeat, result, outdir)

    ind: list = []
    result["independent"] = ind

    def independent():
        say("\n== harness vs independent measurement (same captured graph)")
        nan = float("nan")
        for w, b in ((wl(8, 64, 4096), "fa3"), (wl(8, 128, 8192), "fa3"), (wl(1, 128, 32768), "fa3"),
                     (wl(1, 32, 8192), "fa3"), (wl(8, 8, 1024), "fa3"), (wl(1, 32, 8192), "fa2")):
            try:
                o = independent_check(w, fi, C(b), settings)
            except Exception as e:  # noqa: BLE001
                o = {"workload": w.label(), "candidate": C(b).key, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc(limit=4)}
            ind.append(o)
            say(f"  {o['workload']:<18} {o['candidate']:<20} harness {o.get('harness_us', nan):9.2f} us "
                f"[{o.get('method')}] (events around replays {o.get('harness_replay_events_us', nan):.2f} us, "
                f"d={100 * o.get('replay_events_vs_profiler', nan):+.2f}%) | "
                f"profiler kernels {o.get('profiler_kernel_sum_us', nan):9.2f} us "
                f"({o.get('profiler_kernels_per_run', '?')}/run, span {o.get('profiler_span_us', nan):.2f}) "
                f"d={100 * o.get('harness_vs_profiler', nan):+.2f}% | do_bench graph "
                f"{o.get('do_bench_graph_us', nan):9.2f} us d={100 * o.get('harness_vs_do_bench', nan):+.2f}% "
                f"| do_bench eager {o.get('do_bench_eager_us', nan):.2f} us "
                f"| eager kernels {o.get('profiler_eager_kernel_sum_us', nan):.2f} us "
                f"{o.get('profiler_error', '')}{o.get('do_bench_error', '')}{o.get('error', '')}")
    section("independent", independent, result, outdir)

    plan_rows: list = []
    result["plan_host_time"] = plan_rows

    def plan_time():
        from vllm_metax.ops.paged_metadata import build_paged_metadata
        say("\n== host time per decode step's plan (metadata build + plan), us, median of 200")
        slow = FlashInferFamily(fast_replan=False)
        for w, b, p in ((wl(8, 1, 4096), "fa3", 64), (wl(8, 32, 4096), "fa3", 64), (wl(8, 128, 4096), "fa3", 64),
                        (wl(1, 128, 32768), "fa3", 64), (wl(8, 128, 4096), "fa2", 64), (wl(8, 64, 4096), "fa3", 1),
                        (wl(8, 64, 4096), "fa3", 16)):
            problem = make_problem(w, p, "cuda", seed=2)
            row = {"workload": w.label(), "candidate": C(b, p).key}
            for label, fam in (("fast_replan_us", fi), ("flashinfer_plan_us", slow)):
                prepared = fam.prepare(w, C(b, p), problem)
                for _ in range(5):
                    prepared.plan()
                torch.cuda.synchronize()
                ts = []
                for _ in range(200):
                    t = time.perf_counter()
                    prepared.plan()
                    ts.append((time.perf_counter() - t) * 1e6)
                row[label] = statistics.median(ts)
                if label == "fast_replan_us":
                    row["fast_replans"] = prepared.kernel.fast_replans
                del prepared
            ts = []
            for _ in range(200):
                t = time.perf_counter()
                build_paged_metadata(problem.block_table, problem.seq_lens_cpu, p, 1)
                ts.append((time.perf_counter() - t) * 1e6)
            row["metadata_build_us"] = statistics.median(ts)
            plan_rows.append(row)
            say(f"  {row['workload']:<18} {row['candidate']:<22} fast {row['fast_replan_us']:7.0f} | "
                f"FlashInfer plan() {row['flashinfer_plan_us']:7.0f} | of which metadata build "
                f"{row['metadata_build_us']:6.0f}   (fast replans {row['fast_replans']})")
            del problem
            torch.cuda.empty_cache()
    section("plan_time", plan_time, result, outdir)

    l2_rows: list = []
    result["l2_flush_effect"] = l2_rows

    def l2_effect():
        say("\n== L2 flush before each sample (harness default) vs none, fa3/p64, median us")
        for w in (wl(8, 64, 4096), wl(8, 128, 4096), wl(8, 8, 1024), wl(1, 32, 8192)):
            problem = make_problem(w, 64, "cuda", seed=1, min_pool_bytes=settings.min_pool_bytes)
            prepared = fi.prepare(w, C("fa3"), problem)
            row = {"workload": w.label()}
            for label, flush in (("flushed_us", True), ("warm_l2_us", False)):
                t = KernelTimer(prepared, "cuda", warmup=5, plan_samples=0, flush=flush)
                row[label] = statistics.median(t.sample(200))
                t.close()
            gbps, _ = achieved(row["flushed_us"], w)
            gbps_w, _ = achieved(row["warm_l2_us"], w)
            row["pct_copy_flushed"] = 100 * gbps / ceil["copy_gbps"]
            row["pct_copy_warm"] = 100 * gbps_w / ceil["copy_gbps"]
            l2_rows.append(row)
            say(f"  {w.label():<18} flushed {row['flushed_us']:8.2f} us ({row['pct_copy_flushed']:5.1f}% copy bw) | "
                f"no flush {row['warm_l2_us']:8.2f} us ({row['pct_copy_warm']:5.1f}%)")
            del prepared, problem
            torch.cuda.empty_cache()
    section("l2", l2_effect, result, outdir)

    def bars_():
        say("\n== issue-3 performance bars")
        bars = {}
        okrows = [r for r in rows if r["status"] == "ok" and r["api"] == "keyword"]
        bw = [r for r in okrows if r["candidate"] == "flashinfer/fa3/p64" and r["heads"] == 16
              and r["batch"] * r["context"] >= 256 * 1024]
        if bw:
            worst = min(bw, key=lambda r: r["pct_copy_bw"])
            bars["fa3_h16_bw"] = {"pass": worst["pct_copy_bw"] >= 83.0, "min_pct_copy_bw": worst["pct_copy_bw"],
                                  "shapes": {r["workload"]: round(r["pct_copy_bw"], 1) for r in bw}}
        big = {r["candidate"]: r for r in okrows
               if r["heads"] == 128 and r["batch"] == 128 and r["context"] == 32768}
        if "flashinfer/fa3/p64" in big and "flashinfer/fa2/p64" in big:
            sp = big["flashinfer/fa2/p64"]["median_us"] / big["flashinfer/fa3/p64"]["median_us"]
            bars["fa3_vs_fa2_h128_b128_l32k"] = {"pass": sp >= 1.5, "speedup": sp}
        if rep and all(x["rel_diff"] is not None for x in rep):
            bars["repeat_within_3pct"] = {"pass": all(x["rel_diff"] <= 0.03 for x in rep),
                                          "max_rel_diff": max(x["rel_diff"] for x in rep)}
        agree = [o for o in ind if "harness_vs_profiler" in o]
        if agree:
            n_ok = sum(abs(o["harness_vs_profiler"]) <= 0.05 for o in agree)
            bars["harness_vs_profiler_within_5pct"] = {
                "pass": n_ok >= 4, "shapes_within": n_ok, "shapes": len(agree),
                "diffs_pct": {f"{o['workload']} {o['candidate']}": round(100 * o["harness_vs_profiler"], 2)
                              for o in agree}}
        result["bars"] = bars
        for k, v in bars.items():
            say(f"  {'PASS' if v['pass'] else 'MISS'}  {k}: "
                f"{json.dumps({a: b for a, b in v.items() if a != 'pass'}, default=str)}")
    section("bars", bars_, result, outdir)
    result["elapsed_s"] = time.time() - t_start
    say(f"\nelapsed {result['elapsed_s']:.0f} s")
    section("write", lambda: None, result, outdir)


if __name__ == "__main__":
    main()
