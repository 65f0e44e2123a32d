"""vllm_metax.core.decisions: the one place the tuner and the plugin take their shared decisions from."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from vllm_metax.core import choices as ch
from vllm_metax.core import decisions as d
from vllm_metax.core import tuned_config as tc


# ---------------------------------------------------------------- FlashInfer backend values

@pytest.mark.parametrize("is_metax, cap, allowed, default", [
    (False, (9, 0), ("fa3", "fa2"), "fa3"),       # Hopper
    (True, (8, 0), ("fa2",), "fa2"),              # MetaX: fa2 only, whatever it reports
    (True, (9, 0), ("fa2",), "fa2"),              # a MetaX SM number means nothing: no fa3
    (False, (8, 0), ("fa2",), "fa2"),             # Ampere
    (False, (10, 0), ("fa2",), "fa2"),            # Blackwell: the plugin has run fa2 only
    (False, None, ("fa2",), "fa2"),               # unknown
])
def test_flashinfer_backends_per_device(is_metax, cap, allowed, default):
    fb = d.flashinfer_backends(is_metax, cap)
    assert (fb.allowed, fb.default, fb.fallback) == (allowed, default, "fa2")
    assert d.AUTO not in fb.allowed and fb.default in fb.allowed


def test_serve_plans_allowed_values_and_the_default_otherwise():
    hopper = d.flashinfer_backends(False, (9, 0))
    assert hopper.serve(ch.FlashInferChoice("fa2")) == "fa2"
    assert hopper.serve(ch.FlashInferChoice("fa3")) == "fa3"
    assert hopper.serve(ch.FlashInferChoice("auto")) == "fa3"      # old configs' baseline
    assert hopper.serve(ch.FlashInferChoice("xqa")) == "fa3"
    assert hopper.serve(None) == "fa3"
    metax = d.flashinfer_backends(True, (8, 0))
    assert metax.serve(ch.FlashInferChoice("fa3")) == "fa2"
    assert metax.serve(ch.FlashInferChoice("auto")) == "fa2"        # never auto on MetaX


# ---------------------------------------------------------------- model key and dtypes

def test_model_key_normalises_dtype_spellings():
    want = tc.ModelDims(16, 512, 64, "bfloat16", "bfloat16")
    assert d.model_key(16, 512, 64, torch.bfloat16, "auto") == want
    assert d.model_key(16, 512, 64, "bfloat16", torch.bfloat16) == want
    assert d.model_key(16, 512, 64, "bfloat16") == want
    assert d.model_key(16, 512, 64, torch.float16, "fp8") == tc.ModelDims(16, 512, 64, "float16", "fp8")
    assert d.dtype_name("auto", torch.float16) == "float16"


# ---------------------------------------------------------------- the lookup statistic

def test_bucket_context_is_the_mean_length_of_any_sequence_type():
    lens = [512, 512, 512, 6656]
    for seq in (lens, tuple(lens), np.array(lens, dtype=np.int32), torch.tensor(lens, dtype=torch.int32)):
        assert d.bucket_context(seq) == 2048
    assert d.bucket_context([4096] * 7) == 4096            # a uniform bucket: its context
    assert d.bucket_context([1, 2]) == 1 and d.bucket_context([]) == 1
    big = np.full(256, 1 << 24, dtype=np.int32)             # the sum passes int32
    assert d.bucket_context(big) == 1 << 24


# ---------------------------------------------------------------- family choices

def test_family_choices_round_trip_and_keep_vllms_rule():
    fi = ch.family_choice("flashinfer", {"backend": "fa3"})
    assert fi == ch.FlashInferChoice("fa3") and ch.family_choice("flashinfer", fi.to_params()) == fi
    tuned = ch.family_choice("triton", {"backend": "triton", "num_kv_splits": 16})
    assert tuned == ch.TritonChoice(16) and tuned.served_splits == 16
    rule = ch.family_choice("triton", {"backend": "triton", "num_kv_splits": 64, "rule": "vllm"})
    assert rule == ch.TritonChoice(64, True) and rule.served_splits is None
    assert rule.to_params() == {"backend": "triton", "num_kv_splits": 64, "rule": "vllm"}
    assert ch.family_choice("triton", {"num_kv_splits": 8}) == ch.TritonChoice(8)   # hand-written


@pytest.mark.parametrize("family, params", [
    ("flashinfer", {}), ("flashinfer", {"backend": 3}), ("flashinfer", None),
    ("triton", {"num_kv_splits": 0}), ("triton", {"num_kv_splits": True}),
    ("triton", {"num_kv_splits": "8"}), ("reference", {"backend": "torch"}),
])
def test_unusable_params_are_no_choice(family, params):
    assert ch.family_choice(family, params) is None


def test_bucket_choice_reads_a_tuned_config_bucket():
    b = tc.Bucket(1, 1024, 1, {"triton": tc.FamilyChoice({"num_kv_splits": 4, "rule": "vllm"})})
    assert d.bucket_choice(b, "triton") == ch.TritonChoice(4, True)
    assert d.bucket_choice(b, "flashinfer") is None and d.bucket_choice(None, "triton") is None


# ---------------------------------------------------------------- the shipped config

def test_the_shipped_h200_config_reads_into_typed_choices():
    """Whatever sweep produced the shipped config: every bucket reads into a typed choice of each
    family, the FlashInfer ones are values Hopper serves as written, and the Triton buckets that
    kept vLLM's rule are exactly those the file marks so."""
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "configs" / "device_name=NVIDIA_H200.json"
    cfg = tc.read_tuned_config(path)
    raw = json.loads(path.read_text())
    fi = [d.bucket_choice(b, "flashinfer") for m in cfg.models for b in m.buckets]
    tr = [d.bucket_choice(b, "triton") for m in cfg.models for b in m.buckets]
    n = sum(len(m["buckets"]) for m in raw["models"])
    assert n >= 96 and len(fi) == len(tr) == n and None not in fi and None not in tr
    hopper = d.flashinfer_backends(False, (9, 0))
    assert {c.backend for c in fi} <= set(hopper.allowed)
    assert all(hopper.serve(c) == c.backend for c in fi)
    written = [b["families"]["flashinfer"]["params"].get("kv_chunk") for m in raw["models"]
               for b in m["buckets"]]
    assert [c.kv_chunk for c in fi] == written
    rule = sum(b["families"]["triton"]["params"].get("rule") == "vllm" for m in raw["models"]
               for b in m["buckets"])
    assert sum(c.vllm_rule for c in tr) == rule


def test_import_is_cheap():
    code = ("import sys, vllm_metax.core.decisions; "
            "print(sorted(m for m in ('torch', 'optuna', 'typer', 'rich', 'sqlite3', 'vllm', "
            "'numpy', 'mla_tune') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_flashinfer_kv_chunk_round_trips_and_unknown_values_mean_mlaplans_limit():
    c = ch.FlashInferChoice("fa3", "x0.5")
    assert c.to_params() == {"backend": "fa3", "kv_chunk": "x0.5"}
    assert ch.family_choice("flashinfer", c.to_params()) == c and c.kv_chunk_factor == 0.5
    assert ch.FlashInferChoice("fa2", "none").kv_chunk_factor == float("inf")
    assert ch.FlashInferChoice("fa2").to_params() == {"backend": "fa2"}
    assert ch.FlashInferChoice("fa2").kv_chunk_factor is None
    # a candidate's params with a value this version does not know: MLAPlan's limit, not a crash
    assert ch.family_choice("flashinfer", {"backend": "fa2", "kv_chunk": "x3"}) == ch.FlashInferChoice("fa2")
    assert [ch.kv_chunk_factor(v) for v in ("x0.25", "x0.5", "x2", "x4")] == [0.25, 0.5, 2.0, 4.0]
