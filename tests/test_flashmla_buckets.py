"""FlashMLA served per bucket inside FLASHINFER_MLA's decode, like the split kernel and vLLM's FA3:
when a tuned bucket runs it (`decisions.flashmla_serves`, `decisions.side_kernel`'s order), the
graph vote (`PlanChoice.flashmla_for`), and FLASHINFER_MLA's real vLLM 0.33.0 builder and impl
serving such a bucket: on a pretend MetaX GPU through the plugin's real FlashMLA op over a
simulated `flash_mla` package, on a pretend Hopper GPU with the op replaced by a reference
double (eagerly and in CUDA-graph mode), and refused with one warning where FlashMLA cannot run.
The kernel itself runs in tests/test_gpu_flashmla.py (Hopper only)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from types import SimpleNamespace

import pytest
import torch

from mla_tune.problem.reference import mla_decode_reference, relative_error
from vllm_metax.core import choices, decisions, profile, tuned_config as tc
from vllm_metax.core.device import DeviceInfo
from vllm_metax.ops import flashmla as op

FM = {"backend": "flashmla"}
SPLIT = {"backend": "triton", "num_splits": 16, "partial": "bfloat16"}
FA3 = {"backend": "fa3", "num_splits": 0}
NVIDIA = profile.PROFILES[profile.NVIDIA]
METAX_DEV = DeviceInfo("MetaX C500", "pymxsml", True, 104, (8, 0))
HOPPER_DEV = DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0))
PLAN_LOG = "vllm.vllm_metax.backend.plan_choice"


def _bucket(batch, ctx, fm_us, fi_us, best="flashmla", q_len=1, fi="fa3", **more):
    """A bucket with FlashMLA and FlashInfer times; `more`: family -> (params, time)."""
    fams = {"flashinfer": tc.FamilyChoice({"backend": fi}, time_us=fi_us),
            "flashmla": tc.FamilyChoice(dict(FM), time_us=fm_us)}
    fams.update({f: tc.FamilyChoice(dict(p), time_us=t) for f, (p, t) in more.items()})
    return tc.Bucket(batch, ctx, q_len, fams, best)


# ---------------------------------------------------------------- the rule

def test_flashmla_serves_a_best_family_win_of_at_least_the_choice_ratio():
    served = choices.FlashMLAChoice()
    assert decisions.flashmla_serves(_bucket(4, 4096, 10.0, 20.0), NVIDIA) == served
    assert decisions.flashmla_serves(_bucket(4, 4096, 20.0, 21.0), NVIDIA) == served          # 1.05x
    assert decisions.flashmla_serves(_bucket(4, 4096, 20.0, 20.0 * 1.049), NVIDIA) is None    # noise
    assert decisions.flashmla_serves(_bucket(4, 4096, 10.0, 20.0, best="flashinfer"), NVIDIA) is None
    assert decisions.flashmla_serves(_bucket(4, 4096, 10.0, None), NVIDIA) is None   # nothing to beat
    assert decisions.flashmla_serves(_bucket(4, 4096, None, 20.0), NVIDIA) is None
    assert decisions.flashmla_serves(None, NVIDIA) is None
    bad = _bucket(4, 4096, 10.0, 20.0)
    bad.families["flashmla"] = tc.FamilyChoice({"backend": "flashmla", "num_splits": 4}, 10.0)
    assert decisions.flashmla_serves(bad, NVIDIA) is None           # FlashMLA has no knobs
    # the block size: FlashMLA's only one is 64
    assert decisions.flashmla_serves(_bucket(4, 4096, 10.0, 20.0), NVIDIA, page_size=64) == served
    assert decisions.flashmla_serves(_bucket(4, 4096, 10.0, 20.0), NVIDIA, page_size=16) is None
    # the profile: both targets run FlashMLA; one that does not serves FlashInfer
    assert decisions.flashmla_serves(_bucket(4, 4096, 10.0, 20.0), profile.METAX) == served
    without = dataclasses.replace(NVIDIA, families=(choices.FLASHINFER, choices.TRITON))
    assert decisions.flashmla_serves(_bucket(4, 4096, 10.0, 20.0), without) is None


def test_side_kernel_order_is_split_then_flashmla_then_fa3():
    both = dict(fa3_mla=(FA3, 15.0))
    # FlashMLA best by 2x and FA3 not beaten by FlashInfer: FlashMLA comes first
    assert decisions.side_kernel(_bucket(4, 4096, 10.0, 20.0, **both), NVIDIA) == \
        (choices.FLASHMLA, choices.FlashMLAChoice())
    # FlashMLA best by less than the ratio: FA3 (vLLM's default, served unless FlashInfer won)
    assert decisions.side_kernel(_bucket(4, 4096, 19.5, 20.0, **both), NVIDIA) == \
        (choices.FA3, choices.FA3Choice(0))
    split_best = _bucket(1, 4096, 10.0, 20.0, best="split", split=(SPLIT, 5.0), **both)
    assert decisions.side_kernel(split_best, NVIDIA)[0] == choices.SPLIT
    # the split kernel decodes q_len 1 only; FlashMLA is not the best family: FA3
    spec = _bucket(1, 4096, 10.0, 20.0, best="split", q_len=2, split=(SPLIT, 5.0), **both)
    assert decisions.side_kernel(spec, NVIDIA)[0] == choices.FA3
    assert decisions.side_kernel(_bucket(4, 4096, 10.0, 20.0), NVIDIA, page_size=16) is None
    assert decisions.side_kernel(_bucket(4, 4096, 30.0, 20.0, best="flashinfer"), NVIDIA) is None


def test_a_flashmla_bucket_round_trips_a_config_file(tmp_path):
    entry = tc.ModelEntry(tc.ModelDims(16, 512, 64, "bfloat16", "bfloat16"), 64,
                          ["FLASHINFER_MLA", "FLASHMLA"], [_bucket(4, 4096, 10.0, 20.0)])
    path = tc.write_tuned_config(tc.TunedConfig("Test GPU", {}, [entry]), tmp_path)
    back = tc.read_tuned_config(path).models[0].buckets[0]
    assert back.best_family == "flashmla" and decisions.flashmla_serves(back, NVIDIA) == choices.FlashMLAChoice()
    assert choices.check_params("flashmla", choices.FlashMLAChoice().to_params(), "x") == choices.FlashMLAChoice()


# ---------------------------------------------------------------- PlanChoice

def _entry(buckets, page=64):
    return tc.ModelEntry(tc.ModelDims(16, 512, 64, "bfloat16", "bfloat16"), page, ["FLASHINFER_MLA"], buckets)


@pytest.mark.vllm
def test_plan_choice_per_step_per_graph_and_once_disabled(monkeypatch, caplog):
    from vllm_metax.backend.plan_choice import PlanChoice
    monkeypatch.setenv(profile.PROFILE_ENV, "nvidia")
    entry = _entry([_bucket(8, 1024, 10.0, 20.0), _bucket(8, 4096, 10.0, 20.0),
                    _bucket(8, 16384, 30.0, 20.0, best="flashinfer"),
                    _bucket(2, 1024, 10.0, 20.0), _bucket(2, 4096, 30.0, 20.0, best="flashinfer"),
                    _bucket(1, 1024, 10.0, 20.0, best="split", split=(SPLIT, 5.0))])
    choice = PlanChoice(entry, decisions.FlashInferBackends(("fa3", "fa2"), "fa3"))
    fm = choices.FlashMLAChoice()
    assert choice.flashmla_for(8, 1000) == fm and choice.flashmla_for(8, 5000) == fm
    assert choice.flashmla_for(8, 20000) is None and choice.flashmla_for(2, 4096) is None
    assert choice.flashmla_for(1, 1024) is None                # the split kernel's bucket
    # a graph fixes one kernel per batch size: FlashMLA serves 2 of 3 buckets at batch 8, 1 of 2 at 2
    assert choice.flashmla_for(8, 1, graph=True) == fm and choice.flashmla_for(6, 99999, graph=True) == fm
    assert choice.flashmla_for(2, 1024, graph=True) is None
    assert choice.serves_flashmla()
    said = choice.describe()
    assert "FlashMLA in 3" in said and "split-KV Triton in 1" in said and "FlashInfer fa3 in 2" in said
    with caplog.at_level(logging.WARNING, logger=PLAN_LOG):
        choice.turn_off(choices.FLASHMLA, "test reason")
        choice.turn_off(choices.FLASHMLA, "again")
    warned = [r.getMessage() for r in caplog.records if "FlashMLA decode buckets cannot run" in r.getMessage()]
    assert len(warned) == 1 and "test reason" in warned[0]
    assert choice.flashmla_for(8, 1000) is None and choice.flashmla_for(8, 1, graph=True) is None
    assert not choice.serves_flashmla() and "FlashMLA" not in choice.describe()


@pytest.mark.vllm
def test_a_config_without_flashmla_buckets_never_warns(monkeypatch, caplog):
    from vllm_metax.backend.plan_choice import PlanChoice
    choice = PlanChoice(_entry([_bucket(8, 1024, 30.0, 20.0, best="flashinfer")]),
                        decisions.FlashInferBackends(("fa3", "fa2"), "fa3"))
    with caplog.at_level(logging.WARNING, logger=PLAN_LOG):
        choice.turn_off(choices.FLASHMLA, "no library")
    assert not choice.serves_flashmla() and not caplog.records


# ---------------------------------------------------------------- FLASHINFER_MLA's builder and impl

def _served(monkeypatch, tmp_path, device, fi, page=64, cudagraph=None, extra=()):
    """FLASHINFER_MLA's builder and impl on a pretend `device` (FlashInfer replaced by the
    recording double) with a tuned config whose B1/B4 buckets FlashMLA wins and whose B16 bucket
    FlashInfer wins; `extra`: more families in the FlashMLA buckets."""
    import plugin_support as ps
    ps.install_recording_plugin(monkeypatch, device)
    monkeypatch.delenv(profile.PROFILE_ENV, raising=False)
    more = dict(extra)
    buckets = [_bucket(b, c, 10.0, 20.0, fi=fi, **more) for b in (1, 4) for c in (64, 512)]
    buckets.append(_bucket(16, 512, 30.0, 20.0, best="flashinfer", fi=fi))
    dims = tc.ModelDims(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM, "bfloat16", "bfloat16")
    entry = tc.ModelEntry(dims, page, ["FLASHINFER_MLA", "TRITON_MLA"], buckets)
    tc.write_tuned_config(tc.TunedConfig(device.name, {"test": True}, [entry]), tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()
    vc = ps.make_vllm_config(tmp_path / "model", block_size=page, cudagraph_mode=cudagraph)
    return ps, vc


def _qkv(rows, num_pages, page=64, seed=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 16, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(num_pages, page, 576, generator=g).to(torch.bfloat16)
    return q, kv


def _reference(ps, q, kv, bt, lens, q_len=1):
    return mla_decode_reference(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], bt, lens,
                                ps.softmax_scale(), q_len=q_len)


@pytest.fixture
def flash_mla(monkeypatch):
    from plugin_support import FakeFlashMLA
    fake = FakeFlashMLA()
    monkeypatch.setitem(sys.modules, "flash_mla", fake.module)
    return fake


@pytest.mark.vllm
def test_on_metax_a_flashmla_bucket_runs_the_real_op_on_the_same_paged_cache(monkeypatch, tmp_path, flash_mla):
    ps, vc = _served(monkeypatch, tmp_path, METAX_DEV, "fa2")
    try:
        builder, impl = ps.make_builder(vc), ps.make_impl(vc)
        assert builder.choice.serves_flashmla() and builder._flashmla.op(False).library == op.VENDOR_LIBRARY
        seq_lens = [5, 300, 77, 64]
        md, bt, lens, num_pages = ps.build_decode(builder, seq_lens, 64)
        assert md.backend == choices.FLASHMLA and isinstance(md.kernel, op.FlashMLAStep)
        assert md.paged is None and not md.return_lse and not ps.RecordingKernel.instances
        q, kv = _qkv(4, num_pages)
        out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), kv, SimpleNamespace(decode=md), None)
        out2, _ = impl.forward_mqa(q, kv, SimpleNamespace(decode=md), None)      # the next layer
        assert lse is None and relative_error(out, _reference(ps, q, kv, bt, lens)) < 1e-2
        assert torch.equal(out, out2)
        # one schedule a step (its first layer), for these lengths; every layer reads the one cache
        assert flash_mla.metadata_calls == [(seq_lens, 16, 1)]
        first, second = flash_mla.fwd_calls
        assert first["k_shape"] == (num_pages, 64, 1, 576) and first["q_shape"] == (4, 1, 16, 576)
        assert first["block_table"].data_ptr() == bt.data_ptr() and first["seq_lens"] == seq_lens
        assert first["scale"] == pytest.approx(ps.softmax_scale()) and first["causal"] is True
        assert second["tsm"] == first["tsm"] == 1
        # the next step schedules again; the bucket FlashInfer wins plans FlashInfer fa2
        md2, *_ = ps.build_decode(builder, [7, 9], 64)
        impl.forward_mqa(q[:2], kv, SimpleNamespace(decode=md2), None)
        assert flash_mla.metadata_calls[-1] == ([7, 9], 16, 1)
        md16, *_ = ps.build_decode(builder, [500] * 16, 64)
        assert md16.backend == "fa2" and ps.RecordingKernel.instances
    finally:
        tc.clear_cache()


@pytest.mark.vllm
def test_multi_token_decode_in_a_flashmla_bucket_is_causal(monkeypatch, tmp_path, flash_mla):
    ps, vc = _served(monkeypatch, tmp_path, METAX_DEV, "fa2")
    try:
        builder, impl = ps.make_builder(vc), ps.make_impl(vc)
        md, bt, lens, num_pages = ps.build_decode(builder, [40, 9], 64, q_len=2)
        assert md.backend == choices.FLASHMLA and md.q_len == 2
        q, kv = _qkv(4, num_pages)
        out, _ = impl.forward_mqa(q, kv, SimpleNamespace(decode=md), None)
        assert flash_mla.metadata_calls == [([40, 9], 2 * 16, 1)]
        assert relative_error(out, _reference(ps, q, kv, bt, lens, q_len=2)) < 1e-2
    finally:
        tc.clear_cache()


class _ReferenceFlashMLA:
    """Stands in for op.FlashMLADecode on the CPU (vLLM's library needs Hopper): records its
    steps and calls, attends with the torch reference into the given output."""

    made: list = []

    def __init__(self, softmax_scale, causal=False, library=None):
        self.softmax_scale, self.causal, self.library = float(softmax_scale), causal, op.VLLM_LIBRARY
        self.steps, self.calls = 0, []
        _ReferenceFlashMLA.made.append(self)

    def new_step(self):
        self.steps += 1

    def run(self, q, kv_cache, block_table, seq_lens, out=None):
        b, s, h, _ = q.shape
        self.calls.append(dict(kv=kv_cache, block_table=block_table, seq_lens=seq_lens.tolist(), out=out))
        rows = q.reshape(b * s, h, 576)
        res = mla_decode_reference(rows[..., :512], rows[..., 512:], kv_cache[..., :512], kv_cache[..., 512:],
                                   block_table, seq_lens, self.softmax_scale, q_len=s)
        if out is None:
            return res.view(b, s, h, 512).clone(), None
        out.copy_(res.view(b, s, h, 512))
        return out, None


@pytest.fixture
def reference_op(monkeypatch):
    _ReferenceFlashMLA.made.clear()
    monkeypatch.setattr(op, "FlashMLADecode", _ReferenceFlashMLA)
    monkeypatch.setattr(op, "flashmla_available", lambda device=None: (True, ""))
    return _ReferenceFlashMLA.made


@pytest.mark.vllm
def test_on_hopper_the_op_gets_the_packed_cache_and_writes_the_impls_output(monkeypatch, tmp_path, reference_op):
    ps, vc = _served(monkeypatch, tmp_path, HOPPER_DEV, "fa3", cudagraph="PIECEWISE")
    try:
        builder, impl = ps.make_builder(vc), ps.make_impl(vc)
        assert len(reference_op) == 1 and reference_op[0].causal      # eager only: no full graphs
        assert not builder.full_cudagraph
        md, bt, lens, num_pages = ps.build_decode(builder, [5, 300, 77], 64)
        kernel = reference_op[0]
        assert md.backend == choices.FLASHMLA and kernel.steps == 1
        q, kv = _qkv(3, num_pages)
        out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), kv, SimpleNamespace(decode=md), None)
        (call,) = kernel.calls
        assert call["kv"].data_ptr() == kv.data_ptr() and call["kv"].shape == kv.shape   # no copy
        assert call["out"].data_ptr() == out.data_ptr() and call["seq_lens"] == [5, 300, 77]
        assert call["block_table"].data_ptr() == bt.data_ptr() and call["block_table"].shape[0] == 3
        assert relative_error(out, _reference(ps, q, kv, bt, lens)) < 1e-2
        # at q_len 2 FlashMLA takes no output tensor (it refuses one): its own is copied
        md2, bt2, lens2, pages2 = ps.build_decode(builder, [40, 9], 64, q_len=2)
        q2, kv2 = _qkv(4, pages2)
        out2, _ = impl.forward_mqa(q2, kv2, SimpleNamespace(decode=md2), None)
        assert md2.backend == choices.FLASHMLA and kernel.calls[-1]["out"] is None
        assert relative_error(out2, _reference(ps, q2, kv2, bt2, lens2, q_len=2)) < 1e-2
        # a step that asks for the decode LSE (context parallelism) plans FlashInfer
        builder.plan_lse = True
        md_lse, *_ = ps.build_decode(builder, [5, 300, 77], 64)
        assert md_lse.backend == "fa3" and kernel.steps == 2
    finally:
        tc.clear_cache()


@pytest.mark.vllm
def test_in_cuda_graph_mode_the_ops_are_made_up_front_and_the_vote_decides(monkeypatch, tmp_path, reference_op):
    ps, vc = _served(monkeypatch, tmp_path, HOPPER_DEV, "fa3", cudagraph="FULL_AND_PIECEWISE")
    try:
        builder = ps.make_builder(vc)
        assert builder.full_cudagraph and len(reference_op) == 2        # eager and graph, before any capture
        eager, graph = builder._flashmla.op(False), builder._flashmla.op(True)
        assert eager is not graph
        md, *_ = ps.build_decode(builder, [5, 300, 77, 10], 64)
        assert md.cuda_graph and md.backend == choices.FLASHMLA and md.kernel.kernel is graph
        assert graph.steps == 1 and eager.steps == 0
        # batch 16 (beyond the largest capture size 8): eager; FlashInfer's bucket plans FlashInfer
        md16, *_ = ps.build_decode(builder, [500] * 16, 64)
        assert not md16.cuda_graph and md16.backend == "fa3"
        # the graph of batch 8 takes the vote of the nearest tuned batch (4): FlashMLA
        md8, *_ = ps.build_decode(builder, [9000] * 8, 64)
        assert md8.cuda_graph and md8.backend == choices.FLASHMLA and md8.kernel.kernel is graph
    finally:
        tc.clear_cache()


@pytest.mark.vllm
@pytest.mark.parametrize("flashmla_here", [True, False])
def test_flashmla_comes_before_fa3_and_fa3_takes_the_buckets_where_flashmla_is_off(
        monkeypatch, tmp_path, caplog, flashmla_here):
    from vllm_metax.ops import fa3_mla
    if flashmla_here:
        monkeypatch.setattr(op, "FlashMLADecode", _ReferenceFlashMLA)
        monkeypatch.setattr(op, "flashmla_available", lambda device=None: (True, ""))
    ps, vc = _served(monkeypatch, tmp_path, HOPPER_DEV, "fa3", extra={"fa3_mla": (FA3, 15.0)})
    monkeypatch.setattr(fa3_mla, "fa3_available", lambda device=None: (True, ""))
    monkeypatch.setattr(fa3_mla, "FA3MLADecode", lambda *a, **kw: SimpleNamespace(
        schedule=lambda *a: None, num_splits=0))
    try:
        with caplog.at_level(logging.WARNING, logger=PLAN_LOG):
            builder = ps.make_builder(vc)                # without the double: a CPU, no FlashMLA here
        md, *_ = ps.build_decode(builder, [5, 300, 77], 64)
        assert md.backend == (choices.FLASHMLA if flashmla_here else choices.FA3)
        assert builder.choice.flashmla_enabled == flashmla_here
        warned = sum("FlashMLA decode buckets cannot run" in r.getMessage() for r in caplog.records)
        assert warned == (0 if flashmla_here else 1)
    finally:
        tc.clear_cache()


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["absent", "block 16", "metax without flash_mla"])
def test_where_flashmla_cannot_run_flashinfer_serves_with_one_warning(monkeypatch, tmp_path, caplog, case):
    if case == "absent":                  # an NVIDIA host without a GPU: vLLM's library cannot run
        ps, vc, page, fi, why = *_served(monkeypatch, tmp_path, HOPPER_DEV, "fa3"), 64, "fa3", "CUDA"
    elif case == "block 16":              # a hand-written config at another block size
        monkeypatch.setattr(op, "flashmla_available", lambda device=None: (True, ""))
        ps, vc = _served(monkeypatch, tmp_path, HOPPER_DEV, "fa3", page=16)
        page, fi, why = 16, "fa3", "KV block size 64, not 16"
    else:
        monkeypatch.setitem(sys.modules, "flash_mla", None)
        ps, vc = _served(monkeypatch, tmp_path, METAX_DEV, "fa2")
        page, fi, why = 64, "fa2", "flash_mla package is not importable"
    try:
        with caplog.at_level(logging.WARNING, logger=PLAN_LOG):
            builder = ps.make_builder(vc)
            md, *_ = ps.build_decode(builder, [5, 300, 77], page)
            md2, *_ = ps.build_decode(builder, [50, 30], page, seed=1)
        assert md.backend == fi and md2.backend == fi and not builder.choice.flashmla_enabled
        warned = [r.getMessage() for r in caplog.records if "FlashMLA decode buckets cannot run" in r.getMessage()]
        assert len(warned) == 1 and why in warned[0], warned
        assert "FlashMLA" not in builder.choice.describe()
    finally:
        tc.clear_cache()


# ---------------------------------------------------------------- the step's tensors

def test_the_step_refuses_columns_of_two_caches_a_row_mismatch_and_an_lse_request():
    kv = torch.zeros(3, 64, 576)
    packed = op.packed_cache(kv[..., :512], kv[..., 512:])
    assert packed.data_ptr() == kv.data_ptr() and packed.shape == kv.shape and torch.equal(packed, kv)
    with pytest.raises(ValueError, match="packed"):
        op.packed_cache(kv[..., :512], torch.zeros(3, 64, 64))
    with pytest.raises(ValueError, match="packed"):
        op.packed_cache(kv[..., :512], kv[..., 448:512])
    step = op.FlashMLAStep(_ReferenceFlashMLA(0.1), torch.zeros(2, 1, dtype=torch.int32),
                           torch.tensor([3, 4], dtype=torch.int32), 1)
    q = torch.zeros(3, 16, 576)
    with pytest.raises(ValueError, match="2 requests x q_len 1; got 3 rows"):
        step.run(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:])
    with pytest.raises(ValueError, match="no decode LSE"):
        step.run(q[:2, :, :512], q[:2, :, 512:], kv[..., :512], kv[..., 512:], return_lse=True)
