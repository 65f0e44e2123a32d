"""bench/tuned_vs_auto.py's CPU parts: the buckets it reads from a results DB, the candidate it
takes as "what the plugin serves" (PlanChoice.step on a real tuned config), and its goal verdicts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from bench_support import load_bench

from vllm_metax.core import decisions
from vllm_metax.core import tuned_config as tc

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    return load_bench("tuned_vs_auto")


def test_reads_the_decode_buckets_of_the_shipped_db_read_only(bench, tmp_path):
    db = tmp_path / "results.db"
    shutil.copy(ROOT / "results.db", db)
    before = db.read_bytes()
    ws = bench.stored_workloads(str(db))
    assert len(ws) >= 96 and all(w.q_len == 1 for w in ws)
    assert {w.num_heads for w in ws} >= {16, 128}
    assert db.read_bytes() == before


@pytest.mark.vllm
def test_the_tuned_candidate_is_what_plan_choice_serves(bench):
    pytest.importorskip("vllm")
    from mla_tune.problem.workload import model_preset, workload_for
    from vllm_metax.backend.plan_choice import PlanChoice
    w = workload_for(model_preset("deepseek-v3"), 8, 4, 2048)
    dims = decisions.model_key(w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim, w.q_dtype, w.kv_dtype)
    bucket = tc.Bucket(4, 2048, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa2", "kv_chunk": "x2"})})
    entry = tc.ModelEntry(dims, 32, ["FLASHINFER_MLA"], [bucket])
    hopper = decisions.flashinfer_backends(False, (9, 0))
    assert bench.served_candidate(PlanChoice(entry, hopper), 32, w).key == "flashinfer/fa2/p32/kv_chunk=x2"
    metax = decisions.flashinfer_backends(True, (8, 0))       # fa2 only: the chunk was tuned for fa2
    assert bench.served_candidate(PlanChoice(entry, metax), 32, w).key == "flashinfer/fa2/p32/kv_chunk=x2"
    assert bench.served_candidate(PlanChoice(None, hopper), 64, w).key == "flashinfer/fa3/p64"


@pytest.mark.vllm
def test_the_tuned_candidate_is_the_split_kernel_where_the_plugin_serves_it(bench):
    pytest.importorskip("vllm")
    from mla_tune.problem.workload import model_preset, workload_for
    from vllm_metax.backend.plan_choice import PlanChoice
    w = workload_for(model_preset("deepseek-v3"), 8, 2, 4096)
    dims = decisions.model_key(w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim, w.q_dtype, w.kv_dtype)
    hopper = decisions.flashinfer_backends(False, (9, 0))

    def entry(split_us, splits=32, **pipe):
        fams = {"flashinfer": tc.FamilyChoice({"backend": "fa3", "kv_chunk": "x2"}, time_us=20.0),
                "split": tc.FamilyChoice({"backend": "triton", "num_splits": splits, "partial": "bfloat16",
                                          **pipe}, time_us=split_us)}
        best = "split" if split_us < 20.0 else "flashinfer"
        return tc.ModelEntry(dims, 64, ["FLASHINFER_MLA"], [tc.Bucket(2, 4096, 1, fams, best)])
    assert bench.served_candidate(PlanChoice(entry(17.0), hopper), 64, w).key == \
        "split/triton/p64/num_splits=32,partial=bfloat16"
    # the tuned pipe is what the bench times, as the plugin serves it
    assert bench.served_candidate(PlanChoice(entry(17.0, pipe="t32x4"), hopper), 64, w).key == \
        "split/triton/p64/num_splits=32,partial=bfloat16,pipe=t32x4"
    # 1.03x is not served, and neither is a launch the served workspace cannot hold
    assert bench.served_candidate(PlanChoice(entry(19.4), hopper), 64, w).key == "flashinfer/fa3/p64/kv_chunk=x2"
    w600 = workload_for(model_preset("deepseek-v3"), 8, 600, 4096)
    assert bench.served_candidate(PlanChoice(entry(17.0, splits=4), hopper), 64, w600).family == "flashinfer"



@pytest.mark.vllm
def test_the_tuned_candidate_is_flashmla_where_the_plugin_serves_it_at_page_64(bench, monkeypatch):
    pytest.importorskip("vllm")
    from mla_tune.problem.workload import model_preset, workload_for
    from vllm_metax.backend.plan_choice import PlanChoice
    from vllm_metax.core import profile
    monkeypatch.setenv(profile.PROFILE_ENV, "nvidia")
    w = workload_for(model_preset("deepseek-v3"), 8, 2, 4096)
    dims = decisions.model_key(w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim, w.q_dtype, w.kv_dtype)
    hopper = decisions.flashinfer_backends(False, (9, 0))
    fams = {"flashinfer": tc.FamilyChoice({"backend": "fa3"}, time_us=20.0),
            "flashmla": tc.FamilyChoice({"backend": "flashmla"}, time_us=10.0),
            "fa3_mla": tc.FamilyChoice({"backend": "fa3", "num_splits": 0}, time_us=15.0)}
    for page, key in ((64, "flashmla/flashmla/p64"), (16, "fa3_mla/fa3/p16/num_splits=0")):
        entry = tc.ModelEntry(dims, page, ["FLASHINFER_MLA"], [tc.Bucket(2, 4096, 1, fams, "flashmla")])
        assert bench.served_candidate(PlanChoice(entry, hopper), page, w).key == key


def _row(heads, batch, ctx, tuned, auto, vllm, lengths="uniform"):
    kv = batch * ctx
    return {"workload": f"H{heads} B{batch} L{ctx}", "heads": heads, "batch": batch, "context": ctx,
            "lengths": lengths, "kv_tokens": kv, "bytes": kv * 576 * 2, "tuned": "x",
            "tuned_us": tuned, "auto_us": auto, "vllm_us": vllm}


def test_goal_verdicts_follow_the_numbers(bench):
    copy = 4000.0                                    # GB/s
    big_us = 256 * 1024 * 576 * 2 / (copy * 1e9) * 1e6   # the copy floor of 256K tokens
    doc = {"ceilings": {"copy_gbps": copy}, "skipped": [], "rows": [
        _row(16, 1, 1024, 10.0, 12.0, 30.0), _row(16, 8, 1024, 11.0, 13.0, 40.0, "zipf"),
        _row(16, 64, 4096, big_us / 0.95, big_us / 0.8, big_us * 3)]}
    s = bench.summarize(doc)
    assert s["over_auto"]["all"] == pytest.approx((1.2 * (13 / 11) * (0.95 / 0.8)) ** (1 / 3))
    assert s["counts"]["ragged"] == 1 and s["over_auto"]["ragged"] == pytest.approx(13 / 11)
    assert s["small"]["buckets"] == 2 and s["small"]["at_goal"] == 2
    assert s["h16_big"]["copy_pct_min"] == pytest.approx(95.0)
    assert all(s["goals"].values())
    doc["rows"][1]["tuned_us"] = 12.5                # one small bucket over 12 us
    doc["rows"][2]["tuned_us"] = big_us / 0.85        # 85% of copy bandwidth
    s = bench.summarize(doc)
    goals = list(s["goals"].values())
    assert goals[1] is False and goals[2] is False
    assert "NOT met" in bench.render({"environment": {"device_name": "X", "torch": "t", "flashinfer": "f"},
                                      "config": "c", **doc}, s)
