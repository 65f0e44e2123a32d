"""FlashInfer's fa2/fa3 MLA modules and vLLM's Triton MLA kernels compiled in background
processes while the sweep measures.

FlashInfer: each module (one per backend, dtype and head dims; not per page size or batch) takes ~20 s of
nvcc on first use, and the worker would compile them one after the other, inside its first
bucket. `start_prebuild` launches one child process that builds every module the sweep will
plan, in parallel threads, through FlashInfer's own JIT spec and its file lock: the worker's
first plan() of a module waits on that lock (or finds it built) instead of compiling it again.
The child touches no CUDA stream (it runs ninja), so it cannot disturb a measurement beyond
sharing the CPU. Best effort: any failure leaves the compile to the worker, as before.

Triton: vLLM's decode kernel is compiled once per head count, page size and split count (all
three are constexprs: 0.8 s each, 78 of them in the H200 default sweep, one after the other in
the worker); the split family's kernels once per head count, pipe and partials' dtype (and the
merge kernel where a request splits: 0.2-1.6 s each compiled ahead of time for sm_90a on the CPU
machine, 2026-12-05). `start_triton_prebuild` hands every specialisation the sweep's candidates need, in
the order the sweep meets them, to a pool of processes that compile without launching anything
(Triton's own warm-up path, `JITFunction.run(warmup=True)`, on unwritten tensors of the real
shapes and strides); each writes Triton's on-disk cache, where the worker's first launch finds
the kernel. A specialisation the worker reaches first is simply compiled there, as before.

`MLA_TUNE_JIT_PREBUILD=0` turns both off.
"""

from __future__ import annotations

import inspect
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Iterable, Sequence

from mla_tune.families import get_family
from mla_tune.families.base import Candidate
from mla_tune.problem.workload import Workload
from vllm_metax.ops.flashinfer_jit import JIT_BACKENDS as BACKENDS   # FlashInfer compiles these per shape
from vllm_metax.ops.flashinfer_jit import decode_module

# FlashInfer, Triton and torch are imported in the functions that build with them: the sweep and
# `mla-tune prebuild` import this module to start builds in child processes, and stay light.

ENV = "MLA_TUNE_JIT_PREBUILD"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "no", "false", "")


def module_specs(workloads: Iterable) -> list[tuple]:
    """(q_dtype, kv_dtype, kv_lora_rank, rope_dim) of every FlashInfer MLA module `workloads`
    need, once each (the output dtype is the query's, the index dtype int32)."""
    return sorted({(w.q_dtype, w.kv_dtype, w.kv_lora_rank, w.qk_rope_head_dim) for w in workloads})


def start_prebuild(workloads: Iterable, backends: Iterable[str] = BACKENDS):
    """The background build of the modules `workloads` need (a Popen), or None when turned off
    or there is nothing to build."""
    specs = module_specs(workloads)
    backends = [b for b in backends if b in BACKENDS]
    if not enabled() or not specs or not backends:
        return None
    code = f"from {__name__} import main; main({json.dumps(backends)!r}, {json.dumps(specs)!r})"
    try:
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:
        return None


def finish_prebuild(proc, wait_s: float = 0.0) -> None:
    """Wait for the background build up to `wait_s`, then end it (it may be mid-compile: the
    lock and ninja's own state keep the cache consistent for the next use)."""
    if proc is None:
        return
    try:
        proc.wait(timeout=wait_s) if wait_s else None
    except subprocess.TimeoutExpired:
        pass
    # the child leads its own session: end its whole group (the Triton pool's processes too)
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError, OSError):
        if proc.poll() is None:
            proc.send_signal(sig)


def _build(backend: str, spec: list) -> None:
    q, kv, rank, rope = spec
    decode_module(backend, q, kv, rank, rope).spec().build(need_lock=True)


def build_modules(modules: Sequence, jobs: int, done=None) -> list[tuple]:
    """Build FlashInfer JIT modules (`vllm_metax.ops.flashinfer_jit.JitModule`) into FlashInfer's
    cache, about `jobs` compiler processes at once: every module at the same time, one ninja each
    (under the module's own lock, in its own folder, as a server's first plan builds it, so the
    server's ninja finds it up to date), the jobs shared out by the module's source files (a
    module's ninja cannot lend its slots to another's). Returns (module, seconds, error or None)
    in the order given; `done(module, seconds, error)` is called as each finishes."""
    if not modules:
        return []
    lock = threading.Lock()

    def one(m, spec, slots):
        t0 = time.monotonic()
        try:
            if spec is None:
                spec = m.spec()
            _run_build(spec, slots)
            err = None
        except Exception as e:   # noqa: BLE001 - reported per module, the others go on
            err = build_error(e)
        out = (m, time.monotonic() - t0, err)
        if done is not None:
            with lock:
                done(*out)
        return out

    specs = []
    for m in modules:
        try:
            specs.append(m.spec())
        except Exception:       # noqa: BLE001 - met again, and reported, in its build
            specs.append(None)
    sizes = [max(1, len(getattr(sp, "sources", ()) or ())) for sp in specs]
    slots = [max(1, round(int(jobs) * n / sum(sizes))) for n in sizes]
    with ThreadPoolExecutor(len(modules)) as pool:       # ninja and nvcc run outside the GIL
        return list(pool.map(one, modules, specs, slots))


def _run_build(spec, max_jobs: int) -> None:
    """FlashInfer's `JitSpecNvcc.build(need_lock=True)` with ninja's job count given (it reads
    MAX_JOBS from the environment, which threads share): write the module's ninja file and run
    it in its folder under its lock. Another FlashInfer line builds through its own build()."""
    try:
        from filelock import FileLock
        from flashinfer.jit.cpp_ext import run_ninja
    except ImportError:
        run_ninja = None
    if run_ninja is None or "max_jobs" not in inspect.signature(run_ninja).parameters \
            or not all(hasattr(spec, a) for a in ("lock_path", "write_ninja", "build_dir", "ninja_path")):
        spec.build(need_lock=True)
        return
    with FileLock(spec.lock_path, thread_local=False):
        spec.write_ninja()
        run_ninja(spec.build_dir, spec.ninja_path, False, max_jobs=int(max_jobs))


def build_error(e: Exception) -> str:
    """One line for a failed module build: the compiler's or linker's first error line where
    ninja's output has one, else the exception's first line."""
    text = str(e)
    for line in text.splitlines():
        low = line.lower()
        if any(w in low for w in ("error", "fatal", "cannot find")) \
                and not low.startswith("ninja: build stopped"):
            return line.strip()[:300]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def main(backends_json: str, specs_json: str) -> None:
    """The child: build every (backend, spec) module in parallel threads (ninja runs outside
    the GIL); errors are the worker's to meet and report when it plans."""
    jobs = [(b, s) for b in json.loads(backends_json) for s in json.loads(specs_json)]

    def one(b, s):
        try:
            _build(b, s)
        except Exception:   # noqa: BLE001 - best effort, see the module docstring
            pass

    threads = [threading.Thread(target=one, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---------------------------------------------------------------- vLLM's Triton MLA kernels

TRITON_FAMILY = "triton"       # mla_tune.families.triton_mla.TritonMLAFamily.family
SPLIT_FAMILY = "split"         # mla_tune.families.split.SplitFamily.family
MAX_TRITON_PROCS = 8


def _kernel_key(w, c: Candidate, longest: int):
    """What a candidate's Triton kernels are specialised on, beyond the workload's dtypes and
    head dims. vLLM's decode: q_len, page size, split count (constexprs) and the block table's
    width class (its row stride is an integer argument, which Triton specialises by divisibility
    by 16 and by being 1). The split kernel: page size, pipe and partials' dtype, and whether a
    merge kernel runs (more than one split); its split count and table stride are not
    specialised on."""
    if c.family == TRITON_FAMILY:
        width = -(-longest // c.page_size)
        return (w.q_len, c.page_size, c.params.get("num_kv_splits"), c.params.get("variant"),
                width == 1, width % 16 == 0)
    return (c.page_size, c.params.get("pipe"), c.params.get("partial"), c.params.get("num_splits", 1) > 1)


def triton_jobs(buckets: Iterable[tuple], profile: str | None = None) -> list[dict]:
    """One compile job per Triton kernel specialisation that the Triton and split candidates of
    `buckets` ((workload, candidates) pairs, in sweep order) need, first needed first
    (`_kernel_key`). A job holds a one-request workload with the longest request's length: the
    same table width. `profile`: the target profile the families are prepared under."""
    seen, jobs = set(), []
    for w, cands in buckets:
        longest = max(w.seq_lens)
        for c in cands:
            if c.family not in (TRITON_FAMILY, SPLIT_FAMILY):
                continue
            key = (c.family, w.q_dtype, w.kv_dtype, w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim,
                   _kernel_key(w, c, longest))
            if key in seen:
                continue
            seen.add(key)
            jobs.append({"family": c.family, "num_heads": w.num_heads, "kv_lora_rank": w.kv_lora_rank,
                         "qk_rope_head_dim": w.qk_rope_head_dim, "softmax_scale": w.softmax_scale,
                         "context_len": longest, "q_len": w.q_len, "q_dtype": w.q_dtype,
                         "kv_dtype": w.kv_dtype, "backend": c.backend, "page_size": c.page_size,
                         "params": c.params, "profile": profile})
    return jobs


def triton_procs() -> int:
    """Compiling processes: half the cores (the worker and FlashInfer's nvcc need the rest), at
    most MAX_TRITON_PROCS."""
    return max(1, min(MAX_TRITON_PROCS, (os.cpu_count() or 2) // 2))


def start_triton_prebuild(jobs: Sequence[dict], procs: int | None = None):
    """The background compile of `jobs` (a Popen), or None when turned off or nothing to do."""
    if not enabled() or not jobs:
        return None
    code = f"from {__name__} import main_triton; main_triton({int(procs or triton_procs())})"
    try:
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:
        return None
    try:
        proc.stdin.write(json.dumps(list(jobs)).encode())
        proc.stdin.close()
    except OSError:          # the child died at once: the worker compiles, as without it
        pass
    return proc


def compile_only() -> None:
    """Make every Triton launch in this process compile and return without running (Triton's
    warm-up path), so a kernel family's own launch code fills the cache without a GPU kernel.

    Warm-up compiles the kernel but not its launcher: the C module Triton builds (with the host
    compiler) for each kernel signature on the first real launch, and caches beside the kernels
    (`CompiledKernel._init_handles`, Triton 3.6). So the kernel's handles are initialised here
    too, which builds the launcher into the cache and loads the binary (no launch)."""
    from triton.runtime.jit import JITFunction
    if getattr(JITFunction.run, "_mla_tune_compile_only", False):
        return
    launch = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        if hasattr(kernel, "result"):        # Triton's asynchronous compile mode
            kernel = kernel.result()
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            init()
        return kernel

    run._mla_tune_compile_only = True
    JITFunction.run = run


def compile_triton(job: dict) -> bool:
    """Compile one job's kernels through the Triton family's own prepare() on an unwritten
    problem (needs compile_only() first); False where it failed (the worker will say why)."""
    try:
        import torch
        from mla_tune.problem.instance import make_problem
        w = Workload(job["num_heads"], job["kv_lora_rank"], job["qk_rope_head_dim"],
                     job["softmax_scale"], 1, job["context_len"], job["q_len"],
                     q_dtype=job["q_dtype"], kv_dtype=job["kv_dtype"])
        family = job.get("family", TRITON_FAMILY)
        if family not in (TRITON_FAMILY, SPLIT_FAMILY):
            return False
        cand = Candidate(family, job["backend"], job["page_size"], dict(job["params"]))
        problem = make_problem(w, cand.page_size, "cuda", fill=False)
        get_family(family, job.get("profile")).prepare(w, cand, problem)
        del problem
        torch.cuda.empty_cache()
        return True
    except Exception:   # noqa: BLE001 - best effort, see the module docstring
        return False


def main_triton(procs: int, jobs: Sequence[dict] | None = None) -> int:
    """The child: read the jobs (JSON on stdin unless given) and compile them on `procs`
    processes (here, one after the other, when 1); returns how many compiled."""
    if jobs is None:
        jobs = json.loads(sys.stdin.read() or "[]")
    if procs <= 1:
        compile_only()
        return sum(compile_triton(j) for j in jobs)
    with ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn"),
                             initializer=compile_only) as pool:
        return sum(pool.map(compile_triton, jobs))
