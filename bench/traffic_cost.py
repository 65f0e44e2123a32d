"""Per-step CPU cost of the plugin's traffic recording (`VLLM_METAX_TRAFFIC`, vllm_metax.core.traffic).

A recording server's decode step adds one call to the metadata builder's host path:
`TrafficRecorder.decode(batch, context, q_len)` with the step's lookup key (the builder has
computed the key already: `decisions.bucket_context` is on the step's path with or without
recording). Recording off, the builder tests `self.traffic is not None` and nothing else.

Measured here, per batch size 1..256 (a decode run of that batch: each step every request one
token longer, contexts ragged around 4K, q_len 1 and 2 alternating runs), with timeit:

  off            the builder's test with recording off
  decode         the recorder's decode() of the step's key (what recording adds per step)
  prefill        the recorder's prefill() of one plan's key
  bucket_context the lookup statistic of the batch (already paid with or without recording)
  flush          one flush of a recorder holding every key of this run into a fresh file
                 (runs on the flush thread every 5 s, on a stop signal and at exit, not on a step)
  stall          the step thread's longest pause while the flush thread flushes (it takes the
                 GIL for its Python work), against the same loop with no flush thread

Run anywhere (CPU only, stdlib + numpy):  python bench/traffic_cost.py [--out bench/results]
It prints a table and writes traffic_cost_<host kind>.txt under --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import timeit
from pathlib import Path

import numpy as np

from vllm_metax.core import decisions, traffic
from vllm_metax.core.tuned_config import ModelDims

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEPS = 4096           # decode steps per timed run (distinct contexts: a realistic key spread)
REPEATS = 7
DIMS = ModelDims(16, 512, 64, "bfloat16", "bfloat16")


def _steps(batch: int, seed: int) -> list[tuple[int, int, int]]:
    """(batch, context, q_len) of STEPS decode steps: ragged lengths around 4K growing a token a step."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1024, 7168, size=batch)
    out = []
    for s in range(STEPS):
        q = 1 if (s // 512) % 2 == 0 else 2
        out.append((batch, decisions.bucket_context(lens + s), q))
    return out


def _per_call_ns(stmt, calls: int) -> tuple[float, float]:
    """(best, median) ns per call over REPEATS runs of `stmt` (which makes `calls` calls)."""
    runs = timeit.repeat(stmt, number=1, repeat=REPEATS)
    per = [r / calls * 1e9 for r in runs]
    return min(per), statistics.median(per)


def measure() -> list[dict]:
    rows = []
    tmp = tempfile.mkdtemp(prefix="traffic-cost-")
    for batch in BATCHES:
        steps = _steps(batch, batch)
        rec = traffic.TrafficRecorder(os.path.join(tmp, f"b{batch}.db"), DIMS, flush_seconds=0)
        dec = rec.decode

        class Builder:                       # the builder's attribute test, recording off
            traffic = None
        b = Builder()

        def off():
            for s in steps:
                if b.traffic is not None:
                    b.traffic.decode(*s)

        def on():
            for bs, c, q in steps:
                dec(bs, c, q)

        def loop():                           # the loop alone, subtracted from both
            for bs, c, q in steps:
                pass

        def pre():
            for bs, c, q in steps:
                rec.prefill(True, bs * 128, c)

        rng = np.random.default_rng(0)
        lens = rng.integers(1024, 7168, size=batch).astype(np.int32)
        ctx_best, ctx_med = _per_call_ns(lambda: [decisions.bucket_context(lens) for _ in range(STEPS)], STEPS)
        base_best, _ = _per_call_ns(loop, STEPS)
        off_best, off_med = _per_call_ns(off, STEPS)
        on_best, on_med = _per_call_ns(on, STEPS)
        pre_best, pre_med = _per_call_ns(pre, STEPS)
        keys = len(rec.decode_counts) + len(rec.prefill_counts)
        flush_s = timeit.timeit(rec.flush, number=1)
        rows.append(dict(batch=batch, off=off_med - base_best, decode=on_med - base_best,
                         decode_best=on_best - base_best, prefill=pre_med - base_best,
                         bucket_context=ctx_med, keys=keys, flush_ms=flush_s * 1e3))
    return rows


def stall(keys: int = 400, seconds: float = 3.0, every: float = 0.05) -> dict:
    """The step thread's pauses (gaps between its iterations, us) with a recorder of `keys` changing
    keys flushed every `every` s on its own thread, against no flush thread: the flush's share of
    the GIL as a server's step loop would feel it (a flush every 5 s there)."""
    import threading
    import time

    def gaps(flushing: bool) -> list[float]:
        path = os.path.join(tempfile.mkdtemp(prefix="traffic-stall-"), "t.db")
        rec = traffic.TrafficRecorder(path, DIMS, flush_seconds=0)
        stop, flushes = threading.Event(), [0]

        def flusher():
            while not stop.wait(every):
                for k in range(keys):                  # every key changes between flushes
                    rec.decode(1 + k % 256, 1024 + 64 * (k // 256) + flushes[0], 1)
                rec.flush()
                flushes[0] += 1
        t = threading.Thread(target=flusher, daemon=True) if flushing else None
        if t is not None:
            t.start()
        out, last, end = [], time.perf_counter(), time.perf_counter() + seconds
        while last < end:
            now = time.perf_counter()
            out.append((now - last) * 1e6)
            last = now
        stop.set()
        if t is not None:
            t.join()
        rec.close()
        return out

    def summary(runs: list[list[float]]) -> dict:
        g = sorted(x for run in runs for x in run)
        return {"max_us": g[-1], "p99999_us": g[int(0.99999 * (len(g) - 1))],
                "over_1ms": sum(x >= 1000 for x in g), "over_5ms": sum(x >= 5000 for x in g)}
    rounds = {False: [], True: []}
    for _ in range(3):                     # interleaved: the shared machine's own pauses hit both
        for flushing in (False, True):
            rounds[flushing].append(gaps(flushing))
    return {"keys": keys, "every_s": every, "seconds": 3 * seconds, "flushes": int(3 * seconds / every),
            "without": summary(rounds[False]), "with": summary(rounds[True])}


def render_stall(r: dict) -> str:
    w, o = r["with"], r["without"]
    return (f"\nstall, {r['keys']} changed keys flushed every {r['every_s'] * 1e3:.0f} ms ({r['flushes']} "
            f"flushes in {r['seconds']:.0f} s) while the step thread spins in Python, never letting the "
            f"GIL go (the worst case): pauses >= 1 ms {w['over_1ms']}, >= 5 ms {w['over_5ms']}, longest "
            f"{w['max_us'] / 1e3:.1f} ms; the same {r['seconds']:.0f} s without the flush thread: "
            f"{o['over_1ms']}, {o['over_5ms']}, {o['max_us'] / 1e3:.1f} ms\n")


def render(rows: list[dict]) -> str:
    head = (f"traffic recording cost per call, CPU {platform.processor() or platform.machine()} "
            f"({_cpu_name()}), Python {platform.python_version()}; {STEPS} steps per run, median of "
            f"{REPEATS} runs, the bare loop's time subtracted\n")
    lines = [head, f"{'batch':>5} {'off ns':>7} {'decode ns':>9} {'(best)':>7} {'prefill ns':>10} "
                   f"{'bucket_context ns':>17} {'keys':>5} {'flush ms':>8}"]
    for r in rows:
        lines.append(f"{r['batch']:>5} {r['off']:>7.0f} {r['decode']:>9.0f} {r['decode_best']:>7.0f} "
                     f"{r['prefill']:>10.0f} {r['bucket_context']:>17.0f} {r['keys']:>5} "
                     f"{r['flush_ms']:>8.2f}")
    worst = max(r["decode"] for r in rows)
    lines.append(f"\nworst decode() median: {worst:.0f} ns per step (goal < 1000 ns)")
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for traffic_cost_cpu.txt")
    args = ap.parse_args()
    text = render(measure()) + "".join(render_stall(stall(keys)) for keys in (40, 400))
    print(text, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "traffic_cost_cpu.txt").write_text(text)


if __name__ == "__main__":
    main()
