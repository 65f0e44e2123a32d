"""A recorded traffic in the tuner: `sweep --traffic` buckets and weights, `emit --traffic`
choosing the page size by the recorded steps (mla_tune.tune.traffic_plan, choose.bucket_weights)."""

from __future__ import annotations

import json

import pytest

import traffic_support
from cli_support import run_main
from mla_tune.families.base import Candidate
from mla_tune.problem.roofline import workload_bytes, workload_flops
from mla_tune.problem.workload import model_preset, workload_for
from mla_tune.store.results import ResultsStore
from mla_tune.store.traffic import TrafficError
from mla_tune.tune import traffic_plan
from vllm_metax.core import traffic as rec
from vllm_metax.core.tuned_config import ModelDims

H16 = ModelDims(16, 512, 64, "bfloat16", "bfloat16")       # DeepSeek-V3 at TP8
H128 = ModelDims(128, 512, 64, "bfloat16", "bfloat16")     # ... at TP1
DEVICE = "NVIDIA H200"


def write_traffic(path, decode: dict, prefill: dict | None = None, dims=H16):
    """A traffic file as the plugin writes it: decode (batch, context, q_len) -> steps, prefill
    (causal, query tokens, KV per request) -> plans."""
    return traffic_support.write_traffic(path, dims, decode, prefill)


# per (batch, context): the time of FlashInfer fa3 at page 64 and at page 16 (each page's default)
TIMES = {(1, 1024): (10.0, 20.0), (32, 4096): (100.0, 80.0)}


def page_db(path, times=TIMES, triton=None):
    """A results DB where page 16 wins uniformly (110 vs 100 us) and page 64 wins where batch 1
    dominates; `triton`: (batch, context) -> TRITON_MLA's time at page 64."""
    model = model_preset("deepseek-v3")
    pattern = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 1.03, 0.995, 1.005, 1.01, 0.99, 1.0]
    with ResultsStore(path) as store:
        run = store.add_run({"kind": "gpu", "device_name": DEVICE, "sm_count": 132})
        for (b, c), (t64, t16) in times.items():
            wl = workload_for(model, 8, b, c)
            wid = store.workload_id(wl, workload_bytes(wl), workload_flops(wl))
            cands = [("flashinfer/fa3/p64", t64), ("flashinfer/fa3/p16", t16)]
            if triton is not None:
                cands.append(("triton/triton/p64/num_kv_splits=4,rule=vllm", triton[(b, c)]))
            for key, t in cands:
                store.add_trial(run, wid, Candidate.parse(key), "ok",
                                {"kernel_us": [t * p for p in pattern]}, sweep="t", is_default=True)
    return path


# ---------------------------------------------------------------- the plan

def test_decode_plan_covers_the_share_at_the_recorded_tp(tmp_path):
    path = write_traffic(tmp_path / "t.db", {(32, 4096, 2): 700, (40, 5000, 2): 200, (24, 12000, 2): 60,
                                             (1, 1024, 1): 30, (256, 32768, 1): 10})
    plan = traffic_plan.decode_plan(path, 0.99)
    assert plan.tp_size == 8 and plan.total == 1000
    assert plan.cells == [(32, 4096, 2), (32, 16384, 2), (1, 1024, 1)] and plan.covered == 990
    assert "3 log2 buckets hold 99.0% of its 1000 decode steps" in plan.note
    assert traffic_plan.decode_plan(path, 0.5).cells == [(32, 4096, 2)]
    w = plan.mix.weights
    assert w[(32, rec.bin_center(rec.fine_bin(4096)), 2)] == 700.0 and sum(w.values()) == 1000
    with pytest.raises(TrafficError, match="no recorded traffic fits deepseek-v3 at --tp 1"):
        traffic_plan.decode_plan(path, 0.99, tp_sizes=[1])


def test_a_bucket_context_holds_its_q_len(tmp_path):
    path = write_traffic(tmp_path / "t.db", {(4, 5, 6): 10})
    assert traffic_plan.decode_plan(path, 1.0).cells == [(4, 8, 6)]


def test_traffic_of_two_tp_sizes_needs_tp(tmp_path):
    path = tmp_path / "t.db"
    write_traffic(path, {(8, 2048, 1): 5})
    write_traffic(path, {(8, 2048, 1): 5}, dims=H128)
    with pytest.raises(TrafficError, match="--tp"):
        traffic_plan.decode_plan(path)
    assert traffic_plan.decode_plan(path, tp_sizes=[1]).tp_size == 1


def test_prefill_plan_makes_the_recorded_plans(tmp_path):
    path = write_traffic(tmp_path / "t.db", {(1, 100, 1): 1},
                         {(True, 2048, 512): 8, (False, 256, 16384): 2, (True, 100000, 100000): 0})
    plan = traffic_plan.prefill_plan(path, 1.0)
    assert plan.cells == [(True, 2048, 512), (False, 256, 16384)] and plan.what == "prefill plans"
    ws = traffic_plan.prefill_workloads(plan, "deepseek-v3")
    assert [(w.causal, w.query_tokens, w.kv_len, w.requests, w.num_heads) for w in ws] == [
        (True, 2048, 512, 4, 16), (False, 256, 16384, 1, 16)]


def test_a_sweep_request_takes_the_traffic_cells(tmp_path):
    from mla_tune.tune.sweep.request import SweepRequest
    path = write_traffic(tmp_path / "t.db", {(32, 4096, 2): 700, (1, 1024, 1): 300})
    cfg = SweepRequest(traffic=path, traffic_share=1.0, device="cuda", db=tmp_path / "r.db").config()
    assert [(b.tp_size, b.workload.batch_size, b.workload.context_len, b.workload.q_len)
            for b in cfg.buckets] == [(8, 32, 4096, 2), (8, 1, 1024, 1)]      # no default zipf extras
    assert cfg.mix is not None           # the page size and order are weighed by the steps


# ---------------------------------------------------------------- the CLI

def test_sweep_dry_run_plans_the_traffic_buckets(tmp_path):
    path = write_traffic(tmp_path / "t.db", {(32, 4096, 2): 700, (1, 1024, 1): 300, (64, 65536, 1): 1})
    r = run_main(["sweep", "--traffic", path, "--traffic-share", "0.99", "--dry-run",
                  "--db", tmp_path / "r.db"], cwd=tmp_path)
    assert r.code == 0, r.output
    text = " ".join(r.output.split())
    assert "2 log2 buckets hold 99.9% of its 1001 decode steps" in text
    assert "B32" in r.output and "L64K" not in r.output and not (tmp_path / "r.db").exists()


@pytest.mark.parametrize("args, message", [
    (["--batches", "1,2"], "--traffic decides the buckets and weights; drop --batches"),
    (["--mix", "m.csv"], "drop --mix"),
    (["--tp", "1"], "no recorded traffic fits deepseek-v3 at --tp 1"),
    (["--traffic-share", "0"], "--traffic-share"),
])
def test_sweep_traffic_refusals_are_one_line(tmp_path, args, message):
    path = write_traffic(tmp_path / "t.db", {(32, 4096, 2): 7})
    (tmp_path / "m.csv").write_text("1,1024,1\n")
    r = run_main(["sweep", "--traffic", path, "--dry-run", *args], cwd=tmp_path)
    assert r.code == 2 and message in r.output and r.exception is None, r.output


def test_traffic_share_needs_traffic(tmp_path):
    r = run_main(["sweep", "--traffic-share", "0.9", "--dry-run"], cwd=tmp_path)
    assert r.code == 2 and "--traffic-share applies only with --traffic" in r.output


def test_emit_weighs_the_page_size_by_the_recorded_steps(tmp_path):
    db = page_db(tmp_path / "r.db")
    r = run_main(["emit", "--db", db, "--configs-dir", tmp_path / "uniform"], cwd=tmp_path)
    assert r.code == 0, r.output
    cfg = json.loads(next((tmp_path / "uniform").glob("*.json")).read_text())
    assert cfg["models"][0]["global"]["page_size"] == 16          # 100 us vs 110 us, uniform
    # the server decodes batch 1 nine times in ten: page 64 is 19 us a step against 26
    traffic = write_traffic(tmp_path / "t.db", {(1, 1000, 1): 900, (30, 4500, 1): 100})
    r = run_main(["emit", "--db", db, "--traffic", traffic, "--configs-dir", tmp_path / "traffic"],
                 cwd=tmp_path)
    assert r.code == 0, r.output
    cfg = json.loads(next((tmp_path / "traffic").glob("*.json")).read_text())
    assert cfg["models"][0]["global"]["page_size"] == 64
    assert cfg["provenance"]["mix"]["traffic"].startswith(f"traffic {traffic}")


def test_traffic_weights_only_the_entry_it_recorded(tmp_path):
    """A TP1 (128 heads) traffic leaves a TP8 entry's weights uniform."""
    from mla_tune.store.traffic import load_traffic
    from mla_tune.tune.choose import choose
    db = page_db(tmp_path / "r.db")
    traffic = write_traffic(tmp_path / "t.db", {(1, 1000, 1): 900}, dims=H128)
    with ResultsStore(db, create=False) as store:
        m = choose(store.records(), load_traffic(traffic).select().mix()).models[0]
    assert m.page_size == 16 and {b.weight for b in m.buckets} == {1.0}


def test_emit_refuses_mix_and_traffic_together(tmp_path):
    db = page_db(tmp_path / "r.db")
    (tmp_path / "m.csv").write_text("1,1024,1\n")
    traffic = write_traffic(tmp_path / "t.db", {(1, 1000, 1): 900})
    r = run_main(["emit", "--db", db, "--traffic", traffic, "--mix", tmp_path / "m.csv",
                  "--configs-dir", tmp_path / "c"], cwd=tmp_path)
    assert r.code == 2 and "exclude each other" in r.output


def test_prefill_sweep_plans_the_recorded_plans(tmp_path):
    path = write_traffic(tmp_path / "t.db", {(1, 100, 1): 1}, {(True, 2048, 512): 8, (False, 256, 16384): 2})
    r = run_main(["prefill-sweep", "--traffic", path, "--db", tmp_path / "r.db"], cwd=tmp_path)
    text = " ".join(r.output.split())
    assert "2 log2 buckets hold 100.0% of its 10 prefill plans" in text
    assert r.code == 2 and "no CUDA device" in text and not (tmp_path / "r.db").exists()   # CPU here
    r = run_main(["prefill-sweep", "--traffic", path, "--chunk-kv", "1K"], cwd=tmp_path)
    assert r.code == 2 and "--traffic decides the prefill buckets; drop --chunk-kv" in r.output
    r = run_main(["prefill-sweep", "--traffic-share", "0.5"], cwd=tmp_path)
    assert r.code == 2 and "applies only with --traffic" in r.output


def test_replay_chooses_the_page_by_the_recorded_steps(tmp_path):
    db = page_db(tmp_path / "r.db")
    traffic = write_traffic(tmp_path / "t.db", {(1, 1000, 1): 900, (30, 4500, 1): 100})
    uniform = " ".join(run_main(["sweep", "--replay", db], cwd=tmp_path).output.split())
    assert "on NVIDIA H200, page 16" in uniform
    r = run_main(["sweep", "--replay", db, "--traffic", traffic], cwd=tmp_path)
    text = " ".join(r.output.split())
    assert r.code == 0 and "on NVIDIA H200, page 64" in text
    assert "flashinfer 19000 us (2/2)" in text             # 900 x 10 us + 100 x 100 us
