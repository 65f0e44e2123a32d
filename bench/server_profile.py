"""A torch profile of a running `vllm serve` (issue #35: where a serving goal is missed, say why from
a profile): the server runs with vLLM's torch profiler configured (`profiler_args`: vLLM's
--profiler-config, which also opens its /start_profile and /stop_profile endpoints), long-context
requests are sent, and once every one of them is decoding (its first token streamed) a window of
decode steps is profiled through those endpoints (`profile_decode`). The traces' GPU kernels are
then summed (`kernel_summary`): per decode step, how much GPU time the attention decode kernels
take, how much the KV-cache writes, how much everything else (GEMMs, norms, rotary, sampling).

    python3 bench/serve_bench.py --profile ...      # each setup's server is profiled after its workloads

The host side of the same steps (`host_summary`): vLLM's worker annotates every step it executes
(`execute_context_<n>(<tokens>)_generation_<n>(<tokens>)`), so the decode-only steps' host time
in `execute_model` is read from the trace; with the Python tracer on (`profiler_args(...,
with_stack=True)`, serve_bench --profile-stack) also the part spent building the attention
metadata (the MLA builders' `build`: vLLM's common one and the plugin's, where the plugin plans
its decode) and in the plugin's code at all. The Python tracer slows the host, so those figures
are upper bounds; the plain `execute_model` time is taken without it.

Kernel names are classified by `ATTENTION` and `CACHE_WRITE` (FlashInfer's MLA kernels, vLLM's
Triton MLA stages, FA3, FlashMLA, the plugin's split kernel and its merge); the summary lists the
top kernels by time with their class, so a misclassified name is visible in the results.
"""

from __future__ import annotations

import gzip
import json
import re
import threading
import time
import urllib.request
from pathlib import Path

# decode attention kernels: FlashInfer's MLA (fa2 "BatchMLAPagedAttentionKernel", fa3
# "...Hopper..."), vLLM's Triton MLA (`_fwd_grouped_kernel_stage1`, `_fwd_kernel_stage2`), FA3
# (`flash::FlashAttnFwdSm90`, its combine), FlashMLA (`flash_fwd_splitkv_mla_kernel`, its combine),
# the plugin's split-KV decode (`vllm_metax.ops.split_kernels`: tma_kernel, pointer_kernel,
# merge_kernel) and FlashInfer's merge of partial states
ATTENTION = re.compile(r"mla|attn|attention|flash|_fwd_(grouped_)?kernel_stage|^(tma|pointer|merge)_kernel$"
                       r"|merge_?state", re.IGNORECASE)
CACHE_WRITE = re.compile(r"cache", re.IGNORECASE)        # concat_and_cache_mla: the step's KV write


def kernel_class(name: str) -> str:
    """"kv cache write", "attention" or "other" for a GPU kernel's name."""
    if CACHE_WRITE.search(name):
        return "kv cache write"
    return "attention" if ATTENTION.search(name) else "other"


# vLLM's annotation of a step that only decodes (gpu_worker.annotate_profile): no context request
DECODE_STEP = re.compile(r"^execute_context_0\(0\)_generation_(\d+)\((\d+)\)$")
# Python functions (the tracer's "path.py(line): name"): the MLA metadata builders' build (vLLM's
# MLACommonMetadataBuilder and the plugin's HostLengthsBuilder around it), and any plugin code
METADATA_BUILD = re.compile(r"(mla_attention|vllm_metax/backend/builder)\.py\(\d+\): build$")
PLUGIN_CODE = re.compile(r"vllm_metax/")


def profiler_args(trace_dir: Path, with_stack: bool = False) -> list[str]:
    """`vllm serve` arguments that configure vLLM's torch profiler to write into `trace_dir`;
    `with_stack`: its Python tracer too (Python functions in the trace, at a cost on the host)."""
    cfg = {"profiler": "torch", "torch_profiler_dir": str(Path(trace_dir).resolve()),
           "torch_profiler_with_stack": with_stack, "torch_profiler_use_gzip": True}
    return ["--profiler-config", json.dumps(cfg)]


def _load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def trace_files(trace_dir: Path) -> list[Path]:
    return sorted(Path(trace_dir).glob("*.pt.trace.json*"))


def step_fields(summary: dict, streamed: int | None, layers: int | None) -> dict:
    """Per decode step figures of a kernel summary. The steps are counted in the trace where it
    can be: every step writes the KV cache once per attention layer (`concat_and_cache_mla`), so
    KV-cache-write launches / `layers`. The streamed count (tokens the client saw inside the
    window) undercounts: the trace runs from /start_profile to /stop_profile, a few steps wider
    (31-35 steps traced for 32 streamed on the lent H100, 2026-12-07)."""
    traced = round(summary["kv_write_launches"] / layers) if layers and summary.get("kv_write_launches") else None
    steps = traced or streamed
    if not steps:
        return {}
    pc = summary["per_class_us"]
    return {"steps": steps, "steps_streamed": streamed, "steps_source": "trace" if traced else "streamed",
            "per_step_us": {k: round(v / steps, 2) for k, v in pc.items()},
            "step_kernel_us": round(sum(pc.values()) / steps, 2)}


def restep(profile: dict, layers: int) -> dict:
    """A profile recorded before steps were counted in the trace, with its steps counted from the
    KV-cache-write launches in its top kernels (where they are there); others unchanged."""
    if "steps_source" in profile or "per_class_us" not in profile:
        return profile
    launches = sum(t["launches"] for t in profile.get("top", []) if t["class"] == "kv cache write")
    return {**profile, **step_fields({**profile, "kv_write_launches": launches}, profile.get("steps"), layers)}


def kernel_summary(trace_dir: Path, steps: int | None = None, top: int = 12,
                   files: list[Path] | None = None, layers: int | None = None) -> dict:
    """The GPU kernels of every trace in `trace_dir` (chrome traces, gzipped or not), or of `files`
    alone: total time per class, the top kernels by time, and per decode step where `steps` (the
    streamed count) or `layers` (to count them in the trace: `step_fields`) is given."""
    files = trace_files(trace_dir) if files is None else sorted(files)
    by_name: dict = {}
    for f in files:
        for e in _load(f).get("traceEvents", []):
            if e.get("cat") == "kernel" and "dur" in e:
                t, n = by_name.get(e["name"], (0.0, 0))
                by_name[e["name"]] = (t + float(e["dur"]), n + 1)
    per_class: dict = {"attention": 0.0, "kv cache write": 0.0, "other": 0.0}
    for name, (t, _) in by_name.items():
        per_class[kernel_class(name)] += t
    total = sum(per_class.values())
    out = {"trace_files": len(files), "kernel_launches": sum(n for _, n in by_name.values()),
           "kernel_us": round(total, 1), "per_class_us": {k: round(v, 1) for k, v in per_class.items()},
           "attention_share": round(per_class["attention"] / total, 4) if total else None,
           "top": [{"name": name[:160], "class": kernel_class(name), "us": round(t, 1), "launches": n}
                   for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]}
    out["kv_write_launches"] = sum(n for name, (_, n) in by_name.items() if kernel_class(name) == "kv cache write")
    out.update(step_fields(out, steps, layers))
    return out


def _covered(spans: list[tuple[float, float]]) -> float:
    """Time covered by possibly nested or overlapping spans (each counted once)."""
    total, end = 0.0, -float("inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def host_summary(files: list[Path]) -> dict:
    """Host time per decode-only step in the traces `files`: vLLM's worker `execute_model` (its
    step annotation), and where the Python tracer was on, the MLA metadata build and the plugin's
    code inside those steps (each span counted once however nested). Empty where the traces hold
    no decode-only step annotation."""
    steps, py = [], []
    for f in files:
        for e in _load(f).get("traceEvents", []):
            if e.get("ph") != "X" or "dur" not in e:
                continue
            span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("pid"), e.get("tid"))
            if e.get("cat") == "user_annotation" and DECODE_STEP.match(e.get("name", "")):
                steps.append(span)
            elif e.get("cat") == "python_function":
                py.append((*span, e.get("name", "")))
    if not steps:
        return {}
    n = len(steps)
    out = {"decode_steps": n, "execute_model_us": round(sum(b - a for a, b, *_ in steps) / n, 1),
           "python_tracer": bool(py)}
    if py:
        for key, pattern in (("metadata_build_us", METADATA_BUILD), ("plugin_code_us", PLUGIN_CODE)):
            spans = [(max(a, s0), min(b, s1)) for s0, s1, sp, st in steps
                     for a, b, p, t, name in py if p == sp and t == st and a < s1 and b > s0 and pattern.search(name)]
            out[key] = round(_covered(spans) / n, 1)
    return out


def _post(port: int, path: str, body: dict | None = None, timeout: float = 120) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


class _Stream(threading.Thread):
    """One streaming /v1/completions request; `times` holds when each token arrived."""

    def __init__(self, port: int, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                     "ignore_eos": True, "stream": True}
        self.port, self.times, self.error = port, [], None

    def run(self) -> None:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions",
                                         data=json.dumps(self.body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                        self.times.append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 - reported with the profile
            self.error = f"{type(e).__name__}: {e}"


def prompt_lengths(prompt_tokens: int | tuple[int, int], requests: int, rng) -> list[int]:
    """Each request's prompt length: `prompt_tokens` each, or drawn uniformly from (lo, hi), a
    ragged batch like the long workloads' (8K-32K tokens)."""
    if isinstance(prompt_tokens, int):
        return [prompt_tokens] * requests
    lo, hi = prompt_tokens
    return [rng.randint(lo, hi) for _ in range(requests)]


def profile_decode(port: int, trace_dir: Path, vocab: int, prompt_tokens: int | tuple[int, int] = 16384,
                   requests: int = 1, decode_steps: int = 32, timeout: float = 300,
                   layers: int | None = None) -> dict:
    """Profile `decode_steps` decode steps of `requests` requests (`prompt_tokens` token ids each,
    or a length drawn from a (lo, hi) range for each; sent at once) on the server at `port`; the
    kernel summary per step of the traces this profile wrote (a server profiled twice keeps both
    in `trace_dir`), and the streamed TPOT inside the window; with the model's attention `layers`,
    the steps are counted in the trace. Raises TimeoutError where the requests do not reach decode
    in `timeout` s."""
    import random
    rng = random.Random(0)
    lens = prompt_lengths(prompt_tokens, requests, rng)
    streams = [_Stream(port, [rng.randrange(2, vocab) for _ in range(n)], decode_steps * 4) for n in lens]
    for s in streams:
        s.start()
    t0 = time.perf_counter()
    while not all(s.times or s.error for s in streams):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"requests not decoding after {timeout:.0f} s")
        time.sleep(0.05)
    errors = [s.error for s in streams if s.error]
    if errors:
        raise RuntimeError(f"profiled request failed: {errors[0]}")
    before = set(trace_files(trace_dir))
    start_counts = [len(s.times) for s in streams]
    _post(port, "/start_profile")
    t_start = time.perf_counter()
    while min(len(s.times) - c for s, c in zip(streams, start_counts)) < decode_steps:
        if time.perf_counter() - t_start > timeout or not any(s.is_alive() for s in streams):
            break
        time.sleep(0.01)
    _post(port, "/stop_profile")
    window = [s.times[c:c + decode_steps] for s, c in zip(streams, start_counts)]
    steps = min(len(w) for w in window)
    for s in streams:
        s.join(timeout=timeout)
    t1 = time.perf_counter()          # the traces are written after stop: wait for the files
    while not (new := set(trace_files(trace_dir)) - before) and time.perf_counter() - t1 < 90:
        time.sleep(0.5)
    gaps = sorted(b - a for w in window for a, b in zip(w, w[1:]))
    out = kernel_summary(trace_dir, steps=steps, files=list(new), layers=layers)
    if host := host_summary(list(new)):
        out["host"] = host
    shape = prompt_tokens if isinstance(prompt_tokens, int) else "{}-{}".format(*prompt_tokens)
    out.update({"prompt_tokens": shape, "prompt_lens": lens, "requests": requests, "files_before": len(before),
                "window_tpot_ms_p50": round(1e3 * gaps[len(gaps) // 2], 3) if gaps else None})
    return out


def bound_lines(profiles: dict, baseline: str = "triton16", tuned: str = "tuned",
                goal: float | None = None) -> list[str]:
    """Report lines: per setup, the GPU kernel time of a decode step and attention's part; what
    tuned/baseline would be with tuned's attention free (the bound a kernel cannot beat); with a
    `goal` for tuned/baseline, how fast tuned's attention would have to be to meet it."""
    lines = []
    for setup, p in profiles.items():
        if not p or "per_step_us" not in p:
            lines.append(f"- {setup}: no profile ({(p or {}).get('error', 'not run')})")
            continue
        ps = p["per_step_us"]
        lines.append(f"- {setup}: {p['step_kernel_us']:.0f} us of GPU kernels per decode step, attention "
                     f"{ps['attention']:.0f} us ({100 * (p['attention_share'] or 0):.0f}%), KV-cache writes "
                     f"{ps['kv cache write']:.0f} us, the rest {ps['other']:.0f} us ({p['steps']} steps"
                     + (f" in the trace, {p['steps_streamed']} streamed" if p.get("steps_source") == "trace" else "")
                     + "; "
                     f"streamed TPOT p50 in the window {p.get('window_tpot_ms_p50')} ms)")
        if h := p.get("host"):
            lines.append(f"  - {setup}, host per decode-only step ({h['decode_steps']} steps): execute_model "
                         f"{h['execute_model_us']:.0f} us" + (
                             f"; with the Python tracer on (inflated): attention metadata build "
                             f"{h['metadata_build_us']:.0f} us, the plugin's code {h['plugin_code_us']:.0f} us"
                             if h.get("python_tracer") else ""))
    t, b = profiles.get(tuned) or {}, profiles.get(baseline) or {}
    if "per_step_us" in t and "per_step_us" in b and b["step_kernel_us"]:
        rest = t["step_kernel_us"] - t["per_step_us"]["attention"]      # tuned's step without attention
        free = rest / b["step_kernel_us"]
        lines.append(f"- {tuned}/{baseline} GPU time per step {t['step_kernel_us'] / b['step_kernel_us']:.3f}; with "
                     f"{tuned}'s attention free it would be {free:.3f}: no attention kernel can take "
                     f"{tuned} below that")
        if goal:
            need = goal * b["step_kernel_us"] - rest
            have = t["per_step_us"]["attention"]
            verdict = (" (met)" if have <= need else f" ({have / need:.2f}x that)" if need > 0
                       else f" (out of reach: {tuned}'s step without attention is over the goal)")
            lines.append(f"- for {tuned}/{baseline} <= {goal:g}, {tuned}'s attention would have to take <= "
                         f"{max(need, 0):.0f} us per step; it takes {have:.0f} us" + verdict)
    return lines
