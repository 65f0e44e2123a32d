"""bench/metax_vs_vendor.py's CPU parts: what it takes as the tuned candidate under the metax
profile (the config's first runnable backend decides, as the platform's backend order does), and
the vendor default it compares against (FlashMLA where it ran, else the vendor's Triton)."""

from __future__ import annotations

import pytest
from bench_support import load_bench

from vllm_metax.core import decisions
from vllm_metax.core import tuned_config as tc


@pytest.fixture(scope="module")
def bench():
    return load_bench("metax_vs_vendor")


def _workload(batch=2, context=4096):
    from mla_tune.problem.workload import model_preset, workload_for
    return workload_for(model_preset("deepseek-v3"), 8, batch, context)


def _entry(w, order, fams, page=64):
    dims = decisions.model_key(w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim, w.q_dtype, w.kv_dtype)
    return tc.ModelEntry(dims, page, order, [tc.Bucket(w.batch_size, w.context_len, 1, fams)])


class _Triton:
    def default_candidate(self, w, page):
        from mla_tune.families.base import Candidate
        return Candidate("triton", "triton", page, {"num_kv_splits": 4, "rule": "vllm", "variant": "metax"})


@pytest.mark.vllm
def test_the_tuned_candidate_follows_the_configs_backend_order(bench, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_METAX_PROFILE", "metax")
    w = _workload()
    fams = {"flashinfer": tc.FamilyChoice({"backend": "fa2", "kv_chunk": "x2"}, time_us=30.0),
            "triton": tc.FamilyChoice({"backend": "triton", "num_kv_splits": 8, "variant": "metax"}, time_us=40.0)}
    metax = decisions.flashinfer_backends(True, (8, 0))
    families = {"triton": _Triton(), "flashmla_ok": True}
    fi = _entry(w, ["FLASHINFER_MLA", "TRITON_MLA"], fams)
    assert bench.tuned_candidate(fi, families, metax, w).key == "flashinfer/fa2/p64/kv_chunk=x2"
    tr = _entry(w, ["TRITON_MLA"], fams)
    assert bench.tuned_candidate(tr, families, metax, w).key == "triton/triton/p64/num_kv_splits=8,variant=metax"
    fm = _entry(w, ["FLASHMLA", "FLASHINFER_MLA"], fams)
    assert bench.tuned_candidate(fm, families, metax, w).key == "flashmla/flashmla/p64"
    # where FlashMLA cannot load, the next backend of the order serves
    no_fm = {"triton": _Triton(), "flashmla_ok": False}
    assert bench.tuned_candidate(fm, no_fm, metax, w).key == "flashinfer/fa2/p64/kv_chunk=x2"
    # no entry: the metax profile's default order, FLASHMLA first, else the vendor's Triton at block 16
    assert bench.tuned_candidate(None, families, metax, w).key == "flashmla/flashmla/p64"
    assert bench.tuned_candidate(None, no_fm, metax, w).key == "triton/triton/p16/num_kv_splits=4,rule=vllm,variant=metax"


def test_the_vendor_default_is_flashmla_else_its_triton(bench):
    rows = [{"workload": "a", "heads": 16, "lengths": "uniform", "tuned": "split/triton/p64", "tuned_us": 10.0, "vendor_us": 12.0,
             "vendor_triton_us": 30.0, "fa2_auto_us": 11.0},
            {"workload": "b", "heads": 16, "lengths": "zipf", "tuned": "flashmla/flashmla/p64", "tuned_us": 20.0, "vendor_us": None,
             "vendor_triton_us": 18.0, "fa2_auto_us": 22.0}]
    s = bench.summarize({"rows": rows, "skipped": []})
    assert s["buckets"] == 2
    assert s["over_vendor_default"]["uniform"] == pytest.approx(1.2)
    assert s["over_vendor_default"]["ragged"] == pytest.approx(0.9)
    assert s["over_vendor_default"]["all"] == pytest.approx((1.2 * 0.9) ** 0.5)
    assert s["slower_than_vendor"] == ["b"] and s["faster_than_vendor"] == ["a"]
    assert s["over_vendor"]["all"] == pytest.approx(1.2)        # FlashMLA only where it ran
    text = bench.render({"rows": rows, "skipped": [], "profile": "metax", "config": "c.json",
                         "environment": {"device_name": "NVIDIA H100", "torch": "2", "flashinfer": "0.2.6.post1"}}, s)
    assert "| all | 2 | 1.039x |" in text and "NVIDIA silicon stands in" in text


@pytest.mark.vllm
def test_a_triton_step_outside_its_buckets_context_window_is_vllms_rule(bench, monkeypatch):
    """TRITON_MLA serves a bucket tuned at context c for [c/2, 2c] only (`decisions.triton_choice`):
    beyond, the server keeps vLLM's split rule for the batch at the entry's page, and so does the
    tuned candidate."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_METAX_PROFILE", "metax")
    fams = {"triton": tc.FamilyChoice({"backend": "triton", "num_kv_splits": 8, "variant": "metax"}, time_us=40.0)}
    tr = _entry(_workload(context=4096), ["TRITON_MLA"], fams)
    metax = decisions.flashinfer_backends(True, (8, 0))
    families = {"triton": _Triton(), "flashmla_ok": True}
    near, far = _workload(context=8192), _workload(context=16384)
    assert bench.tuned_candidate(tr, families, metax, near).key == "triton/triton/p64/num_kv_splits=8,variant=metax"
    assert bench.tuned_candidate(tr, families, metax, far).key == "triton/triton/p64/num_kv_splits=4,rule=vllm,variant=metax"
