"""The server's own traffic, recorded when asked (`VLLM_METAX_TRAFFIC`), vllm-free: per decode step
the lookup key the tuned config is read by, per prefill plan its prefill statistic, counted into a
histogram that `mla-tune sweep --traffic`, `emit`, `report` and `doctor` read back.

What a decode step records is exactly what `ModelEntry.lookup` is asked: the batch's request
count, `decisions.bucket_context` of its host lengths (the mean) and q_len. A prefill plan records
`decisions.prefill_statistic`: the plan kind (causal new tokens, or a context chunk), total query
tokens and mean KV tokens per request. Batch and q_len are kept exactly (a server has at most
max_num_seqs batch sizes); lengths go into quarter-octave bins, `fine_bin(x) = floor(4 log2 x)`,
whose edges hold the edges of the lookup's log2 grid: a power of two 2^k is nearest (on a log2
scale) to exactly the fine bins 4k-2 .. 4k+1 (`log2_cell`), so the log2 grid, or any coarser
one, is derived on read.

The hot path (`TrafficRecorder.decode`, `.prefill`) adds one to a dict entry: no lock, no I/O, no
allocation beyond a small tuple. A daemon thread flushes every `FLUSH_SECONDS`, and at once when
the process is told to stop (SIGINT/SIGTERM), and `atexit` flushes the rest. The signal and the
short period both matter: `vllm serve` stops its engine core with SIGTERM and, under its default
`--shutdown-timeout 0`, kills it in the same instant, so no atexit handler runs there (seen on a
lent H100: a server stopped that way lost its last 30 s of counts). Each flush adds the counts
since the previous one into the file in one SQLite transaction (`INSERT ... ON CONFLICT DO UPDATE
SET steps = steps + excluded.steps`), so every engine process and data-parallel replica of a server
adds into one file. Tensor- and pipeline-parallel ranks of one replica see the same steps: only
their first rank records (the glue decides, `vllm_metax.backend.traffic_recorder`). The engine's
warm-up (memory profiling, compilation, CUDA-graph capture) runs dummy batches through the same
builders: the plugin's worker drops those counts when it ends (`discard_warmup`; the next flush
takes back any it wrote). Off by default; off, nothing is imported and a builder holds None.
sqlite3 is imported by the first flush only.

`VLLM_METAX_TRAFFIC` names a file, or a folder (an existing one, or a value ending in '/'): then
the server's first process picks `traffic-<host>-<pid>.db` in it and writes the chosen path back
into the variable (`resolve_path`), so the processes it spawns write the same file.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import socket
import threading
import time

from vllm_metax.core.log import get_logger

TRAFFIC_ENV = "VLLM_METAX_TRAFFIC"
# at most this many seconds of counts are lost where the process is killed; a flush writes only
# the counts that changed, in one transaction on the flush thread (bench/traffic_cost.py)
FLUSH_SECONDS = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
BINS_PER_OCTAVE = 4                 # the fine grid: quarter octaves
SCHEMA_VERSION = 1

logger = get_logger(__name__)

# one table per kind of plan; `model` is `model_label` of the entry key the steps were looked up by
SCHEMA = (
    "create table if not exists meta (key text primary key, value text)",
    "create table if not exists models (model text primary key, num_heads integer, "
    "kv_lora_rank integer, qk_rope_head_dim integer, q_dtype text, kv_dtype text)",
    "create table if not exists decode (model text, batch_size integer, q_len integer, "
    "context_bin integer, steps integer, primary key (model, batch_size, q_len, context_bin))",
    "create table if not exists prefill (model text, causal integer, query_bin integer, "
    "kv_bin integer, plans integer, primary key (model, causal, query_bin, kv_bin))",
    "create table if not exists writers (pid integer, host text, started real, last_flush real, "
    "steps integer, plans integer, primary key (host, pid, started))",
)


def fine_bin(x: int) -> int:
    """The quarter-octave bin of a length >= 1: floor(4 log2 x); bin i holds [2^(i/4), 2^((i+1)/4))."""
    return int(BINS_PER_OCTAVE * math.log2(x)) if x > 1 else 0


def bin_center(i: int) -> int:
    """A representative length of fine bin `i`: its geometric centre, rounded (at least 1)."""
    return max(1, round(2 ** ((i + 0.5) / BINS_PER_OCTAVE)))


def log2_cell(i: int) -> int:
    """The power of two a length in fine bin `i` is nearest to on a log2 scale (the lookup's
    snapping on a power-of-two grid; exact: bin edges fall on the grid's midpoints)."""
    return 1 << max(0, (i + BINS_PER_OCTAVE // 2) // BINS_PER_OCTAVE)


def model_label(dims) -> str:
    """One string per tuned-config model key (`tuned_config.ModelDims`)."""
    return (f"H{dims.num_heads} r{dims.kv_lora_rank} rope{dims.qk_rope_head_dim} "
            f"{dims.q_dtype}/{dims.kv_dtype}")


def resolve_path(environ=None) -> str | None:
    """The file `VLLM_METAX_TRAFFIC` names (None: off). A folder becomes a file of this server in
    it, written back into the variable for the processes the server spawns."""
    env = os.environ if environ is None else environ
    raw = env.get(TRAFFIC_ENV, "").strip()
    if not raw:
        return None
    if raw.endswith(("/", os.sep)) or os.path.isdir(raw):
        raw = os.path.join(raw, f"traffic-{socket.gethostname()}-{os.getpid()}.db")
        env[TRAFFIC_ENV] = raw
    return raw


class TrafficRecorder:
    """The counts of one process for one model key, and their flushes into `path`."""

    def __init__(self, path: str, dims, flush_seconds: float = FLUSH_SECONDS,
                 device_name: str | None = None):
        self.path = path
        self.dims = dims
        self.device_name = device_name        # the server's device: which tuned config it served
        self.model = model_label(dims)
        self.decode_counts: dict = {}        # (batch, q_len, context bin) -> steps
        self.prefill_counts: dict = {}       # (causal, query bin, kv bin) -> plans
        self._flushed_decode: dict = {}      # what the file holds from this process already
        self._flushed_prefill: dict = {}
        self._lock = threading.Lock()        # flushes only (the thread's and atexit's)
        self._started = time.time()
        self.error: str | None = None
        self._stop = threading.Event()
        self._now = threading.Event()        # set: the flush thread flushes at once
        self._chained: dict = {}             # signal -> (our handler, the one it chains)
        self._thread = None
        if flush_seconds > 0:
            self._thread = threading.Thread(target=self._flush_loop, args=(flush_seconds,),
                                            name="vllm_metax-traffic", daemon=True)
            self._thread.start()
            self._flush_on_stop_signals()
        atexit.register(self.close)

    # ---------------------------------------------------------------- the hot path

    def decode(self, batch_size: int, context: int, q_len: int) -> None:
        """One decode step: its lookup key (`ModelEntry.lookup`'s arguments)."""
        if _paused:
            return
        k = (batch_size, q_len, int(4 * math.log2(context)) if context > 1 else 0)
        c = self.decode_counts
        c[k] = c.get(k, 0) + 1

    def prefill(self, causal: bool, query_tokens: int, kv_len: int) -> None:
        """One prefill plan: `decisions.prefill_statistic`'s (query tokens, KV per request)."""
        if _paused:
            return
        k = (bool(causal), fine_bin(query_tokens), fine_bin(kv_len))
        c = self.prefill_counts
        c[k] = c.get(k, 0) + 1

    def discard(self) -> int:
        """Drop every count so far (the next flush takes back what the file got of them); returns
        the steps dropped. For the engine's warm-up: its dummy batches are no server traffic."""
        with self._lock:
            dropped = sum(self.decode_counts.values())
            self.decode_counts, self.prefill_counts = {}, {}
        return dropped

    # ---------------------------------------------------------------- flushing

    def _flush_loop(self, seconds: float) -> None:
        while not self._stop.is_set():
            self._now.wait(seconds)
            self._now.clear()
            if not self._stop.is_set():
                self.flush()

    def _flush_on_stop_signals(self) -> None:
        """SIGINT/SIGTERM wake the flush thread before the handler in place runs (vLLM's engine
        core installs its own before it builds the model, so it is chained, never replaced). In
        front of a handler the process has, it does no I/O itself (the signal can land while this
        thread holds the flush lock); where the default would end the process at once, it flushes
        first, waiting at most a second for the lock, then ends it as the default would. Only the
        main thread may set handlers; elsewhere the period alone bounds the loss."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            before = signal.getsignal(sig)
            if before is None:           # set outside Python: left as it is
                continue
            handler = self._stop_handler(before)
            signal.signal(sig, handler)
            self._chained[sig] = (handler, before)

    def _stop_handler(self, before):
        now = self._now

        def handler(signum, frame):
            if before == signal.SIG_DFL:     # terminate as the default would, after the flush
                self.flush(timeout=1.0)
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return None
            now.set()
            return before(signum, frame) if callable(before) else None   # SIG_IGN: ignored
        return handler

    def close(self) -> None:
        """Stop the flush thread and flush what is left (atexit: once)."""
        self._stop.set()
        self._now.set()
        atexit.unregister(self.close)
        if threading.current_thread() is threading.main_thread():
            for sig, (handler, before) in self._chained.items():
                if signal.getsignal(sig) is handler:     # still ours: the chained one is back
                    signal.signal(sig, before)
            self._chained = {}
        self.flush()

    def flush(self, timeout: float = -1) -> bool:
        """Add the counts since the last flush into the file, in one transaction. A failure is
        logged once and keeps the counts for the next try; serving never stops for it. With a
        `timeout`, give up (False) where another flush holds the lock that long."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            # dict() of a dict of int tuples is one C call under the GIL: a consistent snapshot
            # while the hot path keeps counting
            dec, pre = dict(self.decode_counts), dict(self.prefill_counts)
            d_delta = _delta(dec, self._flushed_decode)
            p_delta = _delta(pre, self._flushed_prefill)
            if not d_delta and not p_delta:
                return True
            try:
                write_counts(self.path, self.dims, d_delta, p_delta, self._started,
                             sum(dec.values()), sum(pre.values()), self.device_name)
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the server
                if self.error is None:
                    logger.warning("vllm_metax: cannot write the traffic record %s: %s "
                                   "(kept in memory; retried at the next flush)", self.path, e)
                self.error = f"{type(e).__name__}: {e}"
                return False
            self._flushed_decode, self._flushed_prefill = dec, pre
            self.error = None
            return True
        finally:
            self._lock.release()


def _delta(now: dict, before: dict) -> dict:
    """What to add to the file: negative for counts dropped since (`discard`)."""
    return {k: now.get(k, 0) - before.get(k, 0) for k in now.keys() | before.keys()
            if now.get(k, 0) != before.get(k, 0)}


def write_counts(path: str, dims, decode: dict, prefill: dict, started: float = 0.0,
                 steps: int = 0, plans: int = 0, device_name: str | None = None) -> None:
    """Add `decode` ((batch, q_len, context bin) -> steps) and `prefill` ((causal, query bin,
    kv bin) -> plans) of model key `dims` into the traffic file at `path` (created if missing),
    in one transaction that waits for other writers."""
    import sqlite3      # lazy: only a recording server writes; the config reader never loads sqlite
    model = model_label(dims)
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    try:
        conn.execute("begin immediate")
        for stmt in SCHEMA:
            conn.execute(stmt)
        conn.execute("insert or ignore into meta values ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.execute("insert or ignore into meta values ('bins_per_octave', ?)", (str(BINS_PER_OCTAVE),))
        if device_name:
            conn.execute("insert or ignore into meta values ('device_name', ?)", (device_name,))
        conn.execute("insert or ignore into models values (?, ?, ?, ?, ?, ?)",
                     (model, dims.num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim,
                      dims.q_dtype, dims.kv_dtype))
        conn.executemany(
            "insert into decode values (?, ?, ?, ?, ?) on conflict (model, batch_size, q_len, "
            "context_bin) do update set steps = steps + excluded.steps",
            [(model, int(b), int(q), int(c), int(n)) for (b, q, c), n in decode.items()])
        conn.executemany(
            "insert into prefill values (?, ?, ?, ?, ?) on conflict (model, causal, query_bin, "
            "kv_bin) do update set plans = plans + excluded.plans",
            [(model, int(causal), int(qb), int(kb), int(n)) for (causal, qb, kb), n in prefill.items()])
        conn.execute("insert into writers values (?, ?, ?, ?, ?, ?) on conflict (host, pid, started) "
                     "do update set last_flush = excluded.last_flush, steps = excluded.steps, "
                     "plans = excluded.plans",
                     (os.getpid(), socket.gethostname(), started, time.time(), steps, plans))
        conn.execute("commit")
    except BaseException:
        if conn.in_transaction:
            conn.execute("rollback")
        raise
    finally:
        conn.close()


_RECORDERS: dict = {}
_RECORDERS_LOCK = threading.Lock()


def recorder(dims, environ=None, device_name: str | None = None) -> TrafficRecorder | None:
    """This process's recorder for model key `dims` where `VLLM_METAX_TRAFFIC` is set, else None
    (one per key and process; the server log names the file once). `device_name`: the device
    whose tuned config the server runs (kept in the file for `mla-tune report --traffic`)."""
    path = resolve_path(environ)
    if path is None or dims is None:
        return None
    with _RECORDERS_LOCK:
        key = (path, dims)
        rec = _RECORDERS.get(key)
        if rec is None:
            rec = _RECORDERS[key] = TrafficRecorder(path, dims, device_name=device_name)
            logger.info("vllm_metax: recording MLA traffic (%s) to %s: decode steps by batch, "
                        "context and q_len, prefill plans by size; flushed every %.0f s and at exit "
                        "(read it with `mla-tune report --traffic %s`)", rec.model, path,
                        FLUSH_SECONDS, path)
        return rec


_paused = False       # inside a dummy batch (`paused`): steps are not counted


@contextlib.contextmanager
def paused():
    """Steps inside are not counted: a data-parallel rank with no requests runs vLLM's dummy batch
    (`execute_dummy_batch`, one request) to keep in step with the others, which is no server
    traffic. The worker builds and runs that batch synchronously on its own thread."""
    global _paused
    before, _paused = _paused, True
    try:
        yield
    finally:
        _paused = before


def discard_warmup() -> None:
    """The engine finished its warm-up (memory profiling, compilation, CUDA-graph capture): what
    this process's recorders counted so far were dummy batches; drop them, and say so once."""
    with _RECORDERS_LOCK:
        recs = list(_RECORDERS.values())
    dropped = sum(r.discard() for r in recs)
    if recs:
        logger.info("vllm_metax: traffic recording counts from now on (%d warm-up decode steps "
                    "dropped)", dropped)


__all__ = ["BINS_PER_OCTAVE", "FLUSH_SECONDS", "TRAFFIC_ENV", "TrafficRecorder", "bin_center",
           "discard_warmup", "fine_bin", "log2_cell", "model_label", "paused", "recorder", "resolve_path", "write_counts"]
