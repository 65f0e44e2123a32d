"""The plugin's traffic recorder (vllm_metax.core.traffic) and its reader (mla_tune.store.traffic):
the bins, the log2 grid derived from them against the lookup's own snapping, flushes that add
(several processes into one file), the folder form of the switch, and the hook in the builders."""

from __future__ import annotations

import logging
import multiprocessing
import os
import random

import pytest

from mla_tune.store import traffic as tr
from mla_tune.tune.choose import bucket_weights
from vllm_metax.core import traffic as rec
from vllm_metax.core.tuned_config import ModelDims
from vllm_metax.core.tuned_config.schema import nearest

DIMS = ModelDims(16, 512, 64, "bfloat16", "bfloat16")
OTHER = ModelDims(128, 512, 64, "bfloat16", "bfloat16")


# ---------------------------------------------------------------- bins and the log2 grid

def test_fine_bins_hold_quarter_octaves():
    assert rec.fine_bin(1) == 0 and rec.fine_bin(2) == 4 and rec.fine_bin(4096) == 48
    for x in list(range(1, 5000)) + [random.Random(0).randrange(1, 1 << 22) for _ in range(5000)]:
        i = rec.fine_bin(x)
        assert 2 ** (i / 4) <= x < 2 ** ((i + 1) / 4) * (1 + 1e-12), x


def test_log2_cells_are_what_the_lookup_snaps_to():
    """The log2 grid derived from the fine bins is exactly `ModelEntry.lookup`'s snapping on a
    power-of-two grid, for every length."""
    grid = [1 << k for k in range(23)]
    values = list(range(1, 70000)) + [random.Random(1).randrange(1, 1 << 22) for _ in range(20000)]
    for x in values:
        assert rec.log2_cell(rec.fine_bin(x)) == nearest(grid, x), x
        assert tr.log2_of(x) == nearest(grid, x)


def test_the_recorded_key_is_the_lookups(tmp_path):
    r = rec.TrafficRecorder(str(tmp_path / "t.db"), DIMS, flush_seconds=0)
    r.decode(24, 6000, 2)
    r.decode(24, 6001, 2)
    r.decode(1, 1, 1)
    assert r.decode_counts == {(24, 2, rec.fine_bin(6000)): 2, (1, 1, 0): 1}
    r.prefill(True, 2048, 512)
    assert r.prefill_counts == {(True, 44, 36): 1}
    r.close()


# ---------------------------------------------------------------- flushing

def test_flushes_add_only_what_is_new(tmp_path):
    path = str(tmp_path / "t.db")
    r = rec.TrafficRecorder(path, DIMS, flush_seconds=0)
    for _ in range(5):
        r.decode(32, 4096, 1)
    r.prefill(False, 256, 16384)
    assert r.flush()
    for _ in range(3):
        r.decode(32, 4096, 1)
    r.decode(8, 1000, 2)
    assert r.flush() and r.flush()          # the second adds nothing
    t = tr.load_traffic(path)
    m = t.select()
    assert m.dims == DIMS and m.steps == 9 and m.plans == 1
    assert m.decode_cells() == {(32, 4096, 1): 8, (8, 1024, 2): 1}
    assert m.prefill_cells() == {(False, 256, 16384): 1}
    assert t.writers == 1


def test_a_failed_flush_keeps_the_counts_and_says_so_once(tmp_path, caplog):
    path = tmp_path / "no-such-folder" / "t.db"
    r = rec.TrafficRecorder(str(path), DIMS, flush_seconds=0)
    r.decode(4, 512, 1)
    with caplog.at_level(logging.WARNING):
        assert not r.flush() and not r.flush()
    assert sum("cannot write the traffic record" in m for m in caplog.messages) == 1
    path.parent.mkdir()
    assert r.flush()
    assert tr.load_traffic(path).select().steps == 1


def _writer(path: str, heads: int, steps: int) -> None:
    r = rec.TrafficRecorder(path, ModelDims(heads, 512, 64, "bfloat16", "bfloat16"), flush_seconds=0)
    for i in range(steps):
        r.decode(1 + i % 64, 1024 + 37 * i, 1 + i % 2)
        if i % 100 == 0:
            r.flush()
    r.close()


def test_two_processes_add_into_one_file(tmp_path):
    """Two engine processes flushing into the same file, interleaved: no step lost or counted
    twice."""
    path = str(tmp_path / "shared.db")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, 16, 3000)) for _ in range(2)]
    procs.append(ctx.Process(target=_writer, args=(path, 128, 500)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    t = tr.load_traffic(path)
    assert t.writers == 3
    assert t.select(num_heads=16).steps == 6000 and t.select(num_heads=128).steps == 500
    single = str(tmp_path / "single.db")
    _writer(single, 16, 3000)
    one = tr.load_traffic(single).select().decode
    assert t.select(num_heads=16).decode == tuple(
        tr.DecodeCount(d.batch_size, d.q_len, d.context_bin, 2 * d.steps) for d in one)


def test_close_flushes_the_rest(tmp_path):
    path = str(tmp_path / "t.db")
    r = rec.TrafficRecorder(path, DIMS, flush_seconds=3600)     # the thread never gets to it
    r.decode(2, 100, 1)
    r.close()
    assert tr.load_traffic(path).select().steps == 1


# ---------------------------------------------------------------- the switch

def test_off_by_default(monkeypatch):
    monkeypatch.delenv(rec.TRAFFIC_ENV, raising=False)
    assert rec.resolve_path() is None and rec.recorder(DIMS) is None


def test_a_folder_becomes_one_file_for_the_server(tmp_path):
    env = {rec.TRAFFIC_ENV: str(tmp_path)}
    path = rec.resolve_path(env)
    assert os.path.dirname(path) == str(tmp_path) and path.endswith(f"-{os.getpid()}.db")
    assert env[rec.TRAFFIC_ENV] == path and rec.resolve_path(env) == path     # children: same file
    env = {rec.TRAFFIC_ENV: str(tmp_path / "new") + "/"}
    assert os.path.dirname(rec.resolve_path(env)) == str(tmp_path / "new")
    assert rec.resolve_path({rec.TRAFFIC_ENV: str(tmp_path / "x.db")}) == str(tmp_path / "x.db")


def test_one_recorder_per_model_key_names_its_file(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(rec.TRAFFIC_ENV, str(tmp_path / "t.db"))
    monkeypatch.setattr(rec, "_RECORDERS", {})
    with caplog.at_level(logging.INFO):
        a, b = rec.recorder(DIMS), rec.recorder(DIMS)
    assert a is b and a.path == str(tmp_path / "t.db") and rec.recorder(OTHER) is not a
    assert any(str(tmp_path / "t.db") in m and "recording MLA traffic" in m for m in caplog.messages)
    for r in rec._RECORDERS.values():
        r.close()


# ---------------------------------------------------------------- the reader

def _traffic(tmp_path, decode: dict, prefill: dict | None = None, dims=DIMS):
    """A traffic file of `decode` ((batch, context, q_len) -> steps)."""
    path = tmp_path / "traffic.db"
    rec.write_counts(str(path), dims, {(b, q, rec.fine_bin(c)): n for (b, c, q), n in decode.items()},
                     {(c, rec.fine_bin(q), rec.fine_bin(k)): n for (c, q, k), n in (prefill or {}).items()})
    return path


def test_covering_takes_the_fewest_cells_most_steps_first(tmp_path):
    t = tr.load_traffic(_traffic(tmp_path, {(32, 4096, 2): 600, (40, 5000, 2): 200, (24, 12000, 2): 100,
                                            (1, 1024, 1): 90, (128, 32768, 1): 10}))
    m = t.select()
    # 40 -> 32 and 24 -> 32 on a log2 scale (24 is 0.415 octaves from 32, 0.585 from 16)
    assert m.decode_cells() == {(32, 4096, 2): 800, (32, 16384, 2): 100, (1, 1024, 1): 90,
                                (128, 32768, 1): 10}
    assert m.covering(0.99) == [(32, 4096, 2), (32, 16384, 2), (1, 1024, 1)]
    assert m.covering(0.8) == [(32, 4096, 2)]
    assert m.covering(1.0)[-1] == (128, 32768, 1)
    with pytest.raises(tr.TrafficError, match="share"):
        m.covering(0)


def test_traffic_weights_snap_like_the_lookup(tmp_path):
    m = tr.load_traffic(_traffic(tmp_path, {(32, 4096, 2): 600, (40, 5000, 2): 200,
                                            (3, 1024, 1): 50})).select()
    mix = m.mix()
    assert mix.snap and sum(mix.weights.values()) == 850
    keys = [(32, 4096, 2), (32, 4096, 1), (4, 1024, 1), (32, 16384, 2)]
    w = bucket_weights(mix, keys)
    assert w == {(32, 4096, 2): 800.0, (32, 4096, 1): 0.0, (4, 1024, 1): 50.0, (32, 16384, 2): 0.0}
    mix.check_covers(set())     # observed keys need not be measured buckets: they snap


def test_prefill_cells_keep_causal_plans_whole(tmp_path):
    m = tr.load_traffic(_traffic(tmp_path, {(1, 100, 1): 1}, {(True, 1000, 1000): 5, (True, 2048, 512): 3,
                                                             (False, 256, 20000): 2})).select()
    assert m.prefill_cells() == {(True, 1024, 1024): 5, (True, 2048, 512): 3, (False, 256, 16384): 2}
    assert m.prefill_covering(0.6) == [(True, 1024, 1024), (True, 2048, 512)]


def test_bad_traffic_files_say_what_they_are(tmp_path):
    with pytest.raises(tr.TrafficError, match="no such file"):
        tr.load_traffic(tmp_path / "missing.db")
    with pytest.raises(tr.TrafficError, match="a folder"):
        tr.load_traffic(tmp_path)
    (tmp_path / "text.db").write_text("hello")
    with pytest.raises(tr.TrafficError, match="not a SQLite file"):
        tr.load_traffic(tmp_path / "text.db")
    import sqlite3
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("create table x (a)").connection.commit()
    with pytest.raises(tr.TrafficError, match="not a traffic file"):
        tr.load_traffic(other)
    empty = tmp_path / "empty.db"
    rec.write_counts(str(empty), DIMS, {}, {})
    with pytest.raises(tr.TrafficError, match="no decode step"):
        tr.load_traffic(empty)
    both = tmp_path / "both.db"
    rec.write_counts(str(both), DIMS, {(1, 1, 0): 1}, {})
    rec.write_counts(str(both), OTHER, {(1, 1, 0): 1}, {})
    with pytest.raises(tr.TrafficError, match="several models"):
        tr.load_traffic(both).select()
    with pytest.raises(tr.TrafficError, match="no recorded traffic for heads per rank 64"):
        tr.load_traffic(both).select(num_heads=64)
    assert tr.load_traffic(both).select(num_heads=128).dims == OTHER


# ---------------------------------------------------------------- the hooks in the plugin

@pytest.fixture
def fresh_recorders(monkeypatch):
    monkeypatch.setattr(rec, "_RECORDERS", {})
    yield
    for r in rec._RECORDERS.values():
        r.close()


@pytest.mark.vllm
def test_the_decode_builder_records_its_lookup_key(tmp_path, monkeypatch, fresh_recorders):
    import plugin_support as ps
    from vllm_metax.core import decisions
    from vllm_metax.core.device import DeviceInfo
    ps.install_recording_plugin(monkeypatch, DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0)))
    vc = ps.make_vllm_config(tmp_path / "model", block_size=16)
    monkeypatch.delenv(rec.TRAFFIC_ENV, raising=False)
    assert ps.make_builder(vc).traffic is None          # off: nothing on the step's path
    monkeypatch.setenv(rec.TRAFFIC_ENV, str(tmp_path / "t.db"))
    builder = ps.make_builder(vc)
    assert builder.traffic is not None and builder.traffic.dims == DIMS
    lens = [300, 1200, 4000]
    ps.build_decode(builder, lens, 16, q_len=2)
    ps.build_decode(builder, [5000], 16, q_len=1)
    # what the step looked its bucket up by: (requests, bucket_context of the lengths, q_len)
    assert builder.traffic.decode_counts == {
        (3, 2, rec.fine_bin(decisions.bucket_context(lens))): 1, (1, 1, rec.fine_bin(5000)): 1}
    builder.traffic.close()
    assert tr.load_traffic(tmp_path / "t.db").select().steps == 2


@pytest.mark.vllm
def test_only_the_first_tensor_parallel_rank_records(tmp_path, monkeypatch, fresh_recorders):
    import vllm.distributed.parallel_state as ps_state
    from vllm_metax.backend import traffic_recorder
    import plugin_support as ps
    vc = ps.make_vllm_config(tmp_path / "model", block_size=16)
    monkeypatch.setenv(rec.TRAFFIC_ENV, str(tmp_path / "t.db"))
    monkeypatch.setattr(ps_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(ps_state, "get_pp_group", lambda: type("G", (), {"rank_in_group": 0})())
    monkeypatch.setattr(ps_state, "get_tensor_model_parallel_rank", lambda: 1)
    assert traffic_recorder(vc, 16) is None
    monkeypatch.setattr(ps_state, "get_tensor_model_parallel_rank", lambda: 0)
    assert traffic_recorder(vc, 16).dims == DIMS


def test_numpy_sizes_are_written_as_integers(tmp_path):
    """A builder handing numpy integers (a lengths array's sum, a shape) still flushes."""
    import numpy as np
    r = rec.TrafficRecorder(str(tmp_path / "t.db"), DIMS, flush_seconds=0)
    r.decode(np.int64(8), np.int64(3000), np.int32(1))
    r.decode(8, 3000, 1)
    r.prefill(np.bool_(True), np.int64(512), np.int64(128))
    assert r.flush()
    m = tr.load_traffic(tmp_path / "t.db").select()
    assert m.steps == 2 and m.plans == 1 and m.decode_cells() == {(8, 4096, 1): 2}
    r.close()


def test_the_warm_up_is_dropped_from_the_file(tmp_path, monkeypatch, fresh_recorders):
    """Counts flushed during the warm-up are taken back by the next flush; later steps stay."""
    monkeypatch.setenv(rec.TRAFFIC_ENV, str(tmp_path / "t.db"))
    r = rec.recorder(DIMS)
    r.decode(512, 1, 1)                   # a capture size's dummy batch
    r.decode(1, 8192, 1)
    assert r.flush()
    r.decode(256, 1, 1)
    rec.discard_warmup()
    r.decode(32, 4096, 1)
    assert r.flush()
    m = tr.load_traffic(tmp_path / "t.db").select()
    assert m.steps == 1 and m.decode_cells() == {(32, 4096, 1): 1}


@pytest.mark.vllm
def test_the_plugins_worker_ends_the_warm_up(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker
    from vllm_metax.worker import MetaxWorker
    calls = []
    monkeypatch.setattr(Worker, "compile_or_warm_up_model", lambda self: calls.append("warm") or 7)
    monkeypatch.setattr(rec, "discard_warmup", lambda: calls.append("discard"))
    assert MetaxWorker.compile_or_warm_up_model(object.__new__(MetaxWorker)) == 7
    assert calls == ["warm", "discard"]
    # a warm-up cut short (on a lent H100 a start killed by its time limit mid-warm-up wrote its
    # 22 dummy steps to the file at exit): its dummy batches are dropped all the same

    def interrupted(self):
        calls.append("warm")
        raise KeyboardInterrupt
    monkeypatch.setattr(Worker, "compile_or_warm_up_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        MetaxWorker.compile_or_warm_up_model(object.__new__(MetaxWorker))
    assert calls == ["warm", "discard"] * 2


@pytest.mark.vllm
def test_a_data_parallel_ranks_dummy_batches_are_not_traffic(tmp_path, monkeypatch, fresh_recorders):
    """An idle data-parallel rank runs vLLM's dummy batch every step; the worker keeps it out of
    the recorded traffic, and counts again after it (also where the batch raised)."""
    from vllm.v1.worker.gpu_worker import Worker
    from vllm_metax.worker import MetaxWorker
    monkeypatch.setenv(rec.TRAFFIC_ENV, str(tmp_path / "t.db"))
    r = rec.recorder(DIMS)

    def dummy(self, fail=[False]):           # what vLLM's dummy run reaches: the builders' recording
        r.decode(1, 1, 1)
        r.prefill(True, 1, 1)
        if fail[0]:
            raise RuntimeError("dummy batch failed")
    monkeypatch.setattr(Worker, "execute_dummy_batch", dummy)
    worker = object.__new__(MetaxWorker)
    worker.execute_dummy_batch()
    r.decode(32, 4096, 1)
    dummy.__defaults__[0][0] = True
    with pytest.raises(RuntimeError):
        worker.execute_dummy_batch()
    r.decode(32, 4096, 1)
    assert sum(r.decode_counts.values()) == 2 and r.prefill_counts == {}
    assert r.flush()
    assert tr.load_traffic(tmp_path / "t.db").select().decode_cells() == {(32, 4096, 1): 2}


# ---------------------------------------------------------------- a server stopped the way vLLM stops it

# The engine core as `vllm serve` runs it: vLLM installs its SIGINT/SIGTERM handler (it only asks
# the busy loop to stop) before the model's builders, and so the recorder, exist; then it serves.
# On stop, vLLM's process manager sends SIGTERM and, under the default --shutdown-timeout 0,
# SIGKILLs at once: no atexit handler runs. The child prints READY once it has counted its steps.
_CHILD = r"""
import signal, sys, time
from vllm_metax.core import traffic as rec
from vllm_metax.core.tuned_config import ModelDims
mode, path, period = sys.argv[1], sys.argv[2], float(sys.argv[3])
stopping = []
if mode == "vllm":
    def engine_handler(signum, frame):
        stopping.append(signum)
        print("ENGINE-HANDLER", signum, flush=True)
    signal.signal(signal.SIGTERM, engine_handler)
    signal.signal(signal.SIGINT, engine_handler)
r = rec.TrafficRecorder(path, ModelDims(16, 512, 64, "bfloat16", "bfloat16"), flush_seconds=period)
for _ in range(7):
    r.decode(32, 4096, 1)
print("READY", flush=True)
while True:
    time.sleep(0.01)
"""


def _serve_child(tmp_path, mode: str, period: float):
    import subprocess
    import sys
    path = tmp_path / "t.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(path), str(period)],
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline().strip() == "READY"
    return child, path


def _steps_within(path, seconds: float) -> int:
    import time
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return tr.load_traffic(str(path)).models[0].steps
            except tr.TrafficError:
                pass
        time.sleep(0.02)
    return 0


def test_a_stop_signal_flushes_before_the_kill(tmp_path):
    """SIGTERM to an engine core whose period is far off: the counts reach the file at once, and
    vLLM's own handler still runs (chained, not replaced). Before the flush-on-signal, a server
    stopped with vLLM's default shutdown lost everything since its last periodic flush."""
    import signal
    child, path = _serve_child(tmp_path, "vllm", period=3600)
    try:
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline().split() == ["ENGINE-HANDLER", str(int(signal.SIGTERM))]
        assert _steps_within(path, 5) == 7
    finally:
        child.kill()
        child.wait()


def test_a_default_sigterm_flushes_then_terminates(tmp_path):
    """No handler of its own (SIGTERM's default): the process flushes, then dies of the signal."""
    import signal
    child, path = _serve_child(tmp_path, "plain", period=3600)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=10) == -signal.SIGTERM
    assert _steps_within(path, 1) == 7


def test_a_killed_server_loses_at_most_one_period(tmp_path):
    """SIGKILL with no signal first (what --shutdown-timeout 0 amounts to where SIGTERM came too
    late): what was counted a period before is in the file."""
    child, path = _serve_child(tmp_path, "vllm", period=0.2)
    try:
        assert _steps_within(path, 5) == 7
    finally:
        child.kill()
        child.wait()


def test_close_gives_the_signal_handlers_back(tmp_path):
    import signal
    before = signal.getsignal(signal.SIGTERM)
    r = rec.TrafficRecorder(str(tmp_path / "t.db"), DIMS, flush_seconds=3600)
    assert signal.getsignal(signal.SIGTERM) is not before
    r.close()
    assert signal.getsignal(signal.SIGTERM) is before
