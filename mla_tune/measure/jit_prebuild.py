"""FlashInfer's fa2/fa3 MLA modules compiled in a background process while the sweep measures.

Each module (one per backend, dtype and head dims; not per page size or batch) takes ~20 s of
nvcc on first use, and the worker would compile them one after the other, inside its first
bucket. `start_prebuild` launches one child process that builds every module the sweep will
plan, in parallel threads, through FlashInfer's own JIT spec and its file lock: the worker's
first plan() of a module waits on that lock (or finds it built) instead of compiling it again.
The child touches no CUDA stream (it runs ninja), so it cannot disturb a measurement beyond
sharing the CPU. Best effort: any failure leaves the compile to the worker, as before.
`MLA_TUNE_JIT_PREBUILD=0` turns it off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Iterable

ENV = "MLA_TUNE_JIT_PREBUILD"
BACKENDS = ("fa2", "fa3")


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
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _build(backend: str, spec: list) -> None:
    import torch
    from flashinfer.jit import gen_batch_mla_module
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    q, kv, rank, rope = spec
    gen_batch_mla_module(backend, dt[q], dt[kv], dt[q], torch.int32, int(rank), int(rope),
                         False).build(need_lock=True)


def main(backends_json: str, specs_json: str) -> None:
    """The child: build every (backend, spec) module in parallel threads (ninja runs outside
    the GIL); errors are the worker's to meet and report when it plans."""
    import threading
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
