"""What a prefill choice costs per step once its host-side plan is counted (issue 51: the tuned
server's prefill-heavy steps, chat@inf's TTFT 1.19x and p99 ITL 1.13x vLLM's own, and the cold
start the FlashInfer prefill modules cost).

`mla-tune prefill-sweep` times two things per backend and bucket: the kernel (`kernel_us`, run
once per layer) and its plan (`plan_us`, once per step, on the host: FlashInfer's ragged-prefill
`plan()`, or vLLM FA3's metadata). Emit chooses by the kernel alone. A step of an L-layer model
costs L x kernel + plan where the host is on the critical path (a small model, or vLLM's async
scheduling with host work longer than the GPU's), and L x kernel where the GPU hides the plan.
This reads the sweep's samples from a results DB (`ResultsStore`) and shows, per bucket, the kernel
winner, the per-step winner at the layer counts given, what the tuned config serves, and the
FlashInfer prefill modules each rule would need built (vLLM's FA3 ships compiled).

    python3 bench/experiments/prefill_step_cost.py results.db --run 10 \
        --config vllm_metax/configs/device_name=NVIDIA_H100_80GB_HBM3.json --layers 27 --layers 61

With `--write-config DIR` (and --config) it also writes that config with every prefill bucket the
sweep measured re-chosen by the per-step rule at the first --layers count: the variant a serving
A/B (`bench/serve_bench.py --config-folder DIR`) sets against the config as emitted, to test
whether the prefill choice is what makes the tuned server's prefill-heavy steps slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from mla_tune.store.results import ResultsStore
from mla_tune.tune.verdict import MIN_RATIO      # emit's verdict: a challenger must be this much faster
from vllm_metax.core.decisions import prefill_statistic

FLASHINFER = ("fa3", "fa2")     # the FlashInfer backends (each its own JIT module)
VLLM_FA3 = "vllm_fa3"


def buckets(db: str, run: int) -> dict:
    """(heads, kind, requests, query tokens in all, KV tokens per request: the plugin's prefill
    lookup key) -> backend -> (kernel us, plan us), medians."""
    with ResultsStore(db, create=False) as store:
        records = store.records("t.run_id = ?", [run], prefill=True)
    out: dict = {}
    for r in records:
        kernel, plan = r.values("kernel_us"), r.values("plan_us")
        if not (r.ok and kernel and plan):
            continue
        w = r.workload
        key = (w.num_heads, "causal" if w.causal else "context", w.requests,
               *prefill_statistic(w.query_tokens, w.total_kv_tokens, w.requests))
        out.setdefault(key, {})[r.candidate.backend] = (statistics.median(kernel), statistics.median(plan))
    return out


def served(config: str | None) -> dict:
    """(heads, kind, query tokens in all, KV tokens per request) -> the backend the config's
    prefill bucket names."""
    if not config:
        return {}
    out = {}
    for m in json.load(open(config))["models"]:
        for b in (m.get("prefill") or {}).get("buckets", []):
            kind = "causal" if b["causal"] else "context"
            out[(m["dims"]["num_heads"], kind, b["query_tokens"], b["kv_len"])] = b["params"]["backend"]
    return out


def winner(times: dict, cost) -> str:
    """vLLM's FA3 unless a FlashInfer backend is MIN_RATIO times cheaper by `cost`."""
    best = min((b for b in FLASHINFER if b in times), key=lambda b: cost(times[b]), default=None)
    if VLLM_FA3 not in times:
        return best
    if best is not None and cost(times[VLLM_FA3]) >= MIN_RATIO * cost(times[best]):
        return best
    return VLLM_FA3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("db")
    ap.add_argument("--run", type=int, required=True, help="the prefill sweep's run id (with vllm_fa3)")
    ap.add_argument("--config", default=None, help="a tuned config: what it serves per bucket")
    ap.add_argument("--layers", type=int, action="append", default=None,
                    help="layer counts to cost a step at (repeatable; default 27 and 61)")
    ap.add_argument("--write-config", default=None, metavar="DIR",
                    help="write --config with its prefill re-chosen per step at the first --layers")
    args = ap.parse_args()
    layers = args.layers or [27, 61]
    if args.write_config and not args.config:
        print("--write-config needs --config (the config whose prefill it re-chooses)", file=sys.stderr)
        return 2
    data = buckets(args.db, args.run)
    if not data:
        print(f"{args.db}: run {args.run} has no prefill trials with kernel and plan samples", file=sys.stderr)
        return 2
    cfg = served(args.config)
    head = ["heads", "kind", "requests", "query/req", "KV/req"] + [f"{b} kernel (plan)" for b in ("fa3", "fa2", VLLM_FA3)]
    head += ["config", "by kernel"] + [f"by step, {n} layers" for n in layers]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    need = {"config": set(), "kernel": set(), **{n: set() for n in layers}}
    rechosen: dict = {}              # (heads, kind, query tokens in all, KV per request) -> backend
    for key in sorted(data):
        t = data[key]
        if VLLM_FA3 not in t:
            continue
        h, kind, b, q, kv = key
        conf = cfg.get((h, kind, q, kv), "-")
        by_kernel = winner(t, lambda x: x[0])
        by_step = {n: winner(t, lambda x, n=n: n * x[0] + x[1]) for n in layers}
        rechosen[(h, kind, q, kv)] = (by_step[layers[0]], t)
        for rule, w in [("config", conf), ("kernel", by_kernel), *by_step.items()]:
            if w in FLASHINFER:
                need[rule].add(w)
        cells = [str(h), kind, str(b), str(q // b), str(kv)]
        cells += [f"{t[x][0]:.1f} ({t[x][1]:.0f})" if x in t else "-" for x in ("fa3", "fa2", VLLM_FA3)]
        cells += [conf, by_kernel] + [by_step[n] for n in layers]
        print("| " + " | ".join(cells) + " |")
    print()
    print("kernel us per layer call, (plan us per step); a rule names vLLM's FA3 unless a FlashInfer "
          f"backend is {MIN_RATIO}x cheaper by its measure (per step: layers x kernel + plan)")
    for rule, mods in need.items():
        label = {"config": "the config as emitted", "kernel": "by kernel alone"}.get(rule, f"by step at {rule} layers")
        print(f"- FlashInfer prefill modules needed, {label}: {', '.join(sorted(mods)) or 'none'}")
    if args.write_config:
        print(f"wrote {write_variant(args.config, rechosen, layers[0], args.write_config)}")
    return 0


def write_variant(config: str, rechosen: dict, layers: int, folder: str):
    """`config` with each prefill bucket the sweep measured naming its per-step winner."""
    import dataclasses

    from vllm_metax.core import tuned_config as tc
    cfg = tc.read_tuned_config(config)
    models = []
    for m in cfg.models:
        buckets = []
        for b in m.prefill:
            key = (m.dims.num_heads, "causal" if b.causal else "context", b.query_tokens, b.kv_len)
            if key in rechosen:
                backend, t = rechosen[key]
                cost = lambda x: layers * x[0] + x[1]  # noqa: E731
                b = dataclasses.replace(b, params={"backend": backend}, time_us=t[backend][0],
                                        significant=backend != b.backend and
                                        cost(t[b.backend]) >= MIN_RATIO * cost(t[backend]))
            buckets.append(b)
        models.append(dataclasses.replace(m, prefill=tuple(buckets)))
    return tc.write_tuned_config(dataclasses.replace(cfg, models=tuple(models)), folder)


if __name__ == "__main__":
    raise SystemExit(main())
