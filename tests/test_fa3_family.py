"""The fa3_mla family (vLLM's FA3 MLA decode, FLASH_ATTN_MLA's kernel) and its op on a machine
without a GPU: its knobs and their domain (one rule for tuner, bench and config), what it offers,
what it refuses and why. The kernel itself runs in tests/test_gpu_fa3.py (Hopper only)."""

from __future__ import annotations

import pytest
import torch

from mla_tune.families import Candidate, check_candidate, get_family
from mla_tune.problem.workload import model_preset, workload_for
from vllm_metax.core import choices
from vllm_metax.ops import fa3_mla as op

V3 = model_preset("deepseek-v3")


def test_the_space_is_each_split_bound_per_page_that_is_a_multiple_of_16():
    fam = get_family("fa3_mla")
    w = workload_for(V3, 8, 4, 1024)
    keys = [c.key for c in fam.space(w, [1, 16, 64])]
    assert not [k for k in keys if "/p1/" in k]
    assert "fa3_mla/fa3/p64/num_splits=0" in keys and "fa3_mla/fa3/p16/num_splits=32" in keys
    assert "fa3_mla/fa3/p64/num_splits=0,schedule=none" in keys
    assert len(keys) == len(set(keys)) == 2 * 8
    assert fam.space(w, [1]) == []
    # vLLM's own FLASH_ATTN_MLA under CUDA graphs: ahead-of-time schedule, at most 32 splits
    assert fam.default_candidate(w, 64).key == "fa3_mla/fa3/p64/num_splits=32"


def test_knobs_parse_both_ways_and_bad_ones_name_the_legal_values():
    c = choices.check_params(choices.FA3, {"backend": "fa3", "num_splits": 8, "schedule": "none"}, "x")
    assert c == choices.FA3Choice(8, "none")
    assert choices.check_params(choices.FA3, c.to_params(), "x") == c
    assert choices.FA3Choice(0).to_params() == {"backend": "fa3", "num_splits": 0}
    for params, msg in (({"backend": "fa3", "num_splits": -1}, "0..256"),
                        ({"backend": "fa3", "num_splits": 300}, "0..256"),
                        ({"backend": "fa3", "num_splits": True}, "integer"),
                        ({"backend": "fa2", "num_splits": 0}, "'fa3'"),
                        ({"backend": "fa3", "num_splits": 0, "schedule": "jit"}, "aot, none"),
                        ({"backend": "fa3", "num_splits": 0, "pipe": "x"}, "unknown parameter 'pipe'"),
                        ({"backend": "fa3"}, "integer")):
        with pytest.raises(choices.ChoiceError, match=msg):
            choices.check_params(choices.FA3, params, "bucket 3")
    # the plugin's lenient reading: nothing usable is None, never an exception
    assert choices.family_choice(choices.FA3, {"num_splits": "x"}) is None
    assert choices.family_choice(choices.FA3, {"backend": "fa3", "num_splits": 4}) == choices.FA3Choice(4)


def test_check_candidate_takes_the_family_form_and_refuses_the_rest():
    assert check_candidate(Candidate.parse("fa3_mla/fa3/p64/num_splits=4,schedule=none")).params == {
        "num_splits": 4, "schedule": "none"}
    for bad, msg in (("fa3_mla/fa3/p1/num_splits=0", "multiple of 16"),
                     ("fa3_mla/fa3/p64", "missing knob num_splits"),
                     ("fa3_mla/fa3/p64/num_splits=0,kv_chunk=x2", "kv_chunk"),
                     ("fa3_mla/fa2/p64/num_splits=0", "'fa3'")):
        with pytest.raises(ValueError, match=msg):
            check_candidate(Candidate.parse(bad))


def test_not_available_off_hopper_without_the_library_or_without_a_gpu(monkeypatch):
    ok, why = op.fa3_available(capability=(8, 0))
    assert not ok and "Hopper" in why and "8.0" in why
    ok, why = op.fa3_available(capability=(10, 0))
    assert not ok and "10.0" in why
    if not torch.cuda.is_available():
        a = get_family("fa3_mla").available("cuda")
        assert not a.ok and "CUDA" in a.reason
        assert not get_family("fa3_mla").available("cpu").ok
    monkeypatch.setattr(op, "_loaded", None)
    monkeypatch.setattr(op, "_has_op", lambda: False)
    monkeypatch.setattr(op, "library_path", lambda: None)
    ok, why = op.fa3_available(capability=(9, 0))
    assert not ok and "_vllm_fa3_C" in why and "not installed" in why


def test_the_library_is_found_beside_vllm_without_importing_it_and_a_failed_load_is_a_reason():
    path = op.library_path()
    assert path is not None and path.name.startswith("_vllm_fa3_C")   # the vllm extra ships it
    assert path.parent.name == "vllm_flash_attn"
    ok, why = op.load_library()
    assert isinstance(ok, bool) and (ok or why)          # never raises; says why when it cannot


def test_shape_rules():
    bf = torch.bfloat16
    assert op.check_shapes(512, 64, 64, bf, bf) is None
    assert "multiple of 16" in op.check_shapes(512, 64, 8, bf, bf)
    assert "kv_lora_rank 512 + rope 64" in op.check_shapes(256, 64, 64, bf, bf)
    assert "one dtype" in op.check_shapes(512, 64, 64, bf, torch.float16)
    # FA3's own formula for the persistent metadata buffer (vLLM's builder sizes it the same way)
    assert [op.metadata_size(b) for b in (1, 4, 5, 64)] == [17, 17, 33, 257]


def test_the_prepared_op_is_refused_with_a_reason_on_the_cpu():
    from mla_tune.families.base import CandidateInvalid
    from mla_tune.problem.instance import make_problem
    w = workload_for(V3, 8, 2, 256)
    p = make_problem(w, 64, "cpu", seed=0)
    with pytest.raises(CandidateInvalid, match="CUDA"):
        get_family("fa3_mla").prepare(w, Candidate.parse("fa3_mla/fa3/p64/num_splits=0"), p)
