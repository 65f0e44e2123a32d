"""End-to-end serving proof on a GPU: a tiny DeepSeek-V2-shaped model (MLA, dense MLP only) served
through vLLM's engine (`vllm.LLM`, in-process engine core) on the vllm_metax platform, greedy
tokens compared across attention backends and against a float32 torch forward of the same weights.

    VLLM_METAX_FORCE=1 python3 bench/serve_e2e.py --out DIR [--runs NAME,...]

Each run is its own process (one engine per process, as `vllm serve` has). The weights are real
(seeded, written as safetensors next to config.json), so the torch reference reads the same numbers;
the prompts are token ids (no tokenizer). Chunked prefill is on with a 256-token step budget, so
the longer prompts take several steps and continue cached context through the MLA prefill
backend's context-chunk path; the `*_smallws` run shrinks vLLM's context workspace to 128 rows so
a continuation spans several context chunks. Writes DIR/serve_e2e.json and DIR/serve_e2e.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_model import BASE_CONFIG, make_model_dir  # noqa: E402

CONFIG = BASE_CONFIG      # DeepSeek-V2's attention dims, 3 dense layers, vocabulary 2048
PROMPT_LENS = (700, 300, 37, 1100, 5)   # two above the 256-token step: chunked prefill
MAX_TOKENS = 24
MAX_MODEL_LEN = 2048
STEP_TOKENS = 256
TUNED_PAGE = 32

RUNS = {
    # name: (attention backend, cuda graphs, tuned config, small context workspace); tuned config:
    # False (none), "fa2" (write_fa2_config), "shipped" (the packaged configs/ folder, as a user
    # gets it: on the H200 its 16-head buckets of batch 1-2 decode with the split-KV kernel), "env"
    # (the folder $VLLM_METAX_MLA_CONFIG_FOLDER names); attention backend None: the platform's choice
    "flashinfer_eager": ("FLASHINFER_MLA", False, False, False),
    "flashinfer_graphs": ("FLASHINFER_MLA", True, False, False),
    "triton_eager": ("TRITON_MLA", False, False, False),
    "triton_graphs": ("TRITON_MLA", True, False, False),
    "flashinfer_tuned_fa2_page32": ("FLASHINFER_MLA", False, "fa2", False),
    "flashinfer_eager_smallws": ("FLASHINFER_MLA", False, False, True),
    "shipped_split_eager": ("FLASHINFER_MLA", False, "shipped", False),
    "shipped_split_graphs": ("FLASHINFER_MLA", True, "shipped", False),
    # the MetaX profile (#36, bench/tools/metax_profile_run.sh): the backend the config's order picks
    # (None: the platform decides) from the caller's $VLLM_METAX_MLA_CONFIG_FOLDER ("env"), and the
    # vendor's first MLA backend, FLASHMLA (KV block 64)
    "metax_tuned_eager": (None, False, "env", False),
    "metax_tuned_graphs": (None, True, "env", False),
    "flashmla_eager": ("FLASHMLA", False, False, False),
}
# decode batches of at most 2 in the shipped-config runs: the buckets its split kernel serves
MAX_SEQS = {"shipped_split_eager": 2, "shipped_split_graphs": 2}


# ----------------------------------------------------------------------------- model and prompts

def make_model(root: Path) -> Path:
    """config.json + seeded safetensors weights (`tiny_model.write_weights`: scaled so activations
    stay O(1) and greedy choices have margins well above bf16 noise) + a local tokenizer."""
    return make_model_dir(root / "tiny-deepseek-v2", CONFIG)


def prompts() -> list[list[int]]:
    import random
    rng = random.Random(7)
    return [[rng.randrange(2, CONFIG["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


# ----------------------------------------------------------------------------- torch reference

class Reference:
    """A torch forward of the tiny model from its safetensors (full causal attention, no KV
    cache), in float32 by default; `logits(seq)` gives the next-token logits at every position.
    `config`: another tiny model's (serve_bench's 27-layer ones; default CONFIG)."""

    def __init__(self, model_dir: Path, device="cuda", dtype=None, scale_dim: int | None = None,
                 window: int | None = None, config: dict | None = None):
        import torch
        from safetensors.torch import load_file

        self.torch = torch
        self.dtype = dtype or torch.float32
        self.device = device
        self.c = config or CONFIG
        # negative controls: the softmax scale of a wrong head dim; keys beyond a window dropped
        self.scale = (scale_dim or self.c["qk_nope_head_dim"] + self.c["qk_rope_head_dim"]) ** -0.5
        self.window = window
        self.score_elems = 1 << 29      # attention scores held at once (floats); rows chunked to fit
        self.w = {k: t.to(device, self.dtype) for k, t in
                  load_file(str(model_dir / "model.safetensors")).items()}
        rope = self.c["qk_rope_head_dim"]
        self.inv_freq = 1.0 / (self.c["rope_theta"] ** (
            torch.arange(0, rope, 2, device=device).float() / rope))

    def _rms(self, x, weight):
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"])
                ).to(self.dtype) * weight

    def _rotate(self, x, pos):   # GPT-J (interleaved) rotary, as vLLM's DeepSeek (is_neox_style=False)
        f = pos[:, None].float() * self.inv_freq[None]
        cos, sin = f.cos()[:, None, :].to(self.dtype), f.sin()[:, None, :].to(self.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return self.torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)

    def logits(self, ids):
        torch, w, c = self.torch, self.w, self.c
        heads, nope, rope, v, kvl = (c["num_attention_heads"], c["qk_nope_head_dim"],
                                     c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"])
        t = len(ids)
        pos = torch.arange(t, device=self.device)
        x = w["model.embed_tokens.weight"][torch.tensor(ids, device=self.device)]
        keys = torch.arange(t, device=self.device)
        # queries in chunks whose scores stay under 2 GiB (one chunk up to serve_e2e's lengths; a
        # 32K-token context at 128 heads takes 128 rows at a time)
        rows = max(1, self.score_elems // (heads * t))
        with torch.no_grad():
            for i in range(c["num_hidden_layers"]):
                p = f"model.layers.{i}."
                hn = self._rms(x, w[p + "input_layernorm.weight"])
                q = (hn @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, nope + rope)
                kv_a = hn @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
                kv_c = self._rms(kv_a[:, :kvl], w[p + "self_attn.kv_a_layernorm.weight"])
                k_pe = self._rotate(kv_a[:, None, kvl:], pos)
                q = torch.cat((q[..., :nope], self._rotate(q[..., nope:], pos)), -1)
                kv = (kv_c @ w[p + "self_attn.kv_b_proj.weight"].T).view(t, heads, nope + v)
                k = torch.cat((kv[..., :nope], k_pe.expand(t, heads, rope)), -1)
                o = torch.empty(t, heads * v, device=self.device, dtype=self.dtype)
                for lo in range(0, t, rows):
                    qpos = keys[lo:lo + rows, None]
                    mask = keys[None] <= qpos
                    if self.window is not None:
                        mask &= keys[None] > qpos - self.window
                    s = torch.einsum("qhd,khd->hqk", q[lo:lo + rows], k).float() * self.scale
                    s = s.masked_fill(~mask, float("-inf")).softmax(-1).to(self.dtype)
                    o[lo:lo + rows] = torch.einsum("hqk,khd->qhd", s, kv[..., nope:]).reshape(-1, heads * v)
                x = x + o @ w[p + "self_attn.o_proj.weight"].T
                hn = self._rms(x, w[p + "post_attention_layernorm.weight"])
                gate, up = hn @ w[p + "mlp.gate_proj.weight"].T, hn @ w[p + "mlp.up_proj.weight"].T
                x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
            return (self._rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T).float()

    def greedy(self, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(self.logits(seq)[-1].argmax()))
        return seq[len(prompt):]

    def deficits(self, prompt: list[int], tokens: list[int]) -> list[float]:
        """Teacher-forced on `tokens`: for each, how far its reference logit is below the
        reference's best at that position (0 where the reference agrees)."""
        lg = self.logits(list(prompt) + list(tokens)[:-1])[len(prompt) - 1:]
        chosen = lg.gather(1, self.torch.tensor(tokens, device=self.device)[:, None])[:, 0]
        return (lg.max(1).values - chosen).tolist()


def analyze(results: dict, model_dir: Path, device: str) -> dict:
    """Every run's tokens teacher-forced through the float32 reference (deficit per token), with
    the same reference computed in bfloat16 as the yardstick of what bf16 rounding alone does."""
    import torch

    ref = Reference(model_dir, device)
    ps = prompts()
    fp32 = [ref.greedy(p) for p in ps]
    bf16 = Reference(model_dir, device, torch.bfloat16)
    yard_tokens = [bf16.greedy(p) for p in ps]
    yard = [ref.deficits(p, t) for p, t in zip(ps, yard_tokens)]
    out = {"reference_tokens": fp32,
           "bf16_reference": {"equal_tokens": sum(a == b for x, y in zip(yard_tokens, fp32) for a, b in zip(x, y)),
                              "max_deficit": max(max(d) for d in yard)}}
    # what the check says of attention that is wrong the way a broken backend would be: the
    # 1/sqrt(576) scale (kv_lora_rank + rope instead of nope + rope), or a context chunk lost
    # (keys more than one 256-token step back unseen); both in bf16, like the engine
    controls = {"scale_1/sqrt(576)": dict(scale_dim=CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"]),
                f"context_window_{STEP_TOKENS}": dict(window=STEP_TOKENS)}
    out["negative_controls"] = {}
    for cname, kw in controls.items():
        bad = Reference(model_dir, device, torch.bfloat16, **kw)
        d = [x for p in ps for x in ref.deficits(p, bad.greedy(p))]
        out["negative_controls"][cname] = {"max_deficit": max(d), "argmax_agree": sum(x == 0.0 for x in d),
                                           "tokens": len(d)}
    for name, rec in results["runs"].items():
        if "tokens" not in rec:
            continue
        d = [ref.deficits(p, t) for p, t in zip(ps, rec["tokens"])]
        flat = [x for row in d for x in row]
        rec["teacher_forced"] = {
            "argmax_agree": sum(x == 0.0 for x in flat), "tokens": len(flat),
            "max_deficit": max(flat), "mean_deficit": sum(flat) / len(flat),
            "equal_to_greedy_reference": sum(a == b for x, y in zip(rec["tokens"], fp32) for a, b in zip(x, y))}
    results["analysis"] = out
    return results


# ----------------------------------------------------------------------------- one engine run

def run_engine(name: str, model_dir: Path, out_json: Path) -> None:
    backend, graphs, tuned, small_ws = RUNS[name]
    os.environ.setdefault("VLLM_METAX_FORCE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # engine core in this process
    record = {"name": name, "backend": backend, "cuda_graphs": graphs, "tuned": tuned}
    if tuned == "fa2":
        folder = out_json.parent / f"tuned-{name}"
        write_fa2_config(folder)
        os.environ["VLLM_METAX_MLA_CONFIG_FOLDER"] = str(folder)
    elif tuned == "shipped":
        from vllm_metax.core import tuned_config as tc
        os.environ.pop(tc.FOLDER_ENV, None)      # the packaged folder, nothing else
        record["config_folder"] = str(tc.PACKAGED_FOLDER)
    elif tuned == "env":
        from vllm_metax.core import tuned_config as tc
        record["config_folder"] = os.environ.get(tc.FOLDER_ENV)
        record["profile"] = os.environ.get("VLLM_METAX_PROFILE")
    if small_ws:
        from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
        MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size = staticmethod(lambda cfg: 128)
        record["context_workspace_rows"] = 128

    planned = record.setdefault("decode_plans", {})
    prefill_plans = record.setdefault("prefill_plans", {})
    from vllm_metax.ops import flashinfer_mla as op
    from vllm_metax.ops import flashinfer_prefill as pop
    orig_plan, orig_pplan = op.MLADecodeKernel.plan, pop.MLAPrefillKernel.plan

    def plan(self, *a, **k):
        planned[self.backend] = planned.get(self.backend, 0) + 1
        return orig_plan(self, *a, **k)

    def pplan(self, *a, **k):
        key = f"{self.backend}/{'causal' if a[5] else 'context'}"
        prefill_plans[key] = prefill_plans.get(key, 0) + 1
        return orig_pplan(self, *a, **k)

    op.MLADecodeKernel.plan, pop.MLAPrefillKernel.plan = plan, pplan
    # the split-KV decode kernel's launches that Python sees (eager steps, graph captures)
    from vllm_metax.ops import split_decode as sd
    orig_split = sd.SplitDecode.run

    def split_run(self, *a, **k):
        # the pipe where it is not t64 (64-token tiles, 2 stages, no PDL)
        pipe = "".join((f"/bn{self.block_n}st{self.num_stages}" if (self.block_n, self.num_stages) != (64, 2) else "",
                        "/pdl" if self.pdl else ""))
        key = f"split/S{self.num_splits}/{self.load}{pipe}"
        planned[key] = planned.get(key, 0) + 1
        return orig_split(self, *a, **k)

    sd.SplitDecode.run = split_run

    from vllm import LLM, SamplingParams
    kw = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=STEP_TOKENS, max_num_seqs=MAX_SEQS.get(name, 8),
              gpu_memory_utilization=0.25, attention_backend=backend, seed=0,
              enable_prefix_caching=False)
    if graphs:
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": [1, 2, 4, 8][:2 if name in MAX_SEQS else 4]}
    else:
        kw["enforce_eager"] = True
    t0 = time.perf_counter()
    llm = LLM(**kw)
    record["startup_s"] = round(time.perf_counter() - t0, 1)
    cache = llm.llm_engine.vllm_config.cache_config
    record["block_size"] = cache.block_size
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], sp, use_tqdm=False)
    record["generate_s"] = round(time.perf_counter() - t0, 2)
    record["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    out_json.write_text(json.dumps(record))


def write_fa2_config(folder: Path) -> None:
    """A tuned config for this model on this device that names fa2 everywhere and page 32."""
    from vllm_metax.core import tuned_config as tc
    from vllm_metax.core.device import detect_device

    dims = tc.ModelDims(CONFIG["num_attention_heads"], CONFIG["kv_lora_rank"],
                        CONFIG["qk_rope_head_dim"])
    buckets = [tc.Bucket(b, ctx, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa2"})})
               for b in (1, 2, 4, 8) for ctx in (64, 512, 2048)]
    entry = tc.ModelEntry(dims, TUNED_PAGE, ["FLASHINFER_MLA", "TRITON_MLA"], buckets)
    tc.write_tuned_config(tc.TunedConfig(detect_device().name, {"bench": "serve_e2e"}, [entry]), folder)


# ----------------------------------------------------------------------------- driver

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--analyze", type=Path, help="re-analyse a serve_e2e.json (no engine runs)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.run:
        run_engine(a.run, a.model, a.out / f"{a.run}.json")
        return 0
    model_dir = make_model(Path("/tmp/serve_e2e"))
    if a.analyze:
        import torch
        results = json.loads(a.analyze.read_text())
        analyze(results, model_dir, "cuda" if torch.cuda.is_available() else "cpu")
        write_results(results, a.out)
        return 0 if verdict(results) else 1
    work = Path("/tmp/serve_e2e/runs")          # per-run files; only the summary goes to --out
    work.mkdir(parents=True, exist_ok=True)
    results = {"config": CONFIG, "prompt_lens": PROMPT_LENS, "max_tokens": MAX_TOKENS,
               "step_tokens": STEP_TOKENS, "runs": {}}
    for name in a.runs.split(","):
        t0 = time.perf_counter()
        log = work / f"{name}.log"
        rec_path = work / f"{name}.json"
        rec_path.unlink(missing_ok=True)
        with open(log, "w") as f:
            try:
                rc = subprocess.run([sys.executable, __file__, "--out", str(work), "--run", name,
                                     "--model", str(model_dir)], stdout=f, stderr=subprocess.STDOUT,
                                    timeout=a.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        rec = json.loads(rec_path.read_text()) if rc == 0 and rec_path.exists() else {
            "name": name, "error": f"rc {rc}", "log_tail": log.read_text()[-3000:]}
        rec["wall_s"] = round(time.perf_counter() - t0, 1)
        results["runs"][name] = rec
        print(name, {k: rec.get(k) for k in ("error", "block_size", "decode_plans", "prefill_plans",
                                              "startup_s", "wall_s")}, flush=True)
        if "error" in rec:
            print(rec["log_tail"][-2500:], flush=True)
            if len(results["runs"]) == 1:     # the first engine did not serve: the rest would not
                break
    import torch
    analyze(results, model_dir, "cuda" if torch.cuda.is_available() else "cpu")
    write_results(results, a.out)
    return 0 if verdict(results) else 1


def verdict(results: dict) -> bool:
    """Every run served every request, and no token it chose is further below the float32
    reference's best than bf16 rounding alone puts the bf16 reference (with 2x headroom)."""
    limit = 2 * max(results["analysis"]["bf16_reference"]["max_deficit"], 0.05)
    return all("teacher_forced" in r and r["teacher_forced"]["max_deficit"] <= limit
               for r in results["runs"].values())


def write_results(results: dict, out: Path) -> None:
    (out / "serve_e2e.json").write_text(json.dumps(results, indent=1))
    an = results["analysis"]["bf16_reference"]
    lines = [f"bf16 torch reference vs float32 reference: {an['equal_tokens']} equal greedy tokens, "
             f"max teacher-forced deficit {an['max_deficit']:.3f}", "",
             "| run | KV block | decode plans | prefill plans | = fp32 greedy | teacher-forced argmax | max deficit |",
             "|---|---|---|---|---|---|---|"]
    for name, rec in results["runs"].items():
        if "tokens" not in rec:
            lines.append(f"| {name} | - | - | - | {rec.get('error')} | - | - |")
            continue
        tf = rec["teacher_forced"]
        lines.append(f"| {name} | {rec['block_size']} | {rec['decode_plans']} | {rec['prefill_plans']} | "
                     f"{tf['equal_to_greedy_reference']}/{tf['tokens']} | {tf['argmax_agree']}/{tf['tokens']} | "
                     f"{tf['max_deficit']:.3f} |")
    lines.append("")
    for cname, c in results["analysis"].get("negative_controls", {}).items():
        lines.append(f"negative control {cname} (bf16 torch, wrong on purpose): teacher-forced argmax "
                     f"{c['argmax_agree']}/{c['tokens']}, max deficit {c['max_deficit']:.3f}")
    lines.append("")
    lines.append(f"verdict: {'PASS' if verdict(results) else 'FAIL'} (limit: max deficit <= "
                 f"{2 * max(an['max_deficit'], 0.05):.3f}, twice the bf16 reference's)")
    (out / "serve_e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
