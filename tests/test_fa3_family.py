"""The fa3_mla family (vLLM's FA3 MLA decode, FLASH_ATTN_MLA's kernel) and its op on a machine
without a GPU: its knobs and their domain (one rule for tuner, bench and config), what it offers,
what it refuses and why. The kernel itself runs in tests/test_gpu_fa3.py (Hopper only)."""

from __future__ import annotations

import logging

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
    monkeypatch.setattr(op._LIBRARY, "loaded", None)
    monkeypatch.setattr(op._LIBRARY, "has_ops", lambda: False)
    monkeypatch.setattr(op._LIBRARY, "path", lambda: None)
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


# ---------------------------------------------------------------- when and how the plugin serves it

from types import SimpleNamespace  # noqa: E402

from vllm_metax.core import decisions, tuned_config as tc  # noqa: E402

FA3 = {"backend": "fa3", "num_splits": 8}


def _bucket(batch, ctx, fa3_us, fi_us, best="fa3_mla", params=FA3, q_len=1):
    fams = {"flashinfer": tc.FamilyChoice({"backend": "fa3"}, time_us=fi_us),
            "fa3_mla": tc.FamilyChoice(dict(params), time_us=fa3_us)}
    return tc.Bucket(batch, ctx, q_len, fams, best)


def test_fa3_serves_unless_flashinfer_won_by_the_choice_ratio_and_round_trips_a_config(tmp_path):
    # vLLM's own Hopper default: served wherever measured, unless FlashInfer won by >= 1.05x
    assert decisions.fa3_serves(_bucket(64, 16384, 460.0, 570.0)) == choices.FA3Choice(8)
    assert decisions.fa3_serves(_bucket(64, 16384, 460.0, 460.0 / 1.049, best="flashinfer")) == \
        choices.FA3Choice(8)                                                  # within noise: FA3
    assert decisions.fa3_serves(_bucket(64, 16384, 460.0, 460.0 / 1.06, best="flashinfer")) is None
    assert decisions.fa3_serves(_bucket(64, 16384, 460.0, None)) == choices.FA3Choice(8)
    assert decisions.fa3_serves(_bucket(64, 16384, None, 570.0)) is None
    assert decisions.fa3_serves(_bucket(64, 16384, 460.0, 570.0, params={**FA3, "num_splits": -2})) is None
    entry = tc.ModelEntry(tc.ModelDims(128, 512, 64, "bfloat16", "bfloat16"), 64,
                          ["FLASHINFER_MLA", "TRITON_MLA"], [_bucket(64, 16384, 460.0, 570.0)])
    path = tc.write_tuned_config(tc.TunedConfig("Test GPU", {}, [entry]), tmp_path)
    back = tc.read_tuned_config(path).models[0].buckets[0]
    assert back.best_family == "fa3_mla" and decisions.fa3_serves(back) == choices.FA3Choice(8)
    with pytest.raises(tc.TunedConfigError, match="schedule must be one of"):
        tc.check_params("fa3_mla", {**FA3, "schedule": "later"}, "bucket 0")


@pytest.mark.vllm
def test_plan_choice_per_step_per_graph_and_once_disabled():
    from vllm_metax.backend.plan_choice import PlanChoice
    f32 = {**FA3, "num_splits": 32}
    entry = tc.ModelEntry(tc.ModelDims(128, 512, 64, "bfloat16", "bfloat16"), 64, ["FLASHINFER_MLA"], [
        _bucket(64, 8192, 460.0, 570.0), _bucket(64, 16384, 460.0, 570.0, params=f32),
        _bucket(64, 32768, 900.0, 980.0, params=f32), _bucket(4, 4096, 31.7, 26.3, best="flashinfer"),
        _bucket(4, 8192, 40.0, 41.0)])
    choice = PlanChoice(entry, decisions.FlashInferBackends(("fa3", "fa2"), "fa3"))
    assert choice.fa3_for(64, 8000) == choices.FA3Choice(8)
    assert choice.fa3_for(64, 30000) == choices.FA3Choice(32)
    assert choice.fa3_for(4, 4096) is None                   # FlashInfer 1.21x faster: FlashInfer
    assert choice.fa3_for(4, 8192) == choices.FA3Choice(8)   # 1.025x FA3's way: FA3, vLLM's default
    # a graph of batch 64: FA3 serves 3 of 3 buckets, the knobs most of them name (32)
    assert choice.fa3_for(64, 1, graph=True) == choices.FA3Choice(32)
    assert choice.fa3_for(4, 1, graph=True) is None           # 1 of 2 buckets is not most
    assert choice.fa3_choices() == [choices.FA3Choice(8), choices.FA3Choice(32)]
    assert "vLLM FA3 in 4" in choice.describe()
    choice.turn_off(choices.FA3, "test")
    assert choice.fa3_for(64, 8000) is None and choice.fa3_for(64, 1, graph=True) is None
    assert choice.fa3_choices() == []


def _fa3_builder(monkeypatch, tmp_path):
    """FLASHINFER_MLA's builder (FlashInfer replaced by the recording double) with a tuned config
    whose B1-B4 buckets name fa3_mla and whose B16 bucket FlashInfer wins."""
    import plugin_support as ps
    from vllm_metax.core.device import DeviceInfo

    dev = DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0))
    fb = ps.install_recording_plugin(monkeypatch, dev)
    dims = tc.ModelDims(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM, "bfloat16", "bfloat16")
    buckets = [_bucket(b, c, 10.0, 20.0) for b in (1, 4) for c in (64, 512)]
    buckets.append(_bucket(16, 512, 30.0, 20.0, best="flashinfer"))
    entry = tc.ModelEntry(dims, 16, ["FLASHINFER_MLA", "TRITON_MLA"], buckets)
    tc.write_tuned_config(tc.TunedConfig(dev.name, {"test": True}, [entry]), tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()
    return ps, ps.make_vllm_config(tmp_path / "model", block_size=16)


def _decode(ps, builder, seq_lens, seed=0):
    bt, lens, common, num_pages = ps.ragged_batch(seq_lens, 16, 1, extra_rows=2, seed=seed)
    n = len(seq_lens)
    md = builder._build_decode(
        block_table_tensor=bt[:n], seq_lens_device=lens, max_seq_len=max(seq_lens),
        query_start_loc_cpu=common.query_start_loc_cpu, query_start_loc_device=common.query_start_loc,
        num_decode_tokens=n, max_query_len=1, dcp_tot_seq_lens_device=None)
    return md, bt, lens, num_pages


class _ReferenceFA3:
    """Stands in for op.FA3MLADecode on the CPU (the real one needs Hopper): records its knobs,
    its schedule and its calls, attends with the torch reference."""

    made: list = []

    def __init__(self, softmax_scale, num_heads, page_size, num_splits=0, schedule="aot",
                 max_batch=0, device=None):
        self.args = dict(scale=softmax_scale, heads=num_heads, page=page_size, splits=num_splits,
                         schedule=schedule, max_batch=max_batch)
        self.schedules, self.calls = [], []
        _ReferenceFA3.made.append(self)

    def schedule(self, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, dtype):
        self.schedules.append((seq_lens.tolist(), cu_seqlens_q.tolist(), max_seqlen_q, max_seqlen_k))

    def run(self, q_nope, q_pe, ckv, kpe, block_table, seq_lens, cu_q, max_q, max_k, out=None,
            return_lse=False):
        from mla_tune.problem.reference import mla_decode_reference
        self.calls.append((block_table, seq_lens.tolist(), max_k))
        res = mla_decode_reference(q_nope, q_pe, ckv, kpe, block_table, seq_lens.cpu(), self.args["scale"])
        out.copy_(res)
        return out


@pytest.mark.vllm
def test_a_tuned_fa3_bucket_is_served_with_the_steps_tensors_scale_and_schedule(monkeypatch, tmp_path):
    from mla_tune.problem.reference import mla_decode_reference, relative_error
    ps, vc = _fa3_builder(monkeypatch, tmp_path)
    try:
        _ReferenceFA3.made.clear()
        monkeypatch.setattr(op, "FA3MLADecode", _ReferenceFA3)
        monkeypatch.setattr(op, "fa3_available", lambda device=None: (True, ""))
        builder = ps.make_builder(vc)
        # made up front (before any graph capture), with the largest batch's metadata buffer
        assert [k.args["splits"] for k in _ReferenceFA3.made] == [8]
        assert _ReferenceFA3.made[0].args["max_batch"] >= vc.scheduler_config.max_num_seqs
        impl = ps.make_impl(vc)
        md, bt, lens, num_pages = _decode(ps, builder, [5, 300, 77])
        assert md.backend == "fa3_mla" and md.paged is None and not ps.RecordingKernel.instances
        kernel = _ReferenceFA3.made[0]
        assert kernel.schedules == [([5, 300, 77], [0, 1, 2, 3], 1, 300)]    # once per step
        g = torch.Generator().manual_seed(3)
        q = torch.randn(3, ps.NUM_HEADS, 576, generator=g).to(torch.bfloat16)
        kv = torch.randn(num_pages, 16, 576, generator=g).to(torch.bfloat16)
        out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), kv, SimpleNamespace(decode=md), None)
        (bt_seen, lens_seen, max_k), = kernel.calls
        assert bt_seen.data_ptr() == bt.data_ptr() and bt_seen.shape[0] == 3 and lens_seen == [5, 300, 77]
        assert lse is None and max_k == 300
        ref = mla_decode_reference(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], bt, lens,
                                   ps.softmax_scale())
        assert relative_error(out, ref) < 1e-2
        # the bucket FlashInfer wins plans FlashInfer
        md16, *_ = _decode(ps, builder, [500] * 16)
        assert md16.backend == "fa3" and ps.RecordingKernel.instances
    finally:
        tc.clear_cache()


@pytest.mark.vllm
def test_where_fa3_cannot_run_its_buckets_plan_flashinfer_with_one_warning(monkeypatch, tmp_path, caplog):
    ps, vc = _fa3_builder(monkeypatch, tmp_path)         # a CPU device: no FA3 here
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.vllm_metax.backend.plan_choice"):
            builder = ps.make_builder(vc)
            md, *_ = _decode(ps, builder, [5, 300, 77])
            md2, *_ = _decode(ps, builder, [50, 30], seed=1)
        assert md.backend == "fa3" and md2.backend == "fa3" and not builder.choice.fa3_enabled
        warnings = [r.getMessage() for r in caplog.records if "FA3 MLA decode cannot run" in r.getMessage()]
        assert len(warnings) == 1 and "num_splits=8" in warnings[0] and "CUDA" in warnings[0]
    finally:
        tc.clear_cache()
