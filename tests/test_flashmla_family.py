"""The flashmla family and its op on a machine without a GPU: what it offers, what it refuses,
and that the tuned config accepts exactly its one choice. The kernel itself runs in
tests/test_gpu_flashmla.py (Hopper only)."""

from __future__ import annotations

import pytest
import torch

from mla_tune.families import Candidate, check_candidate, get_family
from mla_tune.problem.workload import model_preset, workload_for
from vllm_metax.core import tuned_config as tc
from vllm_metax.ops import flashmla as op

V3 = model_preset("deepseek-v3")


def test_the_space_is_one_page_64_candidate():
    fam = get_family("flashmla")
    w = workload_for(V3, 8, 4, 1024)
    assert [c.key for c in fam.space(w, [1, 16, 64])] == ["flashmla/flashmla/p64"]
    assert fam.space(w, [16]) == []
    assert fam.default_candidate(w, 64).key == "flashmla/flashmla/p64"


def test_check_candidate_refuses_other_pages_backends_and_knobs():
    assert check_candidate(Candidate.parse("flashmla/flashmla/p64")).page_size == 64
    for bad in ("flashmla/flashmla/p16", "flashmla/fa3/p64", "flashmla/flashmla/p64/num_kv_splits=4"):
        with pytest.raises(ValueError, match="flashmla family"):
            check_candidate(Candidate.parse(bad))


def test_not_available_off_hopper_or_without_a_gpu():
    ok, why = op.flashmla_available(capability=(8, 0))
    assert not ok and "Hopper" in why
    ok, why = op.flashmla_available(capability=(10, 0))
    assert not ok and "10.0" in why
    if not torch.cuda.is_available():
        a = get_family("flashmla").available("cuda")
        assert not a.ok and a.reason
        assert not get_family("flashmla").available("cpu").ok


def test_the_library_is_found_without_importing_vllm_and_a_failed_load_is_a_reason():
    path = op.library_path()
    assert path is not None and path.name.startswith("_flashmla_C")   # the vllm extra ships it
    ok, why = op.load_library()
    assert isinstance(ok, bool) and (ok or why)          # never raises; says why when it cannot


def test_shape_rules():
    bf = torch.bfloat16
    assert op.check_shapes(16, 512, 64, 64, bf, bf) is None
    assert "block size 64" in op.check_shapes(16, 512, 64, 16, bf, bf)
    assert "kv_lora_rank" in op.check_shapes(16, 256, 64, 64, bf, bf)
    assert "one dtype" in op.check_shapes(16, 512, 64, 64, bf, torch.float16)


def test_the_tuned_config_takes_the_flashmla_choice_and_nothing_else():
    where = "bucket"
    assert tc.check_params("flashmla", {"backend": "flashmla"}, where) == {"backend": "flashmla"}
    with pytest.raises(tc.TunedConfigError, match="backend must be 'flashmla'"):
        tc.check_params("flashmla", {"backend": "fa3"}, where)
    with pytest.raises(tc.TunedConfigError, match="unknown parameter"):
        tc.check_params("flashmla", {"backend": "flashmla", "num_kv_splits": 4}, where)
