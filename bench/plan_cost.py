"""Per-step CPU cost of the plugin's FLASHINFER_MLA plan path against a bare FlashInfer plan().

Once per decode step vLLM calls the metadata builder; ours turns the block table into CSR metadata
(`build_paged_metadata`), looks the step up in the tuned config and plans FlashInfer. This measures,
per batch size (B = 1, 32, 128) and heads per rank (16, 128), at a ragged context around 4096 and
page size 64:

  wrapper.plan       FlashInfer's BatchMLAPagedAttentionWrapper.plan(metadata=csr(...)) alone,
                     metadata prebuilt (what a naive backend pays per step)
  op.plan            vllm_metax.ops.flashinfer_mla.MLADecodeKernel.plan, metadata prebuilt
  native_plan        the schedule + its upload alone, as the fast re-plan makes them (numpy
                     schedule from B = 16, FlashInfer's compiled MLAPlan below)
                     (the floor of the re-plan)
  paged_metadata     build_paged_metadata alone, compact (block table -> CSR on the GPU, no sync)
  paged_strided      build_paged_metadata(compact=False): the block table itself as the page list
                     (what the plugin's eager steps hand to the fast re-plan)
  build_decode       the builder's _build_decode: metadata + tuned lookup + plan (eager wrapper),
                     decode steps: every request one token longer than the step before
  build_decode_fresh the same with a new random batch every step (no schedule to reuse)
  build_decode_graph the same as build_decode into a CUDA-graph wrapper's persistent buffers
  forward_mqa        the impl's per-layer call (CPU side of one eager kernel launch)
  lookup             PlanChoice.for_step on a 2 x 9 x 10-bucket tuned config (CPU only)

Each step is timed on the host with the GPU drained before it (torch.cuda.synchronize() outside
the timed region), so queueing never hides or adds CPU time. Run on the GPU machine:

    source .carry/device-env.sh && VLLM_METAX_FORCE=1 python3 bench/plan_cost.py --out $OUT

It writes plan_cost.json (raw percentiles and the environment) and plan_cost.md. Without a GPU only
`lookup` and `paged_metadata` (on the CPU) are measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))          # plugin_support: the VllmConfig / layer set-up
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BATCHES = (1, 32, 128)
HEADS = (16, 128)
CONTEXT = 4096
PAGE = 64
TARGET_MS = 0.25                                  # build + plan, p50 at B = 128


def _stats(samples_ns: list[int]) -> dict:
    us = sorted(s / 1e3 for s in samples_ns)
    q = statistics.quantiles(us, n=10)
    return {"p50_us": statistics.median(us), "p10_us": q[0], "p90_us": q[-1],
            "mean_us": statistics.fmean(us), "n": len(us)}


def _time(fn, n: int, warmup: int = 5, sync: bool = True) -> dict:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return _stats(out)


def _write_tuned_config(folder: Path, device_name: str, heads: tuple) -> None:
    from vllm_metax.core import tuned_config as tc

    models = []
    for h in heads:
        buckets = [tc.Bucket(b, c, q, {"flashinfer": tc.FamilyChoice({"backend": "fa3"}, 10.0, 20.0, True),
                                       "triton": tc.FamilyChoice({"num_kv_splits": 8}, 30.0, 40.0, True)},
                             "flashinfer")
                   for q in (1, 2) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)
                   for c in (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)]
        models.append(tc.ModelEntry(tc.ModelDims(h, 512, 64), PAGE, ["FLASHINFER_MLA", "TRITON_MLA"],
                                    buckets, "bench", 1))
    tc.write_tuned_config(tc.TunedConfig(device_name, {"bench": True}, models), folder)


def measure_lookup() -> dict:
    from vllm_metax.backend.plan_choice import PlanChoice
    from vllm_metax.core import decisions, serving, tuned_config as tc

    with tempfile.TemporaryDirectory() as d:
        _write_tuned_config(Path(d), "bench", (16,))
        cfg = tc.read_tuned_config(Path(d) / tc.config_filename("bench"))
    choice = PlanChoice(serving.entry_for(cfg, tc.ModelDims(16, 512, 64)).entry,
                        decisions.flashinfer_backends(False, (9, 0)))
    args = [(b, c) for b in (1, 3, 32, 100, 128) for c in (70, 1000, 4096, 5000, 60000)]
    n = 20000
    t0 = time.perf_counter_ns()
    for i in range(n):
        choice.for_step(*args[i % len(args)])
    per_call = (time.perf_counter_ns() - t0) / n / 1e3
    raw = _time(lambda: choice.for_step(37, 3000), 2000, sync=False)
    return {"mean_us_mixed_keys": per_call, **raw}


def profile_rows(heads: int, batch: int, what: str, fn, out: list, n: int = 200) -> None:
    """cProfile of n steps: where the CPU time of one step goes (top functions by own time)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    st = pstats.Stats(pr)
    top = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:14]
    for (file, line, func), (_, nc, tt, ct, _) in top:
        out.append({"heads": heads, "batch": batch, "what": what,
                    "function": f"{Path(file).name}:{line}({func})",
                    "calls_per_step": nc / n, "own_us_per_step": tt / n * 1e6,
                    "cum_us_per_step": ct / n * 1e6})


def measure_gpu(heads: int, base_config, rows: list, profile: bool = False,
                rows_profile: list | None = None) -> None:
    from vllm.config import CacheConfig, CompilationConfig, VllmConfig

    import plugin_support as ps
    from vllm_metax.ops import fast_replan as fr, flashinfer_mla as op
    from vllm_metax.ops.paged_metadata import build_paged_metadata

    def config(graph):
        return VllmConfig(model_config=base_config.model_config, cache_config=CacheConfig(block_size=PAGE),
                          compilation_config=CompilationConfig(
                              cudagraph_mode="FULL_AND_PIECEWISE" if graph else "PIECEWISE",
                              cudagraph_capture_sizes=[1, 32, 128]))

    builder = ps.make_builder(config(False), device="cuda")
    graph_builder = ps.make_builder(config(True), device="cuda")
    impl = ps.make_impl(config(False), num_heads=heads)
    assert builder.num_heads == heads and builder.choice.entry is not None, "tuned entry missing"
    api = op.flashinfer_api()
    ws = op.make_workspace("cuda")
    for batch in BATCHES:
        g = torch.Generator().manual_seed(batch)
        seq_lens = torch.randint(CONTEXT // 2, CONTEXT * 3 // 2, (batch,), generator=g).tolist()
        bt, lens, common, num_pages = ps.ragged_batch(seq_lens, PAGE, device="cuda", seed=batch)
        meta = build_paged_metadata(bt[:batch], lens, PAGE)
        scale = ps.softmax_scale()
        plan_kw = dict(num_heads=heads, head_dim_ckv=512, head_dim_kpe=64, page_size=PAGE, causal=False,
                       sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

        wrapper = api.wrapper_cls(ws, backend="fa3")
        csr = api.plan_metadata_cls.csr(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_len)
        bare = _time(lambda: wrapper.plan(metadata=csr, query_layout="split", kv_cache_layout="split",
                                          **plan_kw), 100)
        kernel = op.MLADecodeKernel(ws, "fa3")
        via_op = _time(lambda: kernel.plan(meta, heads, 512, 64, PAGE, False, scale, torch.bfloat16,
                                           torch.bfloat16), 100)
        be = kernel.wrapper._planned_backend
        native = _time(lambda: fr.plan_schedule(be, meta, heads, 512, False), 200)
        paged = _time(lambda: build_paged_metadata(bt[:batch], lens, PAGE), 200)
        strided = _time(lambda: build_paged_metadata(bt[:batch], lens, PAGE, compact=False), 200)

        max_len = max(seq_lens)          # vLLM passes it in; not part of the step's cost

        def build(b=builder):
            return b._build_decode(bt[:batch], common.seq_lens, max_len, common.query_start_loc_cpu,
                                   common.query_start_loc, batch, 1, None)
        # decode: every request gains a token per step (what the schedule reuse relies on); and
        # a fresh ragged batch every step (nothing reusable: continuous batching's worst case)
        growing = [dataclasses.replace(common, seq_lens_cpu_upper_bound=lens + i) for i in range(64)]
        fresh = [dataclasses.replace(common, seq_lens_cpu_upper_bound=torch.randint(
            CONTEXT // 2, max(seq_lens) + 1, (batch,), generator=g, dtype=torch.int32)) for _ in range(64)]
        step = [0]

        def build_step(b, batches):
            b._common = batches[step[0] % len(batches)]
            step[0] += 1
            return build(b)
        build_eager = _time(lambda: build_step(builder, growing), 500)
        build_fresh = _time(lambda: build_step(builder, fresh), 500)
        builder._common = common
        if profile and batch == BATCHES[-1]:
            profile_rows(heads, batch, "build_decode", build, rows_profile)
            profile_rows(heads, batch, "op.plan", lambda: kernel.plan(
                meta, heads, 512, 64, PAGE, False, scale, torch.bfloat16, torch.bfloat16), rows_profile)
        graph_builder._common = common
        md_graph = build(graph_builder)
        assert md_graph.cuda_graph, "graph path not taken"
        build_graph = _time(lambda: build_step(graph_builder, growing), 500)
        builder._common = graph_builder._common = None

        md = build()
        assert md.backend == "fa3" and md.kernel.resolved_backend == "fa3"
        fast = md.kernel.fast_replans
        q = torch.randn(batch, heads, 576, dtype=torch.bfloat16, device="cuda")
        kv = torch.randn(num_pages, PAGE, 576, dtype=torch.bfloat16, device="cuda")
        holder = type("M", (), {"decode": md})
        fwd = _time(lambda: impl.forward_mqa((q[..., :512], q[..., 512:]), kv, holder, None), 200)
        for name, st in (("wrapper.plan", bare), ("op.plan", via_op), ("native_plan", native),
                         ("paged_metadata", paged),
                         ("paged_strided", strided),
                         ("build_decode", build_eager),
                         ("build_decode_fresh", build_fresh),
                         ("build_decode_graph", build_graph),
                         ("forward_mqa", fwd)):
            rows.append({"heads": heads, "batch": batch, "context": CONTEXT, "page_size": PAGE,
                         "what": name, **st,
                         **({"fast_plans": fast} if name == "build_decode" else {})})
        print(f"H{heads} B{batch}: wrapper.plan p50 {bare['p50_us']:.1f} us, build_decode p50 "
              f"{build_eager['p50_us']:.1f} us (graph {build_graph['p50_us']:.1f} us), "
              f"forward_mqa {fwd['p50_us']:.1f} us", flush=True)


def measure_cpu_metadata(rows: list) -> None:
    from vllm_metax.ops.paged_metadata import build_paged_metadata
    import plugin_support as ps

    for batch in BATCHES:
        seq_lens = [CONTEXT] * batch
        bt, lens, _, _ = ps.ragged_batch(seq_lens, PAGE)
        st = _time(lambda: build_paged_metadata(bt[:batch], lens, PAGE), 500, sync=False)
        rows.append({"heads": None, "batch": batch, "context": CONTEXT, "page_size": PAGE,
                     "what": "paged_metadata (cpu)", **st})


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = ["# Plan cost per decode step (CPU time, microseconds)", "",
             f"{env.get('device_name')} · torch {env.get('torch')} · flashinfer {env.get('flashinfer')} · "
             f"vllm {env.get('vllm')} · host {env.get('host')} · context ~{CONTEXT} (ragged), page {PAGE}",
             "", "| heads | batch | what | p50 | p10 | p90 | mean |", "|---:|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['heads'] or '-'} | {r['batch']} | {r['what']} | {r['p50_us']:.1f} | "
                     f"{r['p10_us']:.1f} | {r['p90_us']:.1f} | {r['mean_us']:.1f} |")
    lk = result["lookup"]
    lines += ["", f"Tuned-config lookup (PlanChoice.for_step): p50 {lk['p50_us']:.2f} us, "
              f"mean over mixed keys {lk['mean_us_mixed_keys']:.2f} us (budget 5 us)."]
    if result.get("profile"):
        lines += ["", "Where one step's CPU time goes (cProfile, own time; profiling inflates Python):", "",
                  "| heads | batch | profiled | function | calls/step | own us/step | cum us/step |",
                  "|---:|---:|---|---|---:|---:|---:|"]
        for p in result["profile"]:
            lines.append(f"| {p['heads']} | {p['batch']} | {p['what']} | `{p['function']}` | {p['calls_per_step']:.0f} | "
                         f"{p['own_us_per_step']:.1f} | {p['cum_us_per_step']:.1f} |")
    verdicts = result.get("verdicts", [])
    if verdicts:
        lines += ["", *[f"- {v}" for v in verdicts]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results", help="folder for plan_cost.json / .md")
    ap.add_argument("--profile", action="store_true", help="also cProfile build_decode at B=128")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from mla_tune.measure.environment import capture_environment

    rows: list = []
    profile: list = []
    result = {"rows": rows, "lookup": measure_lookup(), "profile": profile}
    print(f"lookup p50 {result['lookup']['p50_us']:.2f} us", flush=True)
    if torch.cuda.is_available():
        os.environ.setdefault("VLLM_METAX_FORCE", "1")
        import plugin_support as ps
        from vllm_metax.core.device import detect_device

        folder = Path(tempfile.mkdtemp(prefix="plan-cost-"))
        _write_tuned_config(folder, detect_device().name, HEADS)
        os.environ["VLLM_METAX_MLA_CONFIG_FOLDER"] = str(folder)
        for heads in HEADS:
            base = ps.make_vllm_config(folder / "model", num_attention_heads=heads,
                                       num_key_value_heads=heads)
            measure_gpu(heads, base, rows, args.profile, profile)
        result["environment"] = capture_environment("gpu", "bench/plan_cost.py")
        verdicts = []
        for r in rows:
            if r["what"] == "build_decode" and r["batch"] == 128:
                ok = r["p50_us"] <= TARGET_MS * 1e3
                verdicts.append(f"H{r['heads']} B128 build+plan p50 {r['p50_us']:.0f} us: "
                                f"{'meets' if ok else 'misses'} the {TARGET_MS} ms target")
        lk = result["lookup"]["p50_us"]
        verdicts.append(f"lookup p50 {lk:.2f} us: {'within' if lk <= 5 else 'over'} the 5 us budget")
        result["verdicts"] = verdicts
    else:
        measure_cpu_metadata(rows)
        result["environment"] = capture_environment("cpu-reference", "bench/plan_cost.py")
    (out / "plan_cost.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "plan_cost.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
