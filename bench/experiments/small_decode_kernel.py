"""Can a fused Triton MLA decode kernel beat FlashInfer fa3 on small work (B x L <= 8K KV tokens)?

    source bench/tools/device-setup.sh && python3 bench/experiments/small_decode_kernel.py --out $OUT

For each shape (heads, batch, context) at page 64 it builds the problem the tuner measures
(`make_problem`, KV pool of `default_pool_bytes()` with scattered pages, DeepSeek-V3's scale at
TP 128/heads), checks `vllm_metax.ops.split_decode.SplitDecode` against the torch reference
(relative error < 2e-2, run twice so the fused merge's counter reset is checked too), and times it
with the tuner's own harness (`KernelTimer`: CUDA-graph replays, events inside the graph, cold
L2), next to FlashInfer fa3 through the project's flashinfer family and the harness floor (a
graph of one `out.zero_()`). Configs: num_splits x block_n x num_warps x transposed x merge
(fused one-launch / separate merge kernel) at num_stages 2 for every shape, then a second pass of
num_stages 1 and bf16 partials around each shape's best (what `--budget-s` cuts first). Writes
<out>/small_decode_kernel_<device>.{txt,json} (after every shape, so a cut-short run keeps its
rows); the goal is <= 12 us per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = [  # (heads, batch, context)
    (16, 1, 1024), (16, 8, 1024), (16, 1, 8192), (16, 2, 4096), (16, 4, 2048),
    (128, 1, 1024), (128, 8, 1024), (128, 1, 8192), (128, 2, 4096), (128, 4, 2048),
]
PAGE = 64
SPLITS = (4, 8, 16, 32, 64)
GOAL_US = 12.0
MAX_ERR = 2e-2
SAMPLES = 60
# (block_h, block_n, num_warps, transposed) per head count; each with both merges and every
# num_splits. The register/shared-memory fit of each was checked by compiling for sm_90a
# (ptxas -v): BLOCK_H 64 needs 8 warps (4 spill 2.6 KB); transposed (tokens as the dot's M) is
# what gives BLOCK_H 16 Hopper's wgmma, and needs BLOCK_N >= 64.
VARIANTS = {
    16: [(16, 32, 4, False), (16, 64, 8, False), (16, 32, 8, False), (16, 64, 4, True), (16, 64, 8, True)],
    128: [(64, 32, 8, False), (64, 64, 8, False), (64, 64, 8, True), (16, 64, 4, True), (16, 32, 4, False)],
}
MERGE_ORDER = ("fused", "kernel")
# --tma: the served configuration (pointer loads) against the TMA kernel (load "tma": tiles
# double-buffered in shared memory, both dots read there), every one with the served merge
# (merge kernel, 64-column blocks, all splits in one tile, bf16 partials). sm_90a ptxas (Triton
# 3.6): BLOCK_H 16 transposed at 8 warps and BLOCK_H 64 at 8 warps keep the two stages without
# spilling; 4 warps spill >1 KB, non-transposed BLOCK_H 16 loses the second stage. Two programs an
# SM would need one stage (93 KB of shared memory) and 128 registers (656 B of spills; Triton's
# maxnreg launch option): measured wrong on the H200 (relative error 5-7, with and without the cap,
# small_decode_kernel_h200.txt, run `tma_occupancy`), as the pointer kernel's transposed one-stage configuration was
# (small_decode_kernel_h200.txt): SplitDecode refuses transposed with one stage.
TMA_VARIANTS = {
    16: [dict(block_h=16, block_n=64, num_warps=8, transposed=False, load="gather"),
         dict(block_h=16, block_n=64, num_warps=8, transposed=True, load="tma")],
    128: [dict(block_h=64, block_n=64, num_warps=8, transposed=False, load="gather"),
          dict(block_h=64, block_n=64, num_warps=8, transposed=False, load="tma"),
          dict(block_h=16, block_n=64, num_warps=8, transposed=True, load="tma")],
}
TMA_MODE = False
# --pipe: the served TMA kernel (block-table load in its tile loop: GROUP_PAGES 0; at 2 stages
# sm_90a TTGIR issues the next tile's copy only after this tile's dots, so copies and dots never
# overlap) against page ids loaded GROUP_PAGES at a time ahead of the loop (group_pages 32), which
# lets 32-token tiles take 3 or 4 stages (2 or 3 copies in flight during the dots; BLOCK_H 64:
# wgmma with heads as M, 16 heads padded). sm_90a ptxas (Triton 3.6), no spill in any:
# H16 T bn64 st2 255 regs 168 KB; bh64 bn32 st3 230 regs 184 KB, st4 230-254 regs 221 KB
# (bench/results/split_kernel_compile_sm90.txt). pdl: the merge kernel as the split kernel's
# programmatic dependent launch (its launch overlaps the split grid; it waits for it on the GPU).
_PIPE = [dict(num_stages=2, group_pages=0), dict(num_stages=2, group_pages=32),
         dict(block_h=64, block_n=32, transposed=False, num_stages=3, group_pages=32),
         dict(block_h=64, block_n=32, transposed=False, num_stages=4, group_pages=32),
         dict(num_stages=2, group_pages=0, pdl=True),
         dict(block_h=64, block_n=32, transposed=False, num_stages=4, group_pages=32, pdl=True)]
PIPE_VARIANTS = {16: [dict(dict(block_h=16, block_n=64, transposed=True), **v) for v in _PIPE],
                 128: [dict(dict(block_h=64, block_n=64, transposed=False), **v) for v in _PIPE]}
PIPE_MODE = False
FA3_CHUNKS: tuple = ()     # --fa3-chunks: fa3 also at each of the tuner's kv_chunk factors
DEVICE = "cuda"     # the CLI runs on CUDA only; a CPU dry run (Triton's interpreter) may set "cpu"
LOG: list[str] = []


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


def split_choices(batch: int, ctx: int, block_n: int, head_blocks: int) -> list[int]:
    """The num_splits worth timing: each must give a request more splits in use than the one
    before (the kernel's rule: BLOCK_N-aligned chunks), and the grid stays under ~8 waves."""
    from vllm_metax.ops.split_decode import splits_for
    out, seen = [], set()
    for s in SPLITS:
        used = splits_for(ctx, block_n, s)
        if used in seen or batch * head_blocks * used > 1056:
            continue
        seen.add(used)
        out.append(s)
    return out


def base_configs(heads: int, batch: int, ctx: int) -> list[dict]:
    out = []
    if PIPE_MODE:
        for v in PIPE_VARIANTS[heads]:
            hb = -(-heads // v["block_h"])
            for s in split_choices(batch, ctx, v["block_n"], hb):
                out.append(dict(v, num_warps=8, load="tma", num_splits=s, merge="kernel", partial="bfloat16",
                                merge_d=64, merge_st=128))
        return out
    if TMA_MODE:
        for v in TMA_VARIANTS[heads]:
            hb = -(-heads // v["block_h"])
            for s in split_choices(batch, ctx, v["block_n"], hb):
                out.append(dict(dict(num_stages=2), **v, num_splits=s, merge="kernel", partial="bfloat16",
                                merge_d=64, merge_st=128))
        return out
    for block_h, block_n, warps, trans in VARIANTS[heads]:
        hb = -(-heads // block_h)
        for s in split_choices(batch, ctx, block_n, hb):
            for merge in MERGE_ORDER:
                out.append(dict(num_splits=s, block_n=block_n, block_h=block_h, num_warps=warps,
                                num_stages=2, transposed=trans, merge=merge, partial="float32"))
    return out


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def refinements(best: dict) -> list[dict]:
    """Around a shape's best: one pipeline stage fewer, bf16 partials (half the merge traffic), and
    for the merge kernel narrower column blocks with every split in one tile (more merge programs,
    no loop over splits: the merge's latency chain is one load deep)."""
    out = [dict(best, num_stages=1), dict(best, partial="bfloat16")]
    if best["merge"] == "kernel":
        st = min(128, _pow2_at_least(best["num_splits"]))
        for d in (32, 64):
            for partial in ("float32", "bfloat16"):
                out.append(dict(best, merge_d=d, merge_st=st, partial=partial))
    return out


def label(c: dict) -> str:
    merge = c["merge"]
    if merge == "kernel" and (c.get("merge_d", 128), c.get("merge_st", 16)) != (128, 16):
        merge += f" md{c['merge_d']} mst{c['merge_st']}"
    return (f"S{c['num_splits']} bn{c['block_n']} bh{c['block_h']} w{c['num_warps']} st{c['num_stages']}"
            f"{' T' if c['transposed'] else ''} {merge}{' bf16ws' if c['partial'] == 'bfloat16' else ''}"
            f"{' tma' if c.get('load') == 'tma' else ''}"
            f"{' g%d' % c['group_pages'] if 'group_pages' in c else ''}{' pdl' if c.get('pdl') else ''}")


def sync(torch) -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def pool_bytes() -> int:
    from mla_tune.measure.timing import default_pool_bytes
    return default_pool_bytes(DEVICE)


def timed(torch, prepared) -> dict:
    from mla_tune.measure.timing import KernelTimer
    timer = KernelTimer(prepared, DEVICE, warmup=3, plan_samples=0)
    try:
        xs = timer.sample(SAMPLES)
    finally:
        timer.close()
    xs = sorted(xs)
    return {"median_us": statistics.median(xs), "min_us": xs[0], "p90_us": xs[int(0.9 * (len(xs) - 1))],
            "method": timer.method, "note": timer.note}


class Shape:
    """One shape's problem on the GPU, its reference output and its device-side lengths."""

    def __init__(self, torch, heads, batch, ctx):
        from mla_tune.problem.instance import make_problem
        from mla_tune.problem.reference import mla_decode_reference
        from mla_tune.problem.workload import model_preset, workload_for
        self.heads, self.batch, self.ctx = heads, batch, ctx
        self.workload = workload_for(model_preset("deepseek-v3"), 128 // heads, batch, ctx)
        self.problem = make_problem(self.workload, PAGE, DEVICE, seed=0, min_pool_bytes=pool_bytes())
        p = self.problem
        self.seq_lens = p.seq_lens_cpu.to(DEVICE)
        self.ref = mla_decode_reference(p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table,
                                        p.seq_lens_cpu, self.workload.softmax_scale)
        sync(torch)

    @property
    def name(self) -> str:
        return f"H{self.heads} B{self.batch} L{self.ctx}"


def run_config(torch, shape: Shape, c: dict) -> dict:
    from mla_tune.families.base import Prepared
    from vllm_metax.ops.split_decode import SplitDecode
    from mla_tune.problem.reference import relative_error
    p, w = shape.problem, shape.workload
    dec = SplitDecode(shape.heads, PAGE, shape.batch, c["num_splits"], block_n=c["block_n"],
                      num_warps=c["num_warps"], num_stages=c["num_stages"], block_h=c["block_h"],
                      merge=c["merge"], transposed=c["transposed"],
                      partial_dtype=getattr(torch, c["partial"]), device=DEVICE,
                      merge_block_d=c.get("merge_d", 128), merge_split_tile=c.get("merge_st", 16),
                      load=c.get("load", "gather"), pdl=c.get("pdl", False),
                      **({"group_pages": c["group_pages"]} if "group_pages" in c else {}))
    out = torch.empty_like(p.q_nope)
    args = (p.q_nope, p.q_pe, p.ckv_cache, p.kpe_cache, p.block_table, shape.seq_lens,
            w.softmax_scale, out)
    row = dict(c)
    errs = []
    t0 = time.perf_counter()
    for _ in range(2):          # the second run needs the counters the first one left at 0
        out.fill_(float("nan"))
        dec.run(*args)
        sync(torch)
        if not errs:
            row["first_run_s"] = round(time.perf_counter() - t0, 3)    # the compile, where new
        errs.append(relative_error(out, shape.ref))
    row["rel_err"] = max(errs)
    row["served_by"] = ("tma" if c.get("load") == "tma" and dec._descriptors(p.ckv_cache, p.kpe_cache)
                        else "pointer")
    row["counters_left"] = int(torch.count_nonzero(dec.counter))
    if row["rel_err"] >= MAX_ERR or row["counters_left"]:
        row["status"] = "wrong"
        return row
    row.update(timed(torch, Prepared(run=lambda: dec.run(*args), plan=None, out=out)))
    out.fill_(float("nan"))     # after ~70 graph replays: the counters still reset?
    dec.run(*args)
    sync(torch)
    row["rel_err_after_replays"] = relative_error(out, shape.ref)
    row["status"] = "ok" if row["rel_err_after_replays"] < MAX_ERR else "wrong"
    return row


def fa3_row(torch, shape: Shape, kv_chunk: str | None = None) -> dict:
    """fa3 at MLAPlan's chunking, or at one of the tuner's kv_chunk factors (what a tuned
    FlashInfer config can serve)."""
    from mla_tune.families import Candidate, get_family
    from mla_tune.problem.reference import relative_error
    fam = get_family("flashinfer")
    ok = fam.available(DEVICE)
    if not ok.ok:
        return {"status": "unavailable", "message": ok.reason}
    default = fam.default_candidate(shape.workload, PAGE)
    cand = default if default.backend == "fa3" else Candidate("flashinfer", "fa3", PAGE)
    if kv_chunk is not None:
        cand = Candidate("flashinfer", "fa3", PAGE, {"kv_chunk": kv_chunk})
    prepared = fam.prepare(shape.workload, cand, shape.problem)
    prepared.run()
    sync(torch)
    row = {"candidate": cand.key, "default_candidate": default.key, "compile_s": prepared.compile_s,
           "rel_err": relative_error(prepared.out, shape.ref)}
    row.update(timed(torch, prepared))
    row["status"] = "ok" if row["rel_err"] < MAX_ERR else "wrong"
    return row


def floor_row(torch, shape: Shape) -> dict:
    from mla_tune.families.base import Prepared
    out = torch.empty_like(shape.problem.q_nope)
    return dict(timed(torch, Prepared(run=lambda: out.zero_(), plan=None, out=out)), status="ok")


def guarded(what: str, fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - one failing config must not end the run
        say(f"  {what}: {type(e).__name__}: {str(e)[:400]}")
        return {"status": "error", "message": f"{type(e).__name__}: {e}"[:2000],
                "traceback": traceback.format_exc()[-3000:]}


def run_configs(torch, shape: Shape, doc: dict, configs, deadline: float) -> None:
    for c in configs:
        if time.perf_counter() > deadline:
            doc["skipped"].append(label(c))
            continue
        row = guarded(f"{shape.name} {label(c)}", run_config, torch, shape, c)
        row["config"] = label(c)
        for k, v in c.items():
            row.setdefault(k, v)
        doc["configs"].append(row)
        if row.get("status") == "wrong":
            say(f"  {shape.name} {label(c)}: WRONG rel_err {row.get('rel_err')} after replays "
                f"{row.get('rel_err_after_replays')} counters {row.get('counters_left')}")


def ok_rows(doc: dict) -> list[dict]:
    return [r for r in doc.get("configs", []) if r.get("status") == "ok"]


def first_pass(torch, heads, batch, ctx, deadline: float):
    """The shape's problem, fa3, the floor and the base grid."""
    t0 = time.perf_counter()
    shape = Shape(torch, heads, batch, ctx)
    doc = {"heads": heads, "batch": batch, "context": ctx, "page_size": PAGE,
           "softmax_scale": shape.workload.softmax_scale, "configs": [], "skipped": []}
    doc["fa3"] = guarded(f"{shape.name} fa3", fa3_row, torch, shape)
    if FA3_CHUNKS:
        doc["fa3_chunked"] = {c: guarded(f"{shape.name} fa3 kv_chunk={c}", fa3_row, torch, shape, c)
                              for c in FA3_CHUNKS}
    doc["floor"] = guarded(f"{shape.name} floor", floor_row, torch, shape)
    run_configs(torch, shape, doc, base_configs(heads, batch, ctx), deadline)
    doc["wall_s"] = time.perf_counter() - t0
    return shape, doc


def second_pass(torch, shape: Shape, doc: dict, deadline: float) -> None:
    """Refinements around the base grid's best (after every shape's base grid: the deadline
    cuts these first)."""
    ok = ok_rows(doc)
    if not ok:
        return
    t0 = time.perf_counter()
    best = min(ok, key=lambda r: r["median_us"])
    base = {k: best[k] for k in ("num_splits", "block_n", "block_h", "num_warps", "num_stages",
                                 "transposed", "merge", "partial") if k in best}
    base.update({k: best[k] for k in ("merge_d", "merge_st") if k in best})
    have = {r["config"] for r in doc["configs"]}
    todo = [c for c in refinements(base) if label(c) not in have]
    from vllm_metax.ops.split_decode import splits_for
    if splits_for(shape.ctx, base["block_n"], base["num_splits"]) == 1:
        todo = [c for c in todo if c["partial"] == "float32"]      # no partials to shrink
    run_configs(torch, shape, doc, todo, deadline)
    doc["wall_s"] += time.perf_counter() - t0


def summarise(doc: dict) -> None:
    ok = ok_rows(doc)
    best = min(ok, key=lambda r: r["median_us"]) if ok else None
    fa3 = doc.get("fa3", {})
    fa3_us = fa3.get("median_us") if fa3.get("status") == "ok" else None
    doc["best"] = best["config"] if best else None
    doc["best_us"] = best["median_us"] if best else None
    doc["fa3_us"] = fa3_us
    doc["floor_us"] = doc.get("floor", {}).get("median_us")
    doc["fa3_over_best"] = fa3_us / best["median_us"] if best and fa3_us else None
    tuned = [(r["median_us"], c) for c, r in doc.get("fa3_chunked", {}).items() if r.get("status") == "ok"]
    if fa3_us:
        tuned.append((fa3_us, "default"))
    doc["fa3_tuned_us"], doc["fa3_tuned_chunk"] = min(tuned) if tuned else (None, None)
    doc["fa3_tuned_over_best"] = (doc["fa3_tuned_us"] / best["median_us"]
                                  if best and doc["fa3_tuned_us"] else None)
    doc["meets_goal"] = bool(best and best["median_us"] <= GOAL_US)
    by_merge = {}
    for r in ok:
        key = (r["merge"] if not TMA_MODE else ("tma" if r.get("load") == "tma" else "pointer"))
        if PIPE_MODE:
            key = f"bn{r['block_n']} st{r['num_stages']} g{r['group_pages']}{' pdl' if r.get('pdl') else ''}"
        if key not in by_merge or r["median_us"] < by_merge[key]["median_us"]:
            by_merge[key] = r
    doc["best_by_merge"] = {m: {"config": r["config"], "median_us": r["median_us"]}
                            for m, r in by_merge.items()}


def fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def report_shape(doc: dict, t_start: float) -> None:
    fa3 = doc.get("fa3", {})
    why = "" if fa3.get("status") == "ok" else f" ({fa3.get('status')}: {str(fa3.get('message', ''))[:120]})"
    say(f"H{doc['heads']} B{doc['batch']} L{doc['context']}: best {fmt(doc.get('best_us'))} us "
        f"({doc.get('best')}); fa3 {fmt(doc.get('fa3_us'))} us{why}; fa3 best chunking "
        f"{fmt(doc.get('fa3_tuned_us'))} us ({doc.get('fa3_tuned_chunk')}); floor {fmt(doc.get('floor_us'))} us; "
        f"{len(ok_rows(doc))}/{len(doc.get('configs', []))} configs ok, {len(doc.get('skipped', []))} skipped; "
        f"best by {'merge' if not TMA_MODE else 'load'} " + ", ".join(f"{m} {v['median_us']:.1f}" for m, v in doc.get("best_by_merge", {}).items())
        + f"; {time.perf_counter() - t_start:.0f} s so far")


def main(argv=None) -> int:
    global SPLITS, FA3_CHUNKS, TMA_MODE, PIPE_MODE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for small_decode_kernel_<device>.{txt,json}")
    ap.add_argument("--budget-s", type=float, default=140.0,
                    help="configs not started by then are skipped (and listed); default 140")
    ap.add_argument("--shapes", default="", help="only these, e.g. '16x1x8192,128x8x1024'")
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)),
                    help=f"num_splits values to time (default {','.join(map(str, SPLITS))})")
    ap.add_argument("--fa3-chunks", action="store_true",
                    help="also time fa3 at every kv_chunk factor of the tuner (the best a tuned config serves)")
    ap.add_argument("--tma", action="store_true",
                    help="the served configuration against the TMA kernel (TMA_VARIANTS), no refinements")
    ap.add_argument("--pipe", action="store_true",
                    help="the served TMA kernel against pipelined variants (PIPE_VARIANTS), no refinements")
    ap.add_argument("--tag", default="", help="results file suffix: small_decode_kernel<_tag>_<device>")
    args = ap.parse_args(argv)
    try:
        SPLITS = tuple(sorted({int(x) for x in args.splits.split(",")}))
    except ValueError:
        ap.error(f"--splits takes integers, e.g. 16,64,128; got {args.splits!r}")
    if not SPLITS or SPLITS[0] < 1:
        ap.error(f"--splits: each must be >= 1, got {args.splits!r}")
    PIPE_MODE = args.pipe
    TMA_MODE = args.tma or args.pipe
    if args.fa3_chunks:
        from vllm_metax.core.choices import KV_CHUNKS
        FA3_CHUNKS = KV_CHUNKS
    t_start = time.perf_counter()
    try:
        import torch
    except ImportError as e:
        ap.error(f"needs torch ({e})")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU, and torch sees none here: run it on the GPU machine")
    try:
        import triton
    except ImportError as e:
        ap.error(f"needs triton ({e})")
    from mla_tune.families.triton_mla import vllm_compiled_ops_missing
    if vllm_compiled_ops_missing():     # as the other benches: the plugin must be the platform
        os.environ.setdefault("VLLM_METAX_FORCE", "1")
    try:
        import flashinfer
        fi_version = getattr(flashinfer, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        fi_version = f"not importable ({type(e).__name__}: {e}); fa3 column skipped"
    shapes = SHAPES
    if args.shapes:
        try:
            want = {tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")}
        except ValueError:
            ap.error(f"--shapes takes HxBxL[,HxBxL...], got {args.shapes!r}")
        if any(len(w) != 3 or w[0] not in VARIANTS for w in want):
            ap.error(f"--shapes: each is HxBxL with H in {sorted(VARIANTS)}, got {args.shapes!r}")
        shapes = [s for s in SHAPES if s in want] + sorted(want - set(SHAPES))
    name = torch.cuda.get_device_name()
    say(f"# small-work Triton MLA decode vs FlashInfer fa3 on {name}, torch {torch.__version__}, "
        f"triton {triton.__version__}, flashinfer {fi_version}; page {PAGE}, cold L2, median of {SAMPLES}")
    deadline = t_start + args.budget_s
    rows, shapes_done = [], []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = ("h200" if "H200" in name else name.replace(" ", "_").lower())
    if args.tag:
        tag = f"{args.tag}_{tag}"

    def write(total=None):      # after every shape too: a run cut short still leaves its rows
        (out / f"small_decode_kernel_{tag}.txt").write_text("\n".join(LOG) + "\n")
        (out / f"small_decode_kernel_{tag}.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "triton": triton.__version__, "flashinfer": fi_version,
             "page_size": PAGE, "samples": SAMPLES, "goal_us": GOAL_US, "total_s": total,
             "budget_s": args.budget_s, "rows": rows}, indent=1, default=str))
    for heads, batch, ctx in shapes:
        try:
            shape, doc = first_pass(torch, heads, batch, ctx, deadline)
            shapes_done.append((shape, doc))
        except Exception as e:  # noqa: BLE001 - one failing shape must not end the run
            say(f"H{heads} B{batch} L{ctx}: {type(e).__name__}: {str(e)[:400]}")
            doc = {"heads": heads, "batch": batch, "context": ctx, "status": "error",
                   "message": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}
        rows.append(doc)
        summarise(doc)
        report_shape(doc, t_start)
        write()
    if not TMA_MODE:
        say("refinements (num_stages 1, bf16 partials) around each shape's best:")
    for shape, doc in shapes_done if not TMA_MODE else ():
        guarded(f"{shape.name} refinements", second_pass, torch, shape, doc, deadline)
        summarise(doc)
        report_shape(doc, t_start)
        write()
    shapes_done.clear()
    say()
    head = (f"{'shape':<16} {'best us':>8} {'fa3 us':>7} {'fa3 tuned':>9} {'floor':>6} {'fa3/best':>8} "
            f"{'tuned/best':>10} {'<=12us':>6}  best config")
    say(head)
    say("-" * len(head))
    for d in rows:
        say(f"{'H%d B%d L%d' % (d['heads'], d['batch'], d['context']):<16} {fmt(d.get('best_us')):>8} "
            f"{fmt(d.get('fa3_us')):>7} {fmt(d.get('fa3_tuned_us')):>9} {fmt(d.get('floor_us')):>6} "
            f"{fmt(d.get('fa3_over_best'), '.2f'):>8} {fmt(d.get('fa3_tuned_over_best'), '.2f'):>10} "
            f"{'yes' if d.get('meets_goal') else 'no':>6}  {d.get('best')}")
    total = time.perf_counter() - t_start
    say(f"total {total:.0f} s; goal <= {GOAL_US} us per call on small work")
    write(total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
