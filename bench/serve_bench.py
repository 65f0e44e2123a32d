"""What a server gains: `vllm serve` on the vllm_metax platform under vLLM's own benchmark client
(`vllm bench serve`, random dataset), one server per (model, attention setup), side by side.

    VLLM_METAX_FORCE=1 python3 bench/serve_bench.py --out DIR [--models h16,h128]
        [--setups tuned,untuned,triton16,vllm_default] [--config-folder DIR] [--quick]

Setups:
  tuned     the plugin with the tuned config (the packaged one for this GPU, or --config-folder)
  untuned   the plugin with no tuned config (FLASHINFER_MLA, the device's default FlashInfer backend)
  triton16  vLLM's TRITON_MLA with vLLM's own num_kv_splits rule at block 16, no tuned config:
            the portable default
  vllm_default  vLLM alone, without the plugin: its CUDA platform and its own MLA backend choice
            (FLASH_ATTN_MLA on Hopper, vllm_flash_attn's FA3; vLLM offers it on its CUDA
            platform only); skipped with the reason where the FA3 library does not load
With VLLM_METAX_PROFILE=metax every plugin setup runs the MetaX profile: `untuned` is then the
vendor's default (FLASHMLA at block 64, else its Triton), `tuned` the metax-profile config.
Models (tiny_model.py, made here: DeepSeek attention dims, dense MLP, word-level tokenizer):
  h16   16 heads per rank (DeepSeek-V3 at TP8, V2-Lite), 27 layers (V2-Lite's depth)
  h128  128 heads (V3 at TP1), 27 layers
  v3tp8 DeepSeek-V3's layers on one rank of TP8 (hidden 7168, q_lora 1536, 16 heads, dense MLP of
        the MoE's FLOPs per token), 61 layers, weights drawn by vLLM at load (`--load-format
        dummy`); tiny_model.py's docstring says why dense and how the layers fit
Workloads (vLLM's random dataset, `--ignore-eos`, three request rates each; see WORKLOADS).

Each server is vLLM's CLI (`python3 -m vllm.entrypoints.cli.main serve`, the `vllm serve` entry point)
in its own process group with the default multiprocess engine core; the client is the function
`vllm bench serve` runs (`vllm.benchmarks.serve.main`), called in this process so vLLM imports once;
the first server of a run also gets one plain HTTP /v1/completions request and one `vllm bench
serve` subprocess. Server logs go to DIR/server_<model>_<setup>.log; results to
DIR/serve_bench.json (every vLLM result dict) and DIR/serve_bench.md, written after every cell: a
run cut by a time limit keeps what it measured (that setup marked partial), and a setup run again
(the same DIR, a later call on a warm machine) keeps its earlier record under `previous`.

--repeats N: each workload-rate runs N times on the same server (repeat i with seed i: the same
prompts and arrival times on every server). A cell is then the median over its repeats, and "beyond
noise" is tested, not assumed: tuned is slower (or faster) than a setup in a cell only if a
one-sided Mann-Whitney U test over the repeats' p50 TPOTs gives p < 0.1 (with 3 repeats each: every
repeat of one slower than every repeat of the other, p = 0.05) and the medians differ by 5% or
more. With one run per cell the 5% alone decides, which two sessions on the lent H100 showed is not
enough for the chat workloads (the same server's chat@32 p50 TPOT 3.79 ms in one, 7.42 in the next).

--cells long@4,chat@8: only these workload-rates (to repeat the cells a verdict hinges on, say).
`--out RESULTS.json --attach DIR/serve_bench.json` (no servers) adds such a run to a results file
as a follow-up on the same device and writes RESULTS.md: the run before it stays as measured.

--profile: each server also runs with vLLM's torch profiler configured, and after its workloads
the decode steps of one long request (--profile-prompt tokens; 0: none), then of a batch
(--profile-batch requests of --profile-batch-prompt tokens, N or a LO-HI range; default chat@32's shape, 32 x 512) are
profiled (bench/server_profile.py); the report then says how much of a decode step attention takes
and what tuned/triton16 would be with attention free, the host's time per decode-only step in
vLLM's execute_model, and a table of attention's share across the models. --profile-stack adds
vLLM's Python tracer: the host time of the MLA metadata build and of the plugin's code per step.

Compilation (--compilation, every setup alike, recorded in the results and said in the report's
header): `default` is what `vllm serve` users get, vLLM's default (torch.compile, FULL_AND_PIECEWISE
CUDA graphs; a server starts in minutes on a fresh machine); `eager-graphs` (or --compile-off) is
torch.compile off and full CUDA graphs for decode-only steps (`--compilation-config {"mode": 0,
"cudagraph_mode": "FULL_DECODE_ONLY"}`), which starts in seconds.

Start-up (issue #51: a cold start at most 1.2x vLLM's own server's, a warm one at most 1.1x): every
setup's ready time (`ready_s`, from process start to /health answering) is recorded. --cache-root
DIR gives each server its own caches, DIR/<model>_<setup>/ (vLLM's torch.compile cache through
VLLM_CACHE_ROOT, FlashInfer's JIT through FLASHINFER_WORKSPACE_BASE, Triton's and inductor's), so
one server cannot warm another's. A start is cold until a server has started on its setup's
folder, warm after (a FlashInfer cache filled by `mla-tune prebuild` or copied in is recorded
apart, `flashinfer_cache`). --start-only N starts each server N times on its caches as they are
and stops it once ready, without workloads (--fresh-cache empties each setup's folder first, so
its first start is cold); the report compares them with vLLM's own server's.
--prebuild runs `mla-tune prebuild` (in the server's environment: its FlashInfer cache and config)
before each plugin setup's cold start (with --cache-root), as a user runs it once after install;
its time is recorded and reported apart (`prebuild`), and the start after it still counts as cold.

--tokens: each server also answers the served-tokens check (bench/serve_tokens.py: greedy tokens
with their top logits, prompts of a few to 32K tokens, one at a time and as one ragged batch), and
the report classifies every divergence from vLLM's own server (near-tie or failure; failures are
teacher-forced through a float32 reference once the servers are stopped, where the model has
weights on disk).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))          # mla_tune, run from a checkout
from server_profile import bound_lines, profile_decode, profiler_args, restep  # noqa: E402
import serve_tokens  # noqa: E402
from mla_tune.tune.verdict import compare, min_p_value  # noqa: E402
from tiny_model import V3TP8_LAYERS, make_model_dir, model_config, v3tp8_config  # noqa: E402

MAX_MODEL_LEN = 34816
# VLLM_METAX_PROFILE=metax (passed on to every server) makes the plugin's setups the MetaX target's:
# untuned is then the vendor plugin's default order (FLASHMLA at block 64, else its Triton)
PROFILE_NOTE = {"metax": (" MetaX profile (VLLM_METAX_PROFILE=metax): `untuned` is the vendor plugin's "
                          "default order, FLASHMLA at block 64, else TRITON_MLA with the vendor's "
                          "launch; this GPU stands in for the MetaX device.")}
MODELS = {"h16": {"heads": 16, "layers": 27}, "h128": {"heads": 128, "layers": 27},
          # DeepSeek-V3's layer shapes on one TP8 rank (tiny_model.V3TP8), weights drawn at load
          "v3tp8": {"heads": 16, "layers": V3TP8_LAYERS, "dummy": True,
                    "about": "DeepSeek-V3's layers on one TP8 rank (hidden 7168, q_lora 1536, dense MLP "
                             "2304 wide: the MoE's FLOPs per token), random weights at load"}}
SETUPS = {
    # name: (extra `vllm serve` arguments, use the tuned config)
    "tuned": ([], True),
    "untuned": ([], False),
    "triton16": (["--attention-backend", "TRITON_MLA", "--block-size", "16"], False),
    # vLLM alone (the plugin inactive): its CUDA platform and its own MLA choice, FLASH_ATTN_MLA
    # on Hopper, which it only offers on that platform (fa_utils.flash_attn_supports_mla)
    "vllm_default": ([], False),
}
# name: (input len, output len, range ratio, prompts, request rates); "inf" sends all at once
WORKLOADS = {
    "long": (20480, 256, {"input": 0.6, "output": 0.0}, 8, ("1", "4", "inf")),     # 8K-32K prompts
    "chat": (512, 128, {"input": 0.5, "output": 0.5}, 48, ("8", "32", "inf")),
    "ragged": (4096, 256, {"input": 0.95, "output": 0.5}, 16, ("2", "8", "inf")),  # 205-7987 prompts
    # issue 54's traffic loop (bench/tools/traffic_loop.sh), not run by default: 48 requests of
    # 4K-12K prompts decoding together (batch ~24-48 at 4K-12K context, unlike the default grid's mix)
    "mid": (8192, 256, {"input": 0.5, "output": 0.0}, 48, ("8", "16", "inf")),
}
DEFAULT_WORKLOADS = ("long", "chat", "ragged")
QUICK = {"long": (8192, 64, {"input": 0.5, "output": 0.0}, 4, ("inf",)),
         "chat": (256, 32, {"input": 0.5, "output": 0.5}, 8, ("inf",))}
METRICS = ("ttft", "tpot", "itl", "e2el")
# --compilation: name -> (`vllm serve` arguments, what the report's header says)
COMPILATION = {
    "default": ([], "vLLM's default compilation (torch.compile, FULL_AND_PIECEWISE CUDA graphs), as "
                    "`vllm serve` users run it"),
    "eager-graphs": (["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})],
                     "torch.compile off, full CUDA graphs for decode-only steps (not what `vllm serve` "
                     "users run)"),
}
CACHE_MARK = ".serve_bench_cache"     # a cache folder serve_bench made, and may empty for a cold start
STARTED_MARK = ".serve_bench_started"  # a server has started on this cache folder: the next start is warm


def compilation_args(mode: str) -> list[str]:
    """The `vllm serve` arguments of a --compilation mode."""
    return list(COMPILATION[mode][0])


def compilation_of(meta: dict) -> str:
    """A results file's compilation mode; files from before --compilation have a `compile` flag
    (False: the then-default eager-graphs)."""
    if "compilation" in meta:
        return meta["compilation"]
    return "default" if meta.get("compile") else "eager-graphs"


def cache_env(folder: Path) -> dict:
    """Environment that puts every cache a server start fills under `folder`: vLLM's (torch.compile
    artifacts, and inductor's and Triton's, which vLLM keeps beside them unless told otherwise),
    FlashInfer's JIT modules, and Triton's for kernels compiled before vLLM sets its own (the
    plugin's)."""
    folder = Path(folder).resolve()
    return {"VLLM_CACHE_ROOT": str(folder / "vllm"), "FLASHINFER_WORKSPACE_BASE": str(folder / "flashinfer"),
            "TRITON_CACHE_DIR": str(folder / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}


def empty_cache(folder: Path) -> str | None:
    """Make `folder` an empty cache folder for a cold start: created, or emptied where serve_bench
    made it (its CACHE_MARK). None, or why not (a folder it did not make is never emptied)."""
    import shutil

    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        if not (folder / CACHE_MARK).exists():
            return f"{folder} is not empty and serve_bench did not make it: not emptied"
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CACHE_MARK).write_text("caches of one serve_bench server; emptied for a cold start\n")
    return None


def cache_state(folder: Path | None) -> str:
    """"cold" where no server has started on the setup's cache folder yet (a FlashInfer cache
    filled by `mla-tune prebuild` or copied in does not count: that is install, not a start),
    "warm" after one did (its STARTED_MARK, or vLLM's own cache folder filled, as by a start of an
    earlier serve_bench), "shared" without --cache-root (the default caches, which an earlier
    server of any setup may have filled)."""
    if folder is None:
        return "shared"
    vllm = Path(folder) / "vllm"        # vLLM's own cache (torch.compile's): only a server fills it
    started = (Path(folder) / STARTED_MARK).exists() or (vllm.exists() and any(vllm.iterdir()))
    return "warm" if started else "cold"


def jit_state(folder: Path | None) -> str | None:
    """Whether the setup's FlashInfer JIT cache held anything before a start ("filled": prebuilt or
    copied in; "empty"); None without --cache-root."""
    if folder is None:
        return None
    fi = Path(folder) / "flashinfer"
    return "filled" if fi.exists() and any(p.is_file() for p in fi.rglob("*")) else "empty"


def mark_started(folder: Path | None) -> None:
    """A server has started on these caches: later starts on them are warm."""
    if folder is not None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / STARTED_MARK).write_text("a server started on these caches\n")


def fa3_available() -> str | None:
    """None when vLLM's FA3 library loads here, else why not."""
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fai

        ok = getattr(fai, "FA3_AVAILABLE", None)
        if ok is False:
            return f"vllm_flash_attn: FA3 unavailable ({getattr(fai, 'FA3_UNAVAILABLE_REASON', '')})"
        import vllm.vllm_flash_attn._vllm_fa3_C  # noqa: F401
        return None
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return f"{type(e).__name__}: {e}"


def server_env(setup: str, config_folder: str | None, empty: Path, cache: Path | None = None) -> dict:
    """The environment of one setup's server; with `cache`, every cache it fills goes there."""
    env = dict(os.environ, VLLM_METAX_FORCE="1")
    if cache is not None:
        env.update(cache_env(cache))
    env.pop("VLLM_METAX_MLA_CONFIG_FOLDER", None)
    env.pop("VLLM_METAX_MLA_PACKAGED_FOLDER", None)     # the shipped configs, unless untuned
    if setup == "vllm_default":
        env.pop("VLLM_METAX_FORCE")          # the plugin stays inactive on an NVIDIA GPU
        # vLLM's CUDA platform would sample with FlashInfer's top-p/top-k kernels, JIT-built at
        # engine start (over 60 s on the lent H100, 2026-12-07, where the time limit killed it);
        # the plugin's platform samples with PyTorch, so this setup does too
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        return env
    if SETUPS[setup][1]:
        if config_folder:
            env["VLLM_METAX_MLA_CONFIG_FOLDER"] = config_folder
    else:
        # no tuned config at all: the packaged folder too points at an empty one
        env["VLLM_METAX_MLA_PACKAGED_FOLDER"] = str(empty)
    return env


def server_args(model_dir: Path, setup: str, port: int, compilation: str, extra: list[str] = ()) -> list[str]:
    """The `vllm serve` command line of one setup's server."""
    return ([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
             "--port", str(port), "--host", "127.0.0.1", "--served-model-name", "tiny",
             "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "64",
             "--gpu-memory-utilization", "0.85", "--no-enable-prefix-caching", "--seed", "0"]
            + compilation_args(compilation) + SETUPS[setup][0] + list(extra))


class Server:
    """One `vllm serve` process group; `stop()` ends it (SIGINT, then SIGKILL)."""

    def __init__(self, model_dir: Path, setup: str, port: int, log: Path, env: dict,
                 compilation: str, extra: list[str] = (), mode: str = "w"):
        self.args, self.port, self.log = server_args(model_dir, setup, port, compilation, extra), port, log
        self._f = open(log, mode)
        self.proc = subprocess.Popen(self.args, stdout=self._f, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float) -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.time() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self._f.close()


def preflight(model_dir: Path) -> int:
    """Build the HTTP app `vllm serve` builds (its argument parser, `build_app` with its routers),
    without an engine: an import a server would only reach after its engine is up (minutes on a
    cold machine) fails here in seconds. Returns the number of routes."""
    from vllm.config import ModelConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.launchers.app import build_app
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", str(model_dir)])
    mc = ModelConfig(model=str(model_dir), dtype="bfloat16", max_model_len=MAX_MODEL_LEN)
    return len(build_app(args, ("generate",), mc).routes)


def make_model(name: str, root: Path, device: str) -> Path:
    """The folder `vllm serve` is given for model `name`: the tiny models with seeded weights
    (drawn on `device`), v3tp8 with config.json and tokenizer only."""
    spec = MODELS[name]
    if spec.get("dummy"):
        return make_model_dir(root / name, v3tp8_config(spec["layers"]), weights=False)
    return make_model_dir(root / name, model_config(spec["heads"], spec["layers"], 4096, MAX_MODEL_LEN + 1024),
                          device=device)


def model_args(name: str) -> list[str]:
    """`vllm serve` arguments a model needs: vLLM draws v3tp8's weights at load."""
    return ["--load-format", "dummy"] if MODELS[name].get("dummy") else []


def completion(port: int, prompt: str, max_tokens: int = 16) -> dict:
    """One plain HTTP /v1/completions request (what any OpenAI client sends)."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def bench_args(model_dir: Path, port: int, workload: tuple, rate: str, seed: int) -> list[str]:
    inp, out, ratio, prompts, _ = workload
    return ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", "tiny",
            "--tokenizer", str(model_dir), "--dataset-name", "random",
            "--random-input-len", str(inp), "--random-output-len", str(out),
            "--random-range-ratio", json.dumps(ratio), "--num-prompts", str(prompts),
            "--request-rate", rate, "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
            "--disable-tqdm"]


def run_client(argv: list[str]) -> dict:
    """vLLM's `vllm bench serve` (the same parser and main), in this process."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return main(parser.parse_args(argv))


KEEP = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput")


def summarize(result: dict) -> dict:
    out = {k: result.get(k) for k in KEEP}
    for m in METRICS:
        for p in ("p50", "p99"):
            out[f"{p}_{m}_ms"] = result.get(f"{p}_{m}_ms")
        out[f"mean_{m}_ms"] = result.get(f"mean_{m}_ms")
    return out


def median_summary(reps: list[dict]) -> dict:
    """One cell from its repeats: each metric's median, except `completed` (the fewest) and
    `failed` (the most), so a repeat that lost requests is not hidden."""
    out = {}
    for k in reps[0]:
        vals = [r[k] for r in reps if r.get(k) is not None]
        if not vals:
            out[k] = None
        elif k == "completed":
            out[k] = min(vals)
        elif k == "failed":
            out[k] = max(vals)
        else:
            out[k] = statistics.median(vals)
    return out


def log_warnings(rec: dict) -> list[str]:
    """The plugin's WARNING lines of a setup's server log, each once, without vLLM's prefix: what
    the server could not do as configured (a tuned kernel that cannot run here, say), which the
    report puts beside that setup's numbers."""
    out = []
    for ln in rec.get("log", []):
        if " WARNING " in ln and "vllm_metax" in ln:
            msg = ln.split("] ", 1)[-1].strip()
            if msg not in out:
                out.append(msg)
    return out


def log_lines(log: Path) -> list[str]:
    """The plugin's lines of a server log (what the issue asks the log to say)."""
    keys = ("vllm_metax", "attention backend", "Using ")
    return [ln.rstrip() for ln in log.read_text(errors="replace").splitlines()
            if any(k in ln for k in keys)][:40]


def run_setup(model: str, setup: str, model_dir: Path, args, empty: Path, port: int,
              first: bool, workloads: dict, record: dict, checkpoint=lambda: None) -> None:
    """One server's workloads (and profiles) into `record`; `checkpoint()` after every cell, so a
    run cut by a time limit keeps the cells it measured (the setup stays marked `partial`). A
    setup measured before (a JSON carried on from an earlier call) is kept under `previous`."""
    key = f"{model}/{setup}"
    old = record.get(key)
    rec = record[key] = {"model": model, "setup": setup, "partial": True}
    if old and (old.get("runs") or old.get("previous")):      # an earlier run with no cells adds nothing
        rec["previous"] = old if old.get("runs") else old["previous"]
    if setup == "vllm_default" and (why := fa3_available()):
        rec["skipped"] = why
        rec.pop("partial")
        print(f"[{key}] skipped: {why}", flush=True)
        return
    log = args.out / f"server_{model}_{setup}.log"
    trace_dir = args.out / f"trace_{model}_{setup}"
    cache = setup_cache(args, model, setup)
    if isinstance(cache, str):
        rec["error"] = cache
        rec.pop("partial")
        print(f"[{key}] FAILED: {cache}", flush=True)
        return
    rec["cache"] = cache_state(cache)
    env = server_env(setup, args.config_folder, empty, cache)
    mark_started(cache)
    if getattr(args, "prebuild", False) and rec["cache"] == "cold" and setup != "vllm_default":
        rec["prebuild"] = prebuild(env, args.out / f"prebuild_{model}_{setup}.log")
        print(f"[{key}] mla-tune prebuild: {rec['prebuild']['s']} s (exit {rec['prebuild']['rc']})", flush=True)
    extra = (model_args(model) + (profiler_args(trace_dir, getattr(args, "profile_stack", False)) if args.profile
                                  else []) + tokens_args(args) + user_server_args(args))
    if jit := jit_state(cache):
        rec["flashinfer_cache"] = jit
    server = Server(model_dir, setup, port, log, env, args.compilation, extra)
    rec["command"] = " ".join(server.args[1:])
    try:
        rec["ready_s"] = round(server.wait_ready(args.start_timeout), 1)
        print(f"[{key}] ready in {rec['ready_s']} s ({rec['cache']} caches)", flush=True)
        if first:
            r = completion(port, " ".join(f"w{i}" for i in range(3, 40)))
            rec["completion"] = {"text": r["choices"][0]["text"], "usage": r.get("usage")}
            cli = subprocess.run(
                [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
                 *bench_args(model_dir, port, (256, 16, 0.0, 4, None), "inf", 1)],
                capture_output=True, text=True, timeout=300)
            rec["bench_cli"] = {"rc": cli.returncode,
                                "tail": (cli.stdout + cli.stderr).strip().splitlines()[-14:]}
            print(f"[{key}] /v1/completions ok; `vllm bench serve` rc={cli.returncode}", flush=True)
        for name, wl in workloads.items():
            for rate in wl[4]:
                cell, reps = f"{name}@{rate}", []
                for i in range(args.repeats):
                    t0 = time.time()
                    s = summarize(run_client(bench_args(model_dir, port, wl, rate, i)))
                    reps.append(s)
                    print(f"[{key}] {cell}{f' #{i}' if args.repeats > 1 else ''}: {s['completed']} done in "
                          f"{time.time() - t0:.1f} s, TPOT p50 {s['p50_tpot_ms']:.2f} ms, TTFT p50 "
                          f"{s['p50_ttft_ms']:.1f} ms, {s['output_throughput']:.0f} tok/s", flush=True)
                rec.setdefault("runs", {})[cell] = median_summary(reps)
                if len(reps) > 1:
                    rec.setdefault("repeats", {})[cell] = reps
                checkpoint()
        if getattr(args, "tokens", False):
            try:
                rec["tokens"] = serve_tokens.collect(port, json.loads((model_dir / "config.json").read_text())["vocab_size"])
                print(f"[{key}] tokens: {len(rec['tokens']['single'])} prompts one at a time, "
                      f"{len(rec['tokens']['batch'])} at once ({rec['tokens']['wall_s']} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - the benchmark's numbers stand without it
                rec["tokens"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"[{key}] tokens FAILED: {rec['tokens']['error']}", flush=True)
            checkpoint()
        if args.profile:
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            for field, prompt, n in (("profile", args.profile_prompt, 1 if args.profile_prompt else 0),
                                     ("profile_batch", args.profile_batch_prompt, args.profile_batch)):
                if not n:
                    continue
                try:
                    rec[field] = profile_decode(port, trace_dir, vocab, prompt_tokens=prompt, requests=n,
                                                layers=MODELS[model]["layers"])
                    print(f"[{key}] {field} ({n} x {prompt} tokens): {rec[field].get('per_step_us')} us "
                          "per decode step", flush=True)
                except Exception as e:  # noqa: BLE001 - the benchmark's numbers stand without it
                    rec[field] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"[{key}] {field} FAILED: {rec[field]['error']}", flush=True)
    except Exception as e:  # noqa: BLE001 - one setup failing must not lose the others
        rec["error"] = f"{type(e).__name__}: {e}"
        print(f"[{key}] FAILED: {rec['error']}", flush=True)
        server.stop()
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-4:]
        rec["log_tail"] = tail
        print("\n".join(f"    {ln[:300]}" for ln in tail), flush=True)
    else:
        rec.pop("partial")
    finally:
        server.stop()
        rec["log"] = log_lines(log)
        checkpoint()


def tokens_args(args) -> list[str]:
    """With --tokens: the top values the check reads are the LM head's bf16 logits (serve_tokens)."""
    return ["--logprobs-mode", serve_tokens.LOGPROBS_MODE] if getattr(args, "tokens", False) else []


def user_server_args(args) -> list[str]:
    """--server-args, split as a shell would."""
    import shlex
    return shlex.split(getattr(args, "server_args", "") or "")


def tokens_comparisons(recs: dict) -> dict:
    """tuned against every other setup of one model that answered the served-tokens check."""
    t = recs.get("tuned", {}).get("tokens")
    if not t or "error" in t:
        return {}
    out = {}
    for s, r in recs.items():
        if s != "tuned" and r.get("tokens") and "error" not in r["tokens"]:
            try:
                out[s] = serve_tokens.compare(t, r["tokens"])
            except ValueError as e:     # records of different prompts (another version's): not compared
                out[s] = {"error": str(e)}
    return out


def check_failures(model: str, record: dict, model_dir: Path, device: str, results: Path | None = None) -> None:
    """The float32 reference's verdict on every failure of tuned against another setup, into the
    tuned record's `tokens_reference` (run once the model's servers have stopped: it needs the
    GPU's memory). A model whose weights are drawn at load has no reference."""
    recs = {r["setup"]: r for r in record.values() if r["model"] == model}
    for base, c in tokens_comparisons(recs).items():
        if not c.get("failures"):
            continue
        ref = recs["tuned"].setdefault("tokens_reference", {})
        if MODELS[model].get("dummy"):
            ref[base] = {"_none": {"error": "no float32 reference: the weights are drawn inside the server"}}
            continue
        cfg = json.loads((model_dir / "config.json").read_text())
        try:
            ref[base] = serve_tokens.reference_verdicts(model_dir, cfg, recs["tuned"]["tokens"], recs[base]["tokens"],
                                                        c["cases"], ("tuned", base), device)
        except Exception as e:  # noqa: BLE001 - the failures stand as classified
            ref[base] = {"_none": {"error": f"{type(e).__name__}: {e}; rerun: python3 bench/serve_tokens.py "
                                            f"reference --results {results or 'RESULTS.json'} --model {model} "
                                            f"--model-dir {model_dir}"}}
        print(f"[{model}] float32 reference on tuned vs {base}'s failures: "
              + "; ".join(f"{k} {v.get('error') or v['verdict']}" for k, v in ref[base].items()), flush=True)


def tokens_reference(results: Path, model: str, model_dir: Path, device: str) -> int:
    """`serve_tokens.py reference`: check_failures on a results file, rewritten with its report."""
    data = json.loads(results.read_text())
    if model not in MODELS or not any(r.get("model") == model for r in data.get("runs", {}).values()):
        raise ValueError(f"{results}: no run of model {model!r}")
    check_failures(model, data["runs"], model_dir, device, results)
    save(results, data)
    print(f"{results}: float32 verdicts added; report {results.with_suffix('.md')}")
    return 0


def tokens_lines(recs: dict) -> list[str]:
    """The served-tokens section of one model: tuned against each setup, each setup against
    itself (one at a time vs in the batch), and the goal."""
    have = {s: r["tokens"] for s, r in recs.items() if r.get("tokens")}
    if not have:
        return []
    lines = ["", "Served tokens (bench/serve_tokens.py: greedy, top-5 bf16 logits, prompts of "
             f"{min(serve_tokens.SINGLE_LENS)}-{max(serve_tokens.SINGLE_LENS)} tokens one at a time and "
             f"{len(serve_tokens.prompt_lens())} at once; first divergence per sequence):", ""]
    lines += [f"- {s}: no tokens ({t['error']})" for s, t in have.items() if "error" in t]
    comps = tokens_comparisons(recs)
    verdicts = recs.get("tuned", {}).get("tokens_reference", {})
    for base, c in comps.items():
        if "error" in c:
            lines.append(f"- tuned vs {base}: not compared ({c['error']})")
            continue
        lines += serve_tokens.summary_lines("tuned", base, c, verdicts.get(base))
        lines += [f"  - float32: {v['error']}" for k, v in verdicts.get(base, {}).items() if k.startswith("_")]
    for s, t in have.items():
        if "error" in t:
            continue
        n = len(t["single"])
        own = serve_tokens.compare(t, {**t, "single": t["batch"][:n]}, modes=("single",))
        lines.append(f"- {s} against itself, one at a time vs in the batch: {own['divergent']} of {own['compared']} "
                     f"diverge ({own['near_ties']} near-ties, {own['failures']} failures)")
    if comps := {b: c for b, c in comps.items() if "error" not in c}:
        bad = sum(c["failures"] for c in comps.values())
        lines.append(f"- goal, 0 divergences from another setup that are not near-ties: "
                     + ("met" if not bad else f"NOT met ({bad})"))
    return lines


def setup_cache(args, model: str, setup: str, cold: bool = False) -> Path | None | str:
    """The setup's own cache folder under --cache-root (None without it), made if missing and
    emptied first where `cold`; or why it cannot be used."""
    if not args.cache_root:
        return None
    folder = args.cache_root / f"{model}_{setup}"
    if cold:
        why = empty_cache(folder)
        return folder if why is None else why
    if not folder.exists():
        return folder if empty_cache(folder) is None else f"{folder}: cannot make it"
    return folder


def prebuild(env: dict, log: Path) -> dict:
    """`mla-tune prebuild` in a server's environment (its FlashInfer cache, its tuned config): wall
    seconds, exit code and its last lines (all of them into `log`)."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mla_tune", "prebuild"], env=env, capture_output=True,
                       text=True)
    out = (r.stdout + r.stderr).strip().splitlines()
    Path(log).write_text("".join(f"{line}\n" for line in out))
    return {"s": round(time.monotonic() - t0, 1), "rc": r.returncode, "tail": out[-3:]}


def start_only(model: str, setup: str, model_dir: Path, args, empty: Path, port: int, record: dict,
               checkpoint=lambda: None) -> None:
    """Start the setup's server `args.start_only` times, each until it answers /health, then stop
    it; every start's ready time and the state of its caches (cold, warm or shared; FlashInfer's
    filled or empty) into `record[model/setup]["starts"]`. The caches are taken as they are
    (`args.fresh_cache`: the setup's folder emptied before the first start)."""
    key = f"{model}/{setup}"
    rec = record[key] = {"model": model, "setup": setup, "starts": []}
    if setup == "vllm_default" and (why := fa3_available()):
        rec["skipped"] = why
        print(f"[{key}] skipped: {why}", flush=True)
        return
    log = args.out / f"server_{model}_{setup}.log"
    log.write_text("")
    for i in range(args.start_only):
        cache = setup_cache(args, model, setup, cold=i == 0 and getattr(args, "fresh_cache", False))
        if isinstance(cache, str):
            rec["error"] = cache
            print(f"[{key}] FAILED: {cache}", flush=True)
            break
        state = cache_state(cache)
        env = server_env(setup, args.config_folder, empty, cache)
        if getattr(args, "prebuild", False) and state == "cold" and setup != "vllm_default":
            rec["prebuild"] = prebuild(env, args.out / f"prebuild_{model}_{setup}.log")
            print(f"[{key}] mla-tune prebuild: {rec['prebuild']['s']} s (exit {rec['prebuild']['rc']})",
                  flush=True)
        jit = {"flashinfer_cache": j} if (j := jit_state(cache)) else {}
        mark_started(cache)
        server = Server(model_dir, setup, port, log, env, args.compilation,
                        model_args(model) + user_server_args(args), mode="a")
        rec["command"] = " ".join(server.args[1:])
        try:
            ready = round(server.wait_ready(args.start_timeout), 1)
        except Exception as e:  # noqa: BLE001 - a start that fails is the result
            rec["starts"].append({"cache": state, "error": f"{type(e).__name__}: {e}", **jit})
            print(f"[{key}] start {i + 1} ({state}) FAILED: {type(e).__name__}: {e}", flush=True)
            break
        finally:
            server.stop()
        rec["starts"].append({"cache": state, "ready_s": ready, **jit})
        print(f"[{key}] start {i + 1} ({state} caches): ready in {ready} s", flush=True)
        checkpoint()
    rec["log"] = log_lines(log)
    checkpoint()


# ---------------------------------------------------------------------------- report

def _ratio(a, b):
    return a / b if a and b else None


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


NOISE = 0.05          # a p50 TPOT difference under 5% is never a verdict
SERVE_P = 0.1         # with repeats: one-sided Mann-Whitney over the repeats' p50 TPOTs, p below this
LONG_TPOT_GOAL = 0.6  # 16 heads, long context: tuned p50 TPOT <= 0.6x TRITON_MLA at block 16


def cell_reps(rec: dict, cell: str) -> list[dict]:
    """A setup's runs of a cell: its repeats, or its one run (empty where it has none)."""
    return rec.get("repeats", {}).get(cell) or [rec.get("runs", {}).get(cell, {})]


def tpots(rec: dict, cell: str) -> list[float]:
    """A setup's p50 TPOT in a cell, one per repeat (one value without repeats)."""
    return [r["p50_tpot_ms"] for r in cell_reps(rec, cell) if r.get("p50_tpot_ms")]


def testable(n1: int, n2: int) -> bool:
    """Can repeats of these counts reach p < SERVE_P at all (3 and 3 can: p = 0.05)?"""
    return min_p_value(n1, n2) < SERVE_P


def beyond_noise(slow: list[float], fast: list[float]) -> bool:
    """Is `fast` faster than `slow` beyond noise? Where the repeats can reach p < SERVE_P: a
    one-sided Mann-Whitney U test over them and medians at least NOISE apart (mla_tune's verdict
    rule, at serving's sample counts); otherwise (one run a cell) the NOISE ratio alone."""
    if not slow or not fast:
        return False
    if testable(len(slow), len(fast)):
        return compare(slow, fast, p_threshold=SERVE_P, min_ratio=1 + NOISE)[0]
    return statistics.median(slow) / statistics.median(fast) > 1 + NOISE


def noise_rule(recs: dict, setups: list[str], runs: list[str]) -> str:
    ns = {len(tpots(recs[s], k)) for s in setups for k in runs if s in recs and tpots(recs[s], k)} or {1}
    if testable(min(ns), min(ns)):
        n = str(min(ns)) if len(ns) == 1 else f"{min(ns)}-{max(ns)}"
        return (f"{n} repeats a cell: Mann-Whitney p < {SERVE_P:g} over the repeats and medians "
                f"{NOISE:.0%} apart")
    return (f"{'one run' if max(ns) == 1 else 'too few repeats'} a cell: medians {NOISE:.0%} apart, "
            "which is not enough for the chat workloads")


def goals(recs: dict, runs: list[str], heads: int = 16) -> list[str]:
    """The serving issue's goals for one model, from its p50 TPOTs: long-context tuned/triton16
    (set for 16 heads per rank), tuned vs untuned (never slower beyond noise), tuned vs vLLM's own
    default."""
    def tpot(setup, k):
        return recs.get(setup, {}).get("runs", {}).get(k, {}).get("p50_tpot_ms")
    out = []
    if "triton16" in recs and heads == 16:
        long = {k: _ratio(tpot("tuned", k), tpot("triton16", k)) for k in runs if k.startswith("long@")}
        long = {k: v for k, v in long.items() if v}
        if long:
            worst = max(long.values())
            out.append(f"- long context, tuned / triton16 p50 TPOT <= {LONG_TPOT_GOAL}: "
                       f"{'met' if worst <= LONG_TPOT_GOAL else 'NOT met'} ("
                       + ", ".join(f"{k} {v:.3f}" for k, v in long.items()) + ")")
    for base in ("untuned", "vllm_default"):
        if base not in recs:
            continue
        r = {k: _ratio(tpot("tuned", k), tpot(base, k)) for k in runs}
        r = {k: v for k, v in r.items() if v}
        if not r:
            b = recs[base]
            why = b.get("skipped") or b.get("error") or ("cut before its first cell" if b.get("partial")
                                                         else "no cell of both")
            out.append(f"- tuned vs {base}: not measured ({why})")
            continue
        both = {k: (tpots(recs["tuned"], k), tpots(recs[base], k)) for k in r}    # (tuned's, base's)
        slower = {k: v for k, v in r.items() if beyond_noise(*both[k])}
        faster = [k for k in r if beyond_noise(*both[k][::-1])]
        out.append(f"- tuned no slower than {base} beyond noise (p50 TPOT, every workload-rate; "
                   f"{noise_rule(recs, ['tuned', base], list(r))}): "
                   + ("met" if not slower else "NOT met: " + ", ".join(f"{k} {v:.3f}" for k, v in slower.items()))
                   + f"; faster beyond noise in {len(faster)} of {len(r)}"
                   + (f" ({', '.join(f'{k} {r[k]:.3f}' for k in faster)})" if faster else ""))
        paired = {k: [a / b for a, b in zip(t, b)] for k, (t, b) in both.items() if len(t) == len(b) > 1}
        if paired:      # repeat i drew the same prompts and arrivals (seed i) on both servers
            out.append(f"  - tuned / {base} repeat by repeat (the same seed, prompts and arrivals): "
                       + "; ".join(f"{k} " + " ".join(f"{x:.3f}" for x in v) for k, v in paired.items()))
    return out


def failures(rec: dict) -> list[str]:
    """The cells (and repeats) where vLLM's client counted failed requests."""
    out = []
    for k in sorted(rec.get("runs", {}), key=cell_order):
        reps = cell_reps(rec, k)
        for i, r in enumerate(reps):
            if r.get("failed"):
                out.append(f"{k}{f' repeat {i}' if len(reps) > 1 else ''}: {r['failed']} of "
                           f"{r['failed'] + (r.get('completed') or 0)} requests failed")
    return out


def cell_order(cell: str) -> tuple:
    """workload@rate in WORKLOADS' order, the rates by value ("inf" last)."""
    name, _, rate = cell.partition("@")
    try:
        r = float(rate)
    except ValueError:
        r = math.inf
    return (list(WORKLOADS).index(name) if name in WORKLOADS else len(WORKLOADS), name, r)


COLD_GOAL, WARM_GOAL = 1.2, 1.1      # start-up: tuned's ready time over vLLM's own server's


def starts(rec: dict) -> dict:
    """A setup's ready times by cache state ("cold", "warm", "shared"): its --start-only starts,
    else the ready time of its benchmark run."""
    out: dict = {}
    for st in rec.get("starts") or ([{"cache": rec.get("cache", "shared"), "ready_s": rec["ready_s"]}]
                                    if rec.get("ready_s") else []):
        if st.get("ready_s"):
            out.setdefault(st["cache"], []).append(st["ready_s"])
    return out


def startup_lines(recs: dict) -> list[str]:
    """The start-up table of one model's setups (ready time in s by cache state) and, against vLLM's
    own server, the cold and warm start goals."""
    have = {s: starts(r) for s, r in recs.items()}
    have = {s: v for s, v in have.items() if v}
    if not have:
        return []
    fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs) if xs else "-"  # noqa: E731
    lines = ["", "Start-up: seconds from the server's process start to /health answering (cold: its own "
             "empty cache folder, warm: the same folder after a start, shared: the default caches, "
             "which earlier servers may have filled):", "",
             "| setup | cold | warm | shared |", "|---|---|---|---|"]
    lines += [f"| {s} | {fmt(v.get('cold'))} | {fmt(v.get('warm'))} | {fmt(v.get('shared'))} |"
              for s, v in have.items()]
    lines += [f"- {s}: `mla-tune prebuild` before its cold start took {r['prebuild']['s']:.1f} s "
              f"(exit {r['prebuild']['rc']}), not counted in it" for s, r in recs.items() if r.get("prebuild")]
    def cold_with(r: dict, jit_cache: str) -> bool:       # a cold start found FlashInfer's cache so
        return any(st.get("cache") == "cold" and st.get("flashinfer_cache") == jit_cache
                   for st in r.get("starts") or [r])
    filled = [s for s, r in recs.items() if cold_with(r, "filled")]
    if filled:
        lines.append(f"- cold, but FlashInfer's JIT cache already filled (prebuilt or copied in): {', '.join(filled)}")
    jit = [s for s, r in recs.items() if s != "vllm_default" and not r.get("prebuild") and cold_with(r, "empty")]
    if jit:
        lines.append(f"- cold with FlashInfer's JIT cache empty and no `mla-tune prebuild`: {', '.join(jit)} "
                     "built the config's FlashInfer modules inside the start (nvcc); the goal allows the "
                     "prebuild, timed apart")
    t, b = have.get("tuned", {}), have.get("vllm_default", {})
    for state, goal in (("cold", COLD_GOAL), ("warm", WARM_GOAL)):
        if t.get(state) and b.get(state):
            r = statistics.median(t[state]) / statistics.median(b[state])
            lines.append(f"- {state} start, tuned / vllm_default <= {goal}: {'met' if r <= goal else 'NOT met'} "
                         f"({r:.2f}: {statistics.median(t[state]):.1f} s against {statistics.median(b[state]):.1f} s)")
    return lines


def model_title(model: str) -> str:
    spec = MODELS[model]
    return f"## {model}: {spec['heads']} heads, {spec['layers']} layers" + (f"; {spec['about']}" if "about" in spec else "")


def report(record: dict, meta: dict) -> str:
    lines = [f"# {meta.get('title', '`vllm serve` + `vllm bench serve`')}: {meta['device']} ({meta['date']})",
             "", meta["note"], "", f"Compilation: {COMPILATION[compilation_of(meta)][1]}.", ""]
    models = sorted({r["model"] for r in record.values()}, key=list(MODELS).index)
    for model in models:
        recs = {r["setup"]: r for r in record.values() if r["model"] == model}
        lines += [model_title(model), ""]
        for s, r in recs.items():
            if "skipped" in r or "error" in r:
                lines.append(f"- {s}: {r.get('skipped') or 'FAILED: ' + r['error']}")
            elif r.get("partial"):
                n = len(r.get("runs", {}))
                lines.append(f"- {s}: partial, cut before it finished ({n} cell{'s' * (n != 1)} measured)")
            if failed := failures(r):
                lines.append(f"- {s}: " + "; ".join(failed))
            lines += [f"- {s}: the server log warns: {w}" for w in log_warnings(r)
                      if SETUPS.get(s, ([], True))[1] or "no tuned config" not in w]   # by design
            for i, st in enumerate(r.get("starts", [])):
                if "error" in st:
                    lines.append(f"- {s}: start {i + 1} ({st['cache']} caches) FAILED: {st['error']}")
        lines += startup_lines(recs)
        lines += tokens_lines(recs)
        lines.append("")
        runs = sorted({k for r in recs.values() for k in r.get("runs", {})}, key=cell_order)
        setups = [s for s in SETUPS if s in recs and recs[s].get("runs")]
        others = [s for s in setups if s != "tuned"] if "tuned" in setups else []
        head = "| workload@rate | metric | " + " | ".join(setups + [f"tuned/{s}" for s in others]) + " |"
        if runs:
            lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for k in runs:
            for metric in ("p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms", "p50_ttft_ms",
                           "p99_ttft_ms", "output_throughput"):
                vals = {s: recs[s]["runs"].get(k, {}).get(metric) for s in setups}
                cells = [f"{v:.2f}" if v is not None else "-" for v in vals.values()]
                if metric == "p50_tpot_ms":     # with repeats: the median, then the range
                    cells = [c + (f" [{min(t):.2f}-{max(t):.2f}]" if len(t := tpots(recs[s], k)) > 1 else "")
                             for c, s in zip(cells, setups)]
                t = vals.get("tuned")
                rat = [f"{_ratio(t, vals[s]):.3f}" if _ratio(t, vals[s]) else "-" for s in others]
                lines.append(f"| {k} | {metric} | " + " | ".join(cells + rat) + " |")
        lines.append("")
        for s in setups:
            if s == "tuned":
                continue
            g = geomean([_ratio(recs["tuned"]["runs"].get(k, {}).get("p50_tpot_ms"),
                                recs[s]["runs"].get(k, {}).get("p50_tpot_ms")) for k in runs]) \
                if "tuned" in setups else None
            if g:
                lines.append(f"- p50 TPOT tuned / {s}, geomean over {len(runs)} workload-rates: {g:.3f}")
        if "tuned" in setups and (met := goals(recs, runs, MODELS[model]["heads"])):
            lines += ["", "Goals (p50 TPOT ratios; < 1: tuned faster):", ""] + met
        for field, what in (("profile", "one long request decoding"),
                            ("profile_batch", "a batch of requests decoding together")):
            profiles = {s: restep(r[field], MODELS[model]["layers"]) for s, r in recs.items() if field in r}
            if profiles:
                shape = next((f" ({p['requests']} x {p['prompt_tokens']} prompt tokens)" for p in profiles.values()
                              if "requests" in p), "")
                lines += ["", f"Profile, {what}{shape} (GPU kernels in vLLM's torch profiler traces):", ""]
                lines += bound_lines(profiles, goal=LONG_TPOT_GOAL if field == "profile"
                                     and MODELS[model]["heads"] == 16 else None)
        lines.append("")
    lines += share_lines(record)
    return "\n".join(lines)


def share_lines(record: dict) -> list[str]:
    """Every model's profiles side by side: GPU time of a decode step, attention's part and share,
    and the host's time per decode-only step."""
    rows = []
    for r in sorted(record.values(), key=lambda r: (list(MODELS).index(r["model"]), list(SETUPS).index(r["setup"])
                                                    if r["setup"] in SETUPS else 99)):
        for field, what in (("profile", "1 long request"), ("profile_batch", "batch")):
            p = restep(r[field], MODELS[r["model"]]["layers"]) if field in r else None
            if not p or "per_step_us" not in p:
                continue
            h = p.get("host", {})
            rows.append(f"| {r['model']} | {r['setup']} | {p.get('requests', 1)} x {p.get('prompt_tokens')} | "
                        f"{p['step_kernel_us']:.0f} | "
                        f"{p['per_step_us']['attention']:.0f} | {100 * (p['attention_share'] or 0):.0f}% | "
                        f"{h.get('execute_model_us', '-')} | {h.get('metadata_build_us', '-')} | "
                        f"{h.get('plugin_code_us', '-')} |")
    if not rows:
        return []
    return ["## Attention's share of a decode step, by model (torch profiles above)", "",
            "GPU: kernel time per decode step (us) and attention's part; host: us per decode-only step in "
            "vLLM's execute_model, and with --profile-stack (Python tracer on, inflated) in the MLA metadata "
            "build and in the plugin's code.", "",
            "| model | setup | requests x prompt tokens | GPU us/step | attention us/step | attention share | "
            "host execute_model us | host metadata build us | host plugin code us |",
            "|---|---|---|---|---|---|---|---|---|", *rows, ""]


def render(data: dict) -> str:
    """A results file's report: its run, then each follow-up run attached to it (`--attach`)."""
    return "\n\n".join([report(data["runs"], data["meta"])]
                       + [report(f["runs"], f["meta"]) for f in data.get("followups", [])])


def attach(results: Path, run: Path) -> str | None:
    """Add the run in `run` (a serve_bench.json) to `results` as a follow-up, rewrite `results`
    and its .md beside it; None, or why not (nothing is written then)."""
    try:
        data, new = json.loads(results.read_text()), json.loads(run.read_text())
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    for path, d in ((results, data), (run, new)):
        if not isinstance(d, dict) or not d.get("runs") or not isinstance(d.get("meta"), dict):
            return f"{path}: no serve_bench run in it"
    if new["meta"].get("device") != data["meta"].get("device"):
        return f"{run} ran on {new['meta'].get('device')}, {results} on {data['meta'].get('device')}"
    new["meta"].setdefault("title", "Follow-up")
    data.setdefault("followups", []).append({"runs": new["runs"], "meta": new["meta"]})
    save(results, data)
    return None


def save(path: Path, data: dict) -> None:
    """A results file and its report beside it (the same name, .md)."""
    md = render(data)
    path.write_text(json.dumps(data, indent=1))
    path.with_suffix(".md").write_text(md)


def prompt_spec(text: str) -> int | tuple[int, int]:
    """--profile-batch-prompt: N tokens, or LO-HI (a length drawn from that range per request)."""
    try:
        lens = tuple(int(x) for x in text.split("-", 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: N or LO-HI prompt tokens") from None
    if lens[0] < 1 or lens[0] > lens[-1]:
        raise argparse.ArgumentTypeError(f"{text!r}: positive, LO <= HI")
    return lens if len(lens) == 2 else lens[0]


def select_cells(workloads: dict, cells: str) -> dict | str:
    """The workloads with only the rates `cells` names ("long@4,chat@8"; empty: all of them), or
    why `cells` names something they do not have."""
    wanted = [c.strip() for c in cells.split(",") if c.strip()]
    if not wanted:
        return workloads
    have = [f"{w}@{r}" for w, wl in workloads.items() for r in wl[4]]
    if bad := [c for c in wanted if c not in have]:
        return f"no such cell {', '.join(bad)} (these workloads have: {', '.join(have)})"
    rates = {w: tuple(r for r in wl[4] if f"{w}@{r}" in wanted) for w, wl in workloads.items()}
    return {w: workloads[w][:4] + (rs,) for w, rs in rates.items() if rs}


def dry_run(models: list[str], setups: list[str], args) -> list[str]:
    """Each server's command line and the environment serve_bench sets for it, nothing started."""
    keys = ("VLLM_METAX_FORCE", "VLLM_METAX_MLA_CONFIG_FOLDER", "VLLM_METAX_MLA_PACKAGED_FOLDER",
            "VLLM_USE_FLASHINFER_SAMPLER", *cache_env(Path(".")))
    out = [f"# compilation: {args.compilation}: {COMPILATION[args.compilation][1]}"]
    for model in models:
        for setup in setups:
            cache = args.cache_root / f"{model}_{setup}" if args.cache_root else None
            env = server_env(setup, args.config_folder, args.out / "no_configs", cache)
            shown = ([f"-u {k}" for k in keys if k in os.environ and k not in env]
                     + [f"{k}={env[k]}" for k in keys if k in env and env[k] != os.environ.get(k)])
            extra = (model_args(model) + (profiler_args(args.out / f"trace_{model}_{setup}", args.profile_stack)
                                          if args.profile else [])
                     + tokens_args(args) + user_server_args(args))
            cmd = server_args(args.model_root / model, setup, args.port, args.compilation, extra)
            out.append(f"[{model}/{setup}] env {' '.join(shown)} {' '.join(cmd)}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="h16,h128")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                    help=f"of {', '.join(WORKLOADS)} (default: {','.join(DEFAULT_WORKLOADS)})")
    ap.add_argument("--server-args", default="", metavar="ARGS",
                    help="more `vllm serve` arguments for every server, one shell-quoted string "
                         "(e.g. a --speculative-config)")
    ap.add_argument("--config-folder", default=None,
                    help="tuned configs for the `tuned` setup (default: the packaged ones)")
    ap.add_argument("--model-root", type=Path, default=Path("/tmp/serve_bench_models"))
    ap.add_argument("--compilation", choices=list(COMPILATION), default="default",
                    help="default: vLLM's (torch.compile, FULL_AND_PIECEWISE), as users run it; "
                         "eager-graphs: torch.compile off, full CUDA graphs for decode-only steps")
    ap.add_argument("--compile-off", dest="compilation", action="store_const", const="eager-graphs",
                    help="the same as --compilation eager-graphs")
    ap.add_argument("--cache-root", type=Path, default=None, metavar="DIR",
                    help="each server's caches (vLLM's torch.compile, FlashInfer's JIT, Triton, inductor) "
                         "in DIR/<model>_<setup>/, so no server warms another's")
    ap.add_argument("--start-only", type=int, default=0, metavar="N",
                    help="no workloads: start each server N times on its caches as they are (with "
                         "--cache-root: cold until a server has started on them, warm after), record "
                         "the ready times, stop it")
    ap.add_argument("--fresh-cache", action="store_true",
                    help="with --start-only and --cache-root: empty each setup's cache folder (one "
                         "serve_bench made) before its first start, so that start is cold")
    ap.add_argument("--prebuild", action="store_true",
                    help="with --cache-root: `mla-tune prebuild` before each plugin setup's cold "
                         "start, as after install; its time reported apart")
    ap.add_argument("--tokens", action="store_true",
                    help="each server also answers the served-tokens check (bench/serve_tokens.py); the "
                         "report classifies every divergence from the other setups")
    ap.add_argument("--dry-run", action="store_true",
                    help="print each server's command line and cache environment; start nothing")
    ap.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    ap.add_argument("--start-timeout", type=float, default=480,
                    help="seconds a server may take to answer /health (default compilation on a fresh "
                         "machine: 133-222 s on the lent H100)")
    ap.add_argument("--port", type=int, default=8471)
    ap.add_argument("--profile", action="store_true",
                    help="after each setup's workloads, a torch profile of decode steps (bench/server_profile.py)")
    ap.add_argument("--profile-stack", action="store_true",
                    help="with --profile: vLLM's Python tracer too, for the host time per step in the MLA "
                         "metadata build and the plugin's code (inflated by the tracer)")
    ap.add_argument("--profile-prompt", type=int, default=16384,
                    help="the profiled long request's prompt tokens (0: no single-request profile)")
    ap.add_argument("--profile-batch", type=int, default=32,
                    help="requests in the profiled batch (0: no batch profile)")
    ap.add_argument("--profile-batch-prompt", type=prompt_spec, default=512,
                    help="their prompt tokens each, or LO-HI: each drawn from that range (a ragged "
                         "batch, e.g. 8192-32768 like the long workloads)")
    ap.add_argument("--cells", default="",
                    help="only these workload@rate cells, e.g. long@4,chat@8 (default: every rate of "
                         "each workload)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each workload-rate on the same server (the report tests differences over them)")
    ap.add_argument("--attach", type=Path, default=None, metavar="RUN_JSON",
                    help="no servers: add this run's serve_bench.json to the results file given as "
                         "--out (a .json) as a follow-up, and write its report beside it")
    args = ap.parse_args(argv)
    if args.attach:
        why = attach(args.out, args.attach)
        if why:
            print(f"serve_bench: --attach: {why}", file=sys.stderr)
            return 2
        print(f"{args.out}: {args.attach} attached; report {args.out.with_suffix('.md')}")
        return 0
    # `timeout` sends SIGTERM: unwind, so each server's process group is stopped (they run in
    # sessions of their own, which the device tool would leave running)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    models = [m for m in args.models.split(",") if m]
    setups = [s for s in args.setups.split(",") if s]
    bad = [m for m in models if m not in MODELS] + [s for s in setups if s not in SETUPS]
    if bad:
        print(f"serve_bench: unknown model or setup: {', '.join(bad)}", file=sys.stderr)
        return 2
    if args.repeats < 1 or (args.repeats > 1 and not testable(args.repeats, args.repeats)):
        print(f"serve_bench: --repeats {args.repeats}: 1, or 3 or more (two repeats each cannot reach "
              f"Mann-Whitney p < {SERVE_P:g})", file=sys.stderr)
        return 2
    if args.start_only < 0:
        print(f"serve_bench: --start-only {args.start_only}: a number of starts, 1 or more", file=sys.stderr)
        return 2
    if args.dry_run:
        for line in dry_run(models, setups, args):
            print(line)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    pool = QUICK if args.quick else WORKLOADS
    workloads = select_cells({w: pool[w] for w in args.workloads.split(",") if w in pool}, args.cells)
    if isinstance(workloads, str):
        print(f"serve_bench: --cells: {workloads}", file=sys.stderr)
        return 2
    empty = args.out / "no_configs"
    empty.mkdir(exist_ok=True)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    path = args.out / "serve_bench.json"
    data = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    record = data["runs"]

    def checkpoint():
        data["meta"] = {
            "device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "compilation": args.compilation, "cache_root": str(args.cache_root) if args.cache_root else None,
            "start_only": args.start_only,
            "workloads": {} if args.start_only else {k: list(v) for k, v in workloads.items()},
            "repeats": args.repeats,
            "note": ("Each cell: vLLM's `vllm bench serve` result for that server"
                     + (f", the median of {args.repeats} runs (repeat i with seed i), p50 TPOT with "
                        "its range" if args.repeats > 1 else ", one run") +
                     "; times in ms, output_throughput in tokens/s; ratios < 1 mean tuned is "
                     "faster (for throughput, > 1).")
                    + PROFILE_NOTE.get(os.environ.get("VLLM_METAX_PROFILE", ""), ""),
            "profile": os.environ.get("VLLM_METAX_PROFILE") or "the device's"}
        save(path, data)

    first = True
    for model in models:
        t0 = time.time()
        model_dir = make_model(model, args.model_root, "cuda" if torch.cuda.is_available() else "cpu")
        print(f"model {model}: {model_dir} ({time.time() - t0:.1f} s)", flush=True)
        if first:
            try:
                print(f"preflight: vLLM's HTTP app builds ({preflight(model_dir)} routes)", flush=True)
            except Exception as e:  # noqa: BLE001 - every server would fail the same way, later
                print(f"preflight: vLLM's HTTP app does not build here: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
                return 3
        for setup in setups:
            if args.start_only:
                start_only(model, setup, model_dir, args, empty, args.port, record, checkpoint)
            else:
                run_setup(model, setup, model_dir, args, empty, args.port, first, workloads, record, checkpoint)
            first = False
        if args.tokens and not args.start_only:
            check_failures(model, record, model_dir, "cuda" if torch.cuda.is_available() else "cpu", path)
            checkpoint()
    print((args.out / "serve_bench.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
