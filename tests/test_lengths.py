"""Ragged buckets (`--lengths`): distributions, recorded traces, their identity in results.db, the
sweep on the CPU, and emit merging them with uniform buckets by the plugin's lookup statistic."""

import hashlib
import shutil
import statistics
from pathlib import Path

import pytest

from cli_support import run_main
from mla_tune.families.base import Candidate
from mla_tune.problem.roofline import workload_bytes, workload_flops
from mla_tune.problem.workload import (LengthTrace, ProblemError, Workload, load_trace, model_preset,
                                       workload_for)
from mla_tune.store.records import StoredWorkload
from mla_tune.store.results import ResultsStore


def stored_workload(row):
    return StoredWorkload.from_row(row).problem
from mla_tune.tune.sweep.buckets import resolve_lengths
from mla_tune.tune.sweep.request import SweepRequest
from vllm_metax.core.decisions import bucket_context

V3 = model_preset("deepseek-v3")
DATA = Path(__file__).resolve().parent / "data"


def test_zipf_buckets_have_the_bucket_context_as_mean_and_a_long_tail():
    for b in (1, 3, 32, 128):
        for c in (16, 1024, 16384):
            w = workload_for(V3, 8, b, c, ragged="zipf")
            assert bucket_context(w.seq_lens) == c == sum(w.seq_lens) / b
            assert min(w.seq_lens) >= 1 and max(w.seq_lens) <= 8 * c
    lens = sorted(workload_for(V3, 8, 128, 4096, ragged="zipf").seq_lens)
    assert statistics.median(lens) < 0.5 * 4096 and lens[-1] > 4 * 4096     # most short, a few long
    assert workload_for(V3, 8, 32, 4096, ragged="zipf").seq_lens == \
        workload_for(V3, 8, 32, 4096, ragged="zipf").seq_lens                # reproducible


def test_a_trace_is_read_by_column_and_resampled_to_each_bucket(tmp_path):
    f = tmp_path / "trace.csv"
    f.write_text("request_id,output_len,prompt_len\n1,5,100\n2,7,300\n# note\n3,9,2000\n")
    t = load_trace(f)
    assert t.lengths == (100, 300, 2000) and t.kind.startswith("trace:") and len(t.kind) == 22
    (tmp_path / "one.csv").write_text("100\n300\n2000\n")           # one column, no header
    assert load_trace(tmp_path / "one.csv").kind == t.kind           # same lengths, same trace
    (tmp_path / "ctx.csv").write_text("prompt_len,context_len\n1,100\n1,300\n1,2000\n")
    assert load_trace(tmp_path / "ctx.csv").lengths == (100, 300, 2000)  # context_len first
    other = LengthTrace.of([100, 300, 2001])
    assert other.kind != t.kind                                      # two traces never collide
    w = workload_for(V3, 8, 16, 4096, trace=t)
    assert w.ragged == t.kind and len(w.seq_lens) == 16 and bucket_context(w.seq_lens) == 4096
    assert set(w.seq_lens) <= {round(x * 4096 * 16 / sum(w.seq_lens)) for x in (100, 300, 2000)} | set(
        range(1, 8 * 4096 + 1))
    assert w.key == workload_for(V3, 8, 16, 4096, trace=t).key and "lengths" not in w.key
    with pytest.raises(ProblemError, match="needs its per-request lengths"):
        Workload(16, 512, 64, 0.1, 4, 1024, ragged=t.kind)


@pytest.mark.parametrize("text, message", [
    ("", "no request lengths"),
    ("prompt_len\n", "a header and no rows"),
    ("id,foo\n1,2\n", "no request-length column"),
    ("length\n100\n-5\n", ":3: request length '-5'"),
    ("length\n100\n1.5\n", "request length '1.5'"),
    ("100,200\n300,400\n", "2 columns and no header"),
])
def test_bad_trace_files_say_what_is_wrong(tmp_path, text, message):
    f = tmp_path / "t.csv"
    f.write_text(text)
    with pytest.raises(ProblemError, match=message):
        load_trace(f)
    with pytest.raises(ProblemError, match="cannot read request lengths"):
        load_trace(tmp_path / "missing.csv")
    with pytest.raises(ProblemError, match="unknown length distribution 'zipff'"):
        resolve_lengths("zipff")


def test_a_trace_workload_is_stored_with_its_lengths_and_rebuilt_from_the_db(tmp_path):
    t = LengthTrace.of([10, 50, 400, 3000], "t.csv")
    w = workload_for(V3, 8, 8, 1024, trace=t)
    z = workload_for(V3, 8, 8, 1024, ragged="zipf")
    u = workload_for(V3, 8, 8, 1024)
    with ResultsStore(tmp_path / "r.db") as s:
        run = s.add_run({"kind": "gpu", "device_name": "X"})
        ids = [s.workload_id(x, workload_bytes(x), workload_flops(x)) for x in (w, z, u)]
        assert len(set(ids)) == 3                       # distributions are told apart
        for wid in ids:
            s.add_trial(run, wid, Candidate.parse("flashinfer/fa3/p64"), "ok", {"kernel_us": [1.0]})
        rows = {r["workload_id"]: r for r in s.trials()}
        assert s.db["workloads"].get(ids[2])["seq_lens"] is None
    back = stored_workload(rows[ids[0]])
    assert back == w and back.seq_lens == w.seq_lens and back.ragged == t.kind
    assert stored_workload(rows[ids[1]]).seq_lens == z.seq_lens


def test_the_shipped_older_db_still_reads_byte_for_byte(tmp_path):
    db = tmp_path / "old.db"
    shutil.copy(DATA / "results_schema2_h200.db", db)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    with ResultsStore(db, create=False) as s:
        rows = s.trials("t.id < 50")
    assert all(stored_workload(r) is not None and r["seq_lens"] is None for r in rows)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.db"]


def test_the_default_gpu_sweep_holds_zipf_buckets_and_lengths_narrow_it():
    cfg = SweepRequest(device="cuda", db=Path("unused.db")).config()
    kinds = [b.workload.ragged for b in cfg.buckets]
    assert kinds.count("uniform") == 96 and kinds.count("zipf") == 8
    only = SweepRequest(device="cuda", db=Path("unused.db"), lengths="lognormal", batches="8",
                        contexts="1024").config()
    assert [b.workload.ragged for b in only.buckets] == ["lognormal", "lognormal"]
    assert [b.workload.ragged for b in SweepRequest(device="cpu").config().buckets] == ["uniform"] * 4


def test_cli_sweeps_a_trace_and_refuses_bad_files_without_writing(tmp_path):
    trace = tmp_path / "requests.csv"
    trace.write_text("prompt_len\n" + "\n".join(str(x) for x in (40, 90, 200, 900, 60)) + "\n")
    db = tmp_path / "r.db"
    res = run_main(["sweep", "--db", db, "--lengths", trace, "--batches", "4", "--contexts", "256",
                    "--page-size", "16", "--samples", "2", "-q"])
    assert res.code == 0, res.output
    kind = load_trace(trace).kind
    with ResultsStore(db, create=False) as s:
        (w,) = s.db["workloads"].rows
    assert w["ragged"] == kind and len(__import__("json").loads(w["seq_lens"])) == 4
    res = run_main(["sweep", "--db", db, "--ragged", "zipf", "--batches", "4", "--contexts", "256",
                    "--page-size", "16", "--samples", "2", "-q"])          # the old flag name
    assert res.code == 0, res.output
    for bad, message in ((tmp_path / "none.csv", "No such file"), (tmp_path, "request-length CSV"),
                         ("zipff", "unknown length distribution")):
        new = tmp_path / "new.db"
        res = run_main(["sweep", "--db", new, "--lengths", bad, "-q"])
        assert res.code == 2 and message in res.stderr and "Traceback" not in res.output
        assert len([x for x in res.stderr.strip().splitlines() if x.strip()]) == 1
        assert not new.exists()


def test_emit_merges_ragged_buckets_by_mean_length_and_the_ragged_one_wins(tmp_path):
    from mla_tune.tune.emit import emit_config
    from vllm_metax.core import tuned_config as tc
    pattern = [1.00, 1.01, 0.99, 1.02, 0.98, 1.00, 1.03, 0.995, 1.005, 1.01, 0.99, 1.0]

    def put(s, run, w, key, us, default=False):
        wid = s.workload_id(w, workload_bytes(w), workload_flops(w))
        s.add_trial(run, wid, Candidate.parse(key), "ok", {"kernel_us": [us * p for p in pattern]},
                    is_default=default)

    with ResultsStore(tmp_path / "r.db") as s:
        run = s.add_run({"kind": "gpu", "device_name": "NVIDIA H200", "sm_count": 132})
        for b in (1, 8):
            for c in (1024, 4096):
                u = workload_for(V3, 8, b, c)
                put(s, run, u, "flashinfer/fa3/p64", 10.0, default=True)
                put(s, run, u, "flashinfer/fa2/p64", 20.0)
        for c in (4096, 2048):          # one shared key (B8 L4096), one new one (B8 L2048)
            z = workload_for(V3, 8, 8, c, ragged="zipf")
            put(s, run, z, "flashinfer/fa3/p64", 30.0, default=True)
            put(s, run, z, "flashinfer/fa2/p64", 15.0)          # fa2 wins where lengths are ragged
        cfg = tc.read_tuned_config(emit_config(s, tmp_path / "configs", device="NVIDIA H200"))
    (e,) = cfg.models
    keys = {(b.batch_size, b.context_len): b.families["flashinfer"].params["backend"] for b in e.buckets}
    assert keys == {(1, 1024): "fa3", (1, 4096): "fa3", (8, 1024): "fa3", (8, 4096): "fa2",
                    (8, 2048): "fa2"}
    assert any("2 ragged buckets merged" in n and "1 replace" in n for n in cfg.provenance["notes"])
