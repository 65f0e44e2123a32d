"""What a MetaX-profile tuned config buys against the vendor plugin's own default (issue #36).

    # on the GPU, with VLLM_METAX_PROFILE=metax and FlashInfer 0.2.6 (bench/tools/metax_profile_run.sh)
    python3 bench/metax_vs_vendor.py --db metax.db --config configs/device_name=X.json --out $OUT --name metax_vs_vendor_h100

The vendor's vLLM-metax platform tries FLASHMLA first (dense FlashMLA, KV block forced to 64), then
TRITON_MLA (vLLM's Triton MLA decode with the vendor's hard-coded launch: BLOCK 16, one stage, no
512+64 head split; `vllm_metax.core.triton_facts`); FLASHINFER_MLA is commented out. So a MetaX
user's baseline is FlashMLA at block 64 where the `flash_mla` package loads, else that Triton.

For every decode bucket of `--db` (q_len 1, uniform and ragged), one interleaved measurement through
the tuner's harness (`measure_interleaved`: correctness gate against the torch reference, CUDA-graph
replays, cold L2) of:

* tuned: what the plugin serves under the metax profile from `--config`: the entry's first backend
  that runs here decides. FLASHMLA: FlashMLA every step; TRITON_MLA: the nearest bucket's Triton
  choice (split count, launch) within its context window, else vLLM's rule (`decisions.decode_kernel`);
  FLASHINFER_MLA: what its decode plans for the batch
  (`tuned_vs_auto.served_candidate`: the split kernel, FlashMLA, or FlashInfer fa2 and its KV
  chunking);
* vendor: FlashMLA at page 64, the vendor's first MLA backend (where FlashMLA loads);
* vendor_triton: vLLM's Triton kernels with the vendor's launch and vLLM's split rule at block 16,
  what the vendor serves where FlashMLA is absent;
* fa2_auto: FlashInfer fa2 at page 64 through FlashInfer's own plan() every step.

Geomeans (all, uniform, ragged, 16 and 128 heads) of each baseline's time over tuned's. NVIDIA
silicon stands in for the MetaX GPU: the profile limits the kernels to what the target runs, the
timings are the stand-in's. Writes <out>/<name>.{json,md}.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tuned_vs_auto import (  # noqa: E402
    _gmean, bench_parser, cell, measure_rows, report_head, say, served_candidate, write_report,
)

COLUMNS = ("tuned", "vendor", "vendor_triton", "fa2_auto")
VENDOR_TRITON_PAGE = 16      # vLLM's default KV block size, which the vendor's TRITON_MLA keeps
from vllm_metax.core.choices import FLASHMLA, SPECS  # noqa: E402

FLASHMLA_PAGE = SPECS[FLASHMLA].page.only      # FlashMLA's one KV block size
GROUPS = {"all": lambda r: True, "uniform": lambda r: r["lengths"] == "uniform",
          "ragged": lambda r: r["lengths"] != "uniform",
          "16 heads": lambda r: r["heads"] == 16, "128 heads": lambda r: r["heads"] == 128}


def tuned_candidate(entry, families: dict, backends, workload):
    """The candidate the plugin serves for `workload` under the metax profile: the entry's first
    backend that can run here decides (as the platform's backend order does)."""
    from mla_tune.families.base import Candidate
    from vllm_metax.backend.plan_choice import PlanChoice
    from vllm_metax.core import choices, decisions
    from vllm_metax.core.serving import mla_backend_order
    from vllm_metax.core.choices import FLASHMLA_BACKEND, TRITON_BACKEND
    order, _ = mla_backend_order(entry.backend_order if entry is not None else None)
    runnable = [b for b in order if b != "FLASHMLA" or families["flashmla_ok"]]
    first = runnable[0] if runnable else "TRITON_MLA"
    if first == "FLASHMLA":
        return Candidate("flashmla", FLASHMLA_BACKEND, FLASHMLA_PAGE, {})
    if first == "TRITON_MLA":
        # the server's rule for this batch (`decisions.decode_kernel`): the nearest bucket's split
        # count within its context window, else vLLM's rule for the batch; the launch it serves
        step = decisions.DecodeStep(workload.batch_size, decisions.bucket_context(workload.seq_lens),
                                    workload.q_len)
        served = decisions.decode_kernel(entry, step, attention_backend="TRITON_MLA").choice
        page = entry.page_size if entry is not None else VENDOR_TRITON_PAGE
        if not served.vllm_rule:
            params = served.to_params()
            params.pop("backend", None)
            return Candidate("triton", TRITON_BACKEND, page, params)
        params = dict(families["triton"].default_candidate(workload, page).params)
        params.pop("variant", None)
        if served.variant != choices.DEFAULT_TRITON_VARIANT:
            params["variant"] = served.variant
        return Candidate("triton", TRITON_BACKEND, page, params)
    page = entry.page_size if entry is not None else FLASHMLA_PAGE
    return served_candidate(PlanChoice(entry, backends), page, workload)


def measure_all(args) -> dict:
    from mla_tune.families.base import Candidate
    from mla_tune.families.flashinfer import FlashInferFamily
    from mla_tune.families.flashmla import FlashMLAFamily
    from mla_tune.families.split import SplitFamily
    from mla_tune.families.triton_mla import TritonMLAFamily
    from mla_tune.measure.environment import capture_environment
    from mla_tune.measure.timing import default_pool_bytes
    from mla_tune.measure.trial import MeasureSettings
    from vllm_metax.core import choices, decisions, serving
    from vllm_metax.ops import device_backends
    from vllm_metax.core.profile import active_profile
    from vllm_metax.core.tuned_config import read_tuned_config

    env = capture_environment("gpu", " ".join(sys.argv))
    prof = active_profile()
    cfg = read_tuned_config(args.config)
    backends = device_backends.device_flashinfer_backends()
    say(f"device {env['device_name']}, torch {env['torch']}, flashinfer {env['flashinfer']}, profile "
        f"{prof.name}; FlashInfer backends {backends.allowed}; config {args.config} ({len(cfg.models)} entries)")
    fi, auto_fi, tr, fm = FlashInferFamily(), FlashInferFamily(fast_replan=False), TritonMLAFamily(), FlashMLAFamily()
    fm_ok = fm.available("cuda")
    say(f"FlashMLA: {'yes' if fm_ok.ok else 'no'} ({fm_ok.reason})")
    families = {"flashinfer": fi, "triton": tr, "flashmla": fm, choices.SPLIT: SplitFamily(),
                "flashmla_ok": fm_ok.ok}
    settings = MeasureSettings(device="cuda", warmup=args.warmup, samples=args.samples,
                               min_pool_bytes=default_pool_bytes("cuda"), check=True)
    doc = {"environment": env, "profile": prof.name, "config": str(args.config), "settings": vars(args),
           "rows": [], "skipped": []}
    def plan(w):
        dims = decisions.model_key(w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim, w.q_dtype, w.kv_dtype)
        entry = serving.entry_for(cfg, dims).entry
        tuned = tuned_candidate(entry, families, backends, w)
        named = [("tuned", (families.get(tuned.family, fi), tuned))]
        if fm_ok.ok:
            named.append(("vendor", (fm, Candidate("flashmla", fm.default_candidate(w).backend, FLASHMLA_PAGE, {}))))
        named += [("vendor_triton", (tr, tr.default_candidate(w, VENDOR_TRITON_PAGE))),
                  ("fa2_auto", (auto_fi, Candidate("flashinfer", "fa2", FLASHMLA_PAGE)))]
        return {"tuned": tuned.key, "in_config": entry is not None}, named

    measure_rows(args, settings, doc, plan)
    return doc


def baseline_us(row: dict) -> float | None:
    """The vendor's default for this bucket: FlashMLA where it ran, else its Triton."""
    return row.get("vendor_us") or row.get("vendor_triton_us")


def summarize(doc: dict) -> dict:
    rows = [r for r in doc["rows"] if r.get("tuned_us") and baseline_us(r)]
    s = {"buckets": len(rows), "skipped": len(doc["skipped"]),
         "counts": {k: sum(1 for r in rows if f(r)) for k, f in GROUPS.items()}}
    for name in ("vendor_default", *COLUMNS[1:]):
        key = baseline_us if name == "vendor_default" else (lambda r, n=name: r.get(f"{n}_us"))
        s[f"over_{name}"] = {k: _gmean([key(r) / r["tuned_us"] for r in rows if f(r) and key(r)])
                             for k, f in GROUPS.items()}
    ratios = [(r["workload"], baseline_us(r) / r["tuned_us"]) for r in rows]
    s["slower_than_vendor"] = [w for w, x in ratios if x < 0.97]
    s["faster_than_vendor"] = [w for w, x in ratios if x > 1.03]
    return s


def render(doc: dict, s: dict) -> str:
    env, f = doc["environment"], cell
    lines = report_head(
        f"MetaX profile: tuned vs the vendor plugin's default ({env['device_name']} standing in)", doc,
        f"NVIDIA silicon stands in for the MetaX GPU: the `{doc['profile']}` profile limits every "
        "kernel to what the target runs (FlashInfer fa2 through the flat API, no TMA/PDL, FlashMLA "
        "dense at page 64, the vendor's Triton launch); the times are this GPU's. torch "
        f"{env['torch']}, flashinfer {env['flashinfer']}, config `{doc['config']}`. "
        f"{s['buckets']} buckets measured, {s['skipped']} skipped (time budget).") + ["",
             "vendor default = FlashMLA at block 64 where it ran, else vLLM's Triton with the vendor's launch "
             "at block 16. Each cell: the baseline's time over tuned's (geomean; > 1: tuned faster).", "",
             "| group | buckets | vs vendor default | vs FlashMLA p64 | vs vendor Triton p16 | vs FlashInfer fa2 plan() p64 |",
             "|---|---|---|---|---|---|"]
    for k in GROUPS:
        lines.append(f"| {k} | {s['counts'][k]} | {f(s['over_vendor_default'][k], 3)}x | "
                     f"{f(s['over_vendor'][k], 3)}x | {f(s['over_vendor_triton'][k], 2)}x | "
                     f"{f(s['over_fa2_auto'][k], 3)}x |")
    lines += ["", f"Tuned slower than the vendor default beyond 3%: {len(s['slower_than_vendor'])} buckets"
              + (f" ({', '.join(s['slower_than_vendor'])})" if s['slower_than_vendor'] else "")
              + f"; faster beyond 3%: {len(s['faster_than_vendor'])}.", "",
              "| bucket | lengths | tuned candidate | tuned us | FlashMLA p64 us | vendor Triton us | fa2 plan() us "
              "| vs vendor default |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        t, b = r.get("tuned_us"), baseline_us(r)
        lines.append(f"| {r['workload']} | {r['lengths']} | {r['tuned']} | {f(t, 1)} | {f(r.get('vendor_us'), 1)} | "
                     f"{f(r.get('vendor_triton_us'), 1)} | {f(r.get('fa2_auto_us'), 1)} | "
                     f"{f(b / t if t and b else None)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = bench_parser(__doc__, "metax_vs_vendor", "the metax-profile tuned config", samples=15, rounds=3,
                      budget_s=120.0)
    args = ap.parse_args()
    if not args.analyze:
        import torch
        if not torch.cuda.is_available():
            ap.error("needs a CUDA GPU, and torch sees none here: run it on the GPU machine")
        if not args.config:
            ap.error("--config: the metax-profile tuned config to compare")
        os.environ.setdefault("VLLM_METAX_PROFILE", "metax")      # the profile the comparison is about
    return write_report(args, measure_all, summarize, render)


if __name__ == "__main__":
    sys.exit(main())
