"""The split family on a machine without a GPU: its search space and default, what the tuned
config and the candidate parser accept, when the plugin serves it (`decisions.split_serves`, the
graph vote), and FLASHINFER_MLA's decode with a tuned split bucket through vLLM 0.33.0's real
builder and impl: served where the kernel passes its check (the kernel replaced by a torch double
that reads exactly the block table, lengths and scale the step bound), FlashInfer with one
warning where it does not. The real kernel runs in tests/test_split_decode_kernel.py (Triton's
interpreter) and tests/test_gpu_split.py (the GPU)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from mla_tune.families import Candidate, check_candidate, get_family
from mla_tune.families.split import default_splits, useful_splits
from mla_tune.problem.workload import model_preset, workload_for
from vllm_metax.core import choices, decisions, tuned_config as tc
from vllm_metax.ops import split_decode as op

V3 = model_preset("deepseek-v3")
SPLIT = {"backend": "triton", "num_splits": 16, "partial": "bfloat16"}


def _bucket(batch, ctx, split_us, fi_us, best="split", params=SPLIT, q_len=1):
    fams = {"flashinfer": tc.FamilyChoice({"backend": "fa3"}, time_us=fi_us),
            "split": tc.FamilyChoice(dict(params), time_us=split_us)}
    return tc.Bucket(batch, ctx, q_len, fams, best)


# ---------------------------------------------------------------- the family's space

def test_space_is_page_64_q_len_1_and_only_splits_a_request_uses():
    fam = get_family("split")
    w = workload_for(V3, 8, 1, 1024)                 # 16 heads, B1, L1K: 16 chunks of 64 at most
    keys = [c.key for c in fam.space(w, [1, 16, 64])]
    # the served pipe (no `pipe` knob) at every useful count; the other pipes where the count can
    # be best (t32x4: its one-wave count 32 and the useful one below; -pdl: the one-wave count)
    assert keys == [f"split/triton/p64/num_splits={s},partial=bfloat16" for s in (4, 8, 16)] + \
        ["split/triton/p64/num_splits=16,partial=float32"] + \
        [f"split/triton/p64/num_splits={s},partial=bfloat16,pipe=t32x4" for s in (16, 32)] + \
        ["split/triton/p64/num_splits=16,partial=bfloat16,pipe=t64-pdl",
         "split/triton/p64/num_splits=32,partial=bfloat16,pipe=t32x4-pdl"]
    assert fam.default_candidate(w, 64).params == {"num_splits": 16, "partial": "bfloat16"}
    assert fam.space(w, [1, 16]) == []               # the default page only
    with pytest.raises(Exception, match="page 64"):
        fam.default_candidate(w, 16)
    w2 = workload_for(V3, 8, 1, 1024, q_len=2)
    assert fam.space(w2, [64]) == []
    with pytest.raises(Exception, match="q_len 1"):
        fam.default_candidate(w2, 64)


def test_space_stays_within_the_served_workspace_and_the_default_is_one_wave():
    assert op.served_rows(16) == op.MAX_PROGRAMS and op.served_rows(128) == op.MAX_PROGRAMS // 2
    for heads, batch, ctx in ((16, 1, 32768), (16, 128, 32768), (128, 64, 4096), (128, 256, 1024)):
        useful = useful_splits(heads, batch, ctx)
        assert all(op.fits(heads, batch, s) for s in useful)
        assert [op.splits_for(ctx, 64, s) for s in useful] == sorted({op.splits_for(ctx, 64, s) for s in useful})
    assert useful_splits(16, 1, 32768) == [4, 8, 16, 32, 64, 128, 256]
    assert useful_splits(128, 128, 1024) == [4]          # 128 x 4 x 2 head blocks = 1024 <= 1056
    assert useful_splits(128, 256, 1024) == [] and not op.fits(128, 256, 4)
    assert default_splits(16, 1, 32768) == 128           # 128 programs: one wave of 132
    assert default_splits(128, 2, 32768) == 32           # 2 head blocks x 2 requests x 32
    assert default_splits(16, 64, 1024) == 4             # none fits one wave: the smallest


def test_other_pipes_are_offered_beside_their_one_wave_count_and_pdl_at_small_work_only():
    from mla_tune.families.split import SMALL_WORK_TOKENS, pipe_splits
    for heads, batch, ctx in ((16, 1, 32768), (16, 8, 4096), (128, 4, 16384), (128, 1, 1024)):
        for pipe in ("t32x4", "t32x4-pdl", "t64-pdl"):
            useful = useful_splits(heads, batch, ctx, pipe)
            wave = default_splits(heads, batch, ctx, pipe)
            got = pipe_splits(heads, batch, ctx, pipe)
            if pipe.endswith("-pdl"):
                assert got == ([wave] if batch * ctx <= SMALL_WORK_TOKENS else [])
            else:
                i = useful.index(wave)
                assert got == useful[max(0, i - 1):i + 2] and wave in got
    # a batch that fills the GPU by itself: the other pipes also run one or two splits a request
    # (no merge, or a short one); the served pipe's counts start at 4, as measured
    assert pipe_splits(16, 128, 4096, "t32x4") == [1, 2] and pipe_splits(16, 64, 4096, "t32x4") == [1, 2, 4]
    assert useful_splits(16, 128, 4096)[0] == 4
    # 32-token tiles: a 1K request has 32 chunks to split into (64-token tiles: 16)
    assert useful_splits(16, 1, 1024, "t32x4") == [1, 2, 4, 8, 16, 32] and useful_splits(16, 1, 1024) == [4, 8, 16]
    # t32x4's 64 head rows: 16 heads are one head block, 128 heads two (as t64's)
    assert op.served_rows(16, "t32x4") == op.MAX_PROGRAMS and op.served_rows(128, "t32x4") == op.MAX_PROGRAMS // 2
    assert default_splits(16, 1, 32768, "t32x4") == 128
    fam = get_family("split")
    big = workload_for(V3, 8, 64, 4096)
    assert not [c for c in fam.space(big, [64]) if c.params.get("pipe", "").endswith("-pdl")]


def test_candidates_parse_and_bad_knobs_are_refused():
    c = check_candidate(Candidate.parse("split/triton/p64/num_splits=128,partial=bfloat16"))
    assert c.params == {"num_splits": 128, "partial": "bfloat16"}
    c = check_candidate(Candidate.parse("split/triton/p64/num_splits=32,partial=bfloat16,pipe=t32x4-pdl"))
    assert c.params == {"num_splits": 32, "partial": "bfloat16", "pipe": "t32x4-pdl"}
    with pytest.raises(ValueError, match="pipe must be one of t64, t32x4"):
        check_candidate(Candidate.parse("split/triton/p64/num_splits=8,partial=bfloat16,pipe=t16"))
    with pytest.raises(ValueError, match="num_splits=N,partial"):
        check_candidate(Candidate.parse("split/triton/p64/num_splits=8,partial=bfloat16,stages=3"))
    for bad, why in (("split/fa3/p64/num_splits=8,partial=bfloat16", "backend"),
                     ("split/triton/p64/num_splits=8", "num_splits=N,partial"),
                     ("split/triton/p64/num_splits=0,partial=bfloat16", "num_splits"),
                     ("split/triton/p64/num_splits=5000,partial=bfloat16", "num_splits"),
                     ("split/triton/p64/num_splits=8,partial=fp8", "partial")):
        with pytest.raises(ValueError, match=why):
            check_candidate(Candidate.parse(bad))


def test_the_tuned_config_takes_split_params_and_refuses_anything_else(tmp_path):
    where = "bucket"
    assert tc.check_params("split", dict(SPLIT), where) == SPLIT
    for bad, why in (({**SPLIT, "backend": "fa3"}, "backend must be 'triton'"),
                     ({**SPLIT, "num_splits": 0}, "num_splits"),
                     ({**SPLIT, "num_splits": True}, "num_splits"),
                     ({**SPLIT, "partial": "float16"}, "partial must be one of"),
                     ({**SPLIT, "block_n": 32}, "unknown parameter"),
                     ({**SPLIT, "pipe": "t128"}, "pipe must be one of"),
                     ({**SPLIT, "pipe": None}, "pipe must be one of")):
        with pytest.raises(tc.TunedConfigError, match=why):
            tc.check_params("split", bad, where)
    assert tc.check_params("split", {**SPLIT, "pipe": "t32x4"}, where)["pipe"] == "t32x4"
    dims = tc.ModelDims(16, 512, 64, "bfloat16", "bfloat16")
    piped = {**SPLIT, "num_splits": 32, "pipe": "t32x4"}
    entry = tc.ModelEntry(dims, 64, ["FLASHINFER_MLA", "TRITON_MLA"],
                          [_bucket(1, 4096, 20.0, 30.0), _bucket(1, 8192, 20.0, 30.0, params=piped)])
    path = tc.write_tuned_config(tc.TunedConfig("Test GPU", {}, [entry]), tmp_path)
    back = tc.read_tuned_config(path).models[0].buckets
    # a config without `pipe` (every one written before the knob) serves the measured pipe t64
    assert back[0].best_family == "split" and decisions.bucket_choice(back[0], "split") == \
        choices.SplitChoice(16, "bfloat16") == choices.SplitChoice(16, "bfloat16", "t64")
    assert decisions.bucket_choice(back[1], "split") == choices.SplitChoice(32, "bfloat16", "t32x4")
    # what emit writes back: the served pipe is left out, any other named
    assert choices.SplitChoice(16, "bfloat16").to_params() == SPLIT
    assert choices.SplitChoice(32, "bfloat16", "t32x4").to_params() == piped
    assert choices.family_choice("split", {**SPLIT, "pipe": "t8"}) is None


def test_served_kernel_validates_its_knobs():
    with pytest.raises(ValueError, match="partial"):
        op.served(8, "float16", 16, 64, 4, "cpu")
    with pytest.raises(ValueError, match="num_splits"):
        op.served(0, "bfloat16", 16, 64, 4, "cpu")
    k = op.served(8, "bfloat16", 16, 64, 1000, "cpu", workspace=op.allocate_workspace(
        op.served_rows(16), 16, 512, torch.bfloat16, "cpu"))
    assert k.max_batch == op.MAX_PROGRAMS // 8 and k.merge == "kernel" and k.merge_block_d == 64
    with pytest.raises(ValueError, match="does not fit"):
        op.SplitDecode(16, 64, 4, 8, workspace=op.allocate_workspace(32, 16, 512, torch.float32, "cpu"),
                       partial_dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="pipe must be one of"):
        op.served(8, "bfloat16", 16, 64, 4, "cpu", pipe="t16")
    # t32x4: the TMA kernel (the interpreter's, on a CPU tensor) with 64 head rows and 32 pages'
    # ids loaded ahead; its workspace holds the 16 real heads, not the padded 64
    k = op.served(8, "float32", 16, 64, 4, "cpu", pipe="t32x4")
    assert (k.load, k.block_n, k.num_stages, k.group_pages, k.block_h, k.transposed) == \
        ("tma", 32, 4, 32, 64, False)
    assert k.ws_acc.shape[1:] == (16, 512) and k.padded_heads == 64
    k = op.served(8, "float32", 16, 64, op.served_rows(16, "t32x4"), "cpu", pipe="t32x4",
                  workspace=op.served_workspace(16, 512, "float32", "cpu", "t32x4"))
    assert k.max_batch == op.MAX_PROGRAMS // 8
    # no pointer-kernel form: a page below the tile, or no TMA (MetaX), refuses it
    with pytest.raises(ValueError, match="TMA kernel only"):
        op.served(8, "float32", 16, 16, 4, "cpu", pipe="t32x4")
    with pytest.raises(ValueError, match="pdl"):                # PDL: Hopper's, not the interpreter's
        op.served(8, "float32", 16, 64, 4, "cpu", pipe="t64-pdl")


# ---------------------------------------------------------------- when the plugin serves it

def test_split_serves_only_a_measured_win_of_at_least_the_choice_ratio():
    assert decisions.split_serves(_bucket(1, 4096, 20.0, 30.0)) == choices.SplitChoice(16, "bfloat16")
    assert decisions.split_serves(_bucket(1, 4096, 20.0, 20.0 * 1.049)) is None     # within noise
    assert decisions.split_serves(_bucket(1, 4096, 20.0, 21.0)) is not None         # 1.05x
    assert decisions.split_serves(_bucket(1, 4096, 20.0, 30.0, best="flashinfer")) is None
    assert decisions.split_serves(_bucket(1, 4096, 20.0, None)) is None
    assert decisions.split_serves(_bucket(1, 4096, 20.0, 30.0, params={**SPLIT, "partial": "x"})) is None
    assert decisions.split_serves(None) is None


def _plan_choice(buckets):
    from vllm_metax.backend.plan_choice import PlanChoice
    entry = tc.ModelEntry(tc.ModelDims(16, 512, 64, "bfloat16", "bfloat16"), 64,
                          ["FLASHINFER_MLA", "TRITON_MLA"], buckets)
    return PlanChoice(entry, decisions.FlashInferBackends(("fa3", "fa2"), "fa3"))


@pytest.mark.vllm
def test_plan_choice_per_step_and_per_graph():
    s64 = {**SPLIT, "num_splits": 64}
    choice = _plan_choice([
        _bucket(1, 1024, 13.0, 18.0), _bucket(1, 8192, 19.0, 26.0), _bucket(1, 32768, 32.0, 42.0, params=s64),
        _bucket(8, 1024, 18.0, 18.4), _bucket(8, 8192, 40.0, 39.0, best="flashinfer"),
        _bucket(8, 32768, 130.0, 91.0, best="flashinfer"),
    ])
    assert choice.split_for(1, 1000) == choices.SplitChoice(16, "bfloat16")
    assert choice.split_for(1, 30000) == choices.SplitChoice(64, "bfloat16")
    assert choice.split_for(8, 1024) is None                    # 1.02x: FlashInfer keeps it
    assert choice.split_for(1, 1000, q_len=2) is None
    # a graph of batch 1: split serves 3/3 buckets; the knobs most name (16, 2 of 3)
    assert choice.split_for(1, 5, graph=True) == choices.SplitChoice(16, "bfloat16")
    assert choice.split_for(8, 1024, graph=True) is None         # 0 of 3
    assert choice.split_for(2, 1024, graph=True) == choices.SplitChoice(16, "bfloat16")   # nearest: 1
    choice.turn_off(choices.SPLIT, "test")
    assert choice.split_for(1, 1000) is None and choice.split_for(1, 5, graph=True) is None
    assert choice.split_choices() == []


@pytest.mark.vllm
def test_split_choices_lists_each_served_knob_set_once():
    s64 = {**SPLIT, "num_splits": 64}
    choice = _plan_choice([_bucket(1, 1024, 13.0, 18.0), _bucket(1, 8192, 13.0, 18.0),
                           _bucket(1, 32768, 32.0, 42.0, params=s64), _bucket(2, 32768, 32.0, 33.0, params=s64)])
    assert choice.split_choices() == [choices.SplitChoice(16, "bfloat16"), choices.SplitChoice(64, "bfloat16")]


@pytest.mark.vllm
def test_graph_vote_ties_take_the_longest_contexts_knobs():
    s64 = {**SPLIT, "num_splits": 64}
    choice = _plan_choice([_bucket(1, 1024, 13.0, 18.0), _bucket(1, 32768, 32.0, 42.0, params=s64)])
    assert choice.split_for(1, 1, graph=True) == choices.SplitChoice(64, "bfloat16")
    choice = _plan_choice([_bucket(1, 1024, 13.0, 18.0), _bucket(1, 32768, 32.0, 30.0, best="flashinfer")])
    assert choice.split_for(1, 1, graph=True) is None            # 1 of 2 is not most


# ---------------------------------------------------------------- through vLLM's builder and impl

def _split_builder(monkeypatch, tmp_path, params):
    """FLASHINFER_MLA's builder (FlashInfer replaced by the recording double of
    tests/test_plugin_backend.py) with a tuned config whose B1-B4 buckets name split (`params`)."""
    import plugin_support as ps
    from vllm_metax.core.device import DeviceInfo

    h200 = DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0))
    fb = ps.install_recording_plugin(monkeypatch, h200)
    dims = tc.ModelDims(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM, "bfloat16", "bfloat16")
    buckets = [_bucket(b, c, 10.0, 20.0, params=params) for b in (1, 4) for c in (64, 512)]
    buckets.append(_bucket(16, 512, 30.0, 20.0, best="flashinfer"))
    entry = tc.ModelEntry(dims, 16, ["FLASHINFER_MLA", "TRITON_MLA"], buckets)
    tc.write_tuned_config(tc.TunedConfig(h200.name, {"test": True}, [entry]), tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()
    return fb, ps, ps.make_vllm_config(tmp_path / "model", block_size=16)


@pytest.fixture
def split_builder(monkeypatch, tmp_path):
    yield _split_builder(monkeypatch, tmp_path, {**SPLIT, "num_splits": 4})
    tc.clear_cache()


def _decode(ps, builder, seq_lens, seed=0):
    bt, lens, common, num_pages = ps.ragged_batch(seq_lens, 16, 1, extra_rows=2, seed=seed)
    n = len(seq_lens)
    md = builder._build_decode(
        block_table_tensor=bt[:n], seq_lens_device=lens, max_seq_len=max(seq_lens),
        query_start_loc_cpu=common.query_start_loc_cpu, query_start_loc_device=common.query_start_loc,
        num_decode_tokens=n, max_query_len=1, dcp_tot_seq_lens_device=None)
    return md, bt, lens, num_pages


@pytest.mark.vllm
def test_a_tuned_split_bucket_is_served_with_the_steps_block_table_and_scale(split_builder, monkeypatch):
    from mla_tune.problem.reference import mla_decode_reference, relative_error
    fb, ps, vc = split_builder
    calls = []

    def reference_run(self, q_nope, q_pe, ckv, kpe, block_table, seq_lens, scale, out):
        calls.append((self.num_splits, self.ws_acc.dtype, block_table, seq_lens, scale))
        out.copy_(mla_decode_reference(q_nope, q_pe, ckv, kpe, block_table, seq_lens.cpu(), scale))
        return out

    monkeypatch.setattr(op.SplitDecode, "run", reference_run)
    checked = []
    monkeypatch.setattr(op, "self_check", lambda kernel, dtype, device: checked.append(kernel.num_splits))
    builder = ps.make_builder(vc)
    assert checked == [4] and builder.choice.split_enabled      # made and checked up front
    impl = ps.make_impl(vc)
    md, bt, lens, num_pages = _decode(ps, builder, [5, 300, 77])
    assert md.backend == choices.SPLIT and md.paged is None and not ps.RecordingKernel.instances
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, ps.NUM_HEADS, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(num_pages, 16, 576, generator=g).to(torch.bfloat16)
    out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), kv, SimpleNamespace(decode=md), None)
    (n_splits, ws_dtype, bt_seen, lens_seen, scale), = calls
    assert (n_splits, ws_dtype) == (4, torch.bfloat16) and lse is None
    assert bt_seen.data_ptr() == bt.data_ptr() and bt_seen.shape[0] == 3 and lens_seen.tolist() == [5, 300, 77]
    assert scale == pytest.approx(ps.softmax_scale())
    ref = mla_decode_reference(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], bt, lens,
                               ps.softmax_scale())
    assert relative_error(out, ref) < 1e-2
    # the bucket FlashInfer wins plans FlashInfer; the split kernel and its workspace are made once
    md16, *_ = _decode(ps, builder, [500] * 16)
    assert md16.backend == "fa3" and ps.RecordingKernel.instances
    assert len(builder._split_kernels) == 1 and len(builder._split_workspaces) == 1


@pytest.mark.vllm
def test_a_split_kernel_that_fails_its_check_falls_back_to_flashinfer_once(split_builder, caplog):
    fb, ps, vc = split_builder           # the real kernel on a CPU tensor without the interpreter
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_metax.backend.plan_choice"):
        builder = ps.make_builder(vc)        # checked when the builder is made, before any graph
        assert not builder.choice.split_enabled
        md, *_ = _decode(ps, builder, [5, 300, 77])
        md2, *_ = _decode(ps, builder, [50, 30], seed=1)
    assert md.backend == "fa3" and md2.backend == "fa3"
    warnings = [r for r in caplog.records if "split-KV decode kernel cannot run" in r.getMessage()]
    assert len(warnings) == 1 and "num_splits=4" in warnings[0].getMessage()
    assert not builder.choice.split_enabled


@pytest.mark.vllm
def test_a_tuned_pipe_this_server_cannot_run_falls_back_to_flashinfer_with_one_warning(monkeypatch, tmp_path,
                                                                                    caplog):
    # t32x4 tiles are 32 tokens of one page: a server of 16-token blocks has no such kernel
    fb, ps, vc = _split_builder(monkeypatch, tmp_path, {**SPLIT, "num_splits": 4, "pipe": "t32x4"})
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.vllm_metax.backend.plan_choice"):
            builder = ps.make_builder(vc)
            md, *_ = _decode(ps, builder, [5, 300, 77])
        assert md.backend == "fa3" and not builder.choice.split_enabled
        warnings = [r.getMessage() for r in caplog.records if "split-KV decode kernel cannot run" in r.getMessage()]
        assert len(warnings) == 1 and "pipe=t32x4" in warnings[0] and "TMA kernel only" in warnings[0]
    finally:
        tc.clear_cache()


@pytest.mark.vllm
def test_the_tuned_pipe_reaches_the_served_kernel_and_its_workspace(monkeypatch, tmp_path):
    fb, ps, vc = _split_builder(monkeypatch, tmp_path, {**SPLIT, "num_splits": 4, "pipe": "t32x4"})
    made = []
    real = op.served

    def served(*a, **kw):
        made.append((kw["pipe"], kw["workspace"][0].shape))
        return real(*a[:3], 64, *a[4:], **kw)       # a 64-token page: what t32x4 needs
    monkeypatch.setattr(op, "served", served)
    monkeypatch.setattr(op, "self_check", lambda kernel, dtype, device: None)
    try:
        builder = ps.make_builder(vc)
        assert builder.choice.split_enabled and len(builder._split_kernels) == 1
        (kernel,) = builder._split_kernels.values()
        assert (kernel.block_n, kernel.num_stages, kernel.group_pages) == (32, 4, 32)
        assert made == [("t32x4", (op.served_rows(ps.NUM_HEADS, "t32x4"), ps.NUM_HEADS, ps.KV_LORA_RANK))]
    finally:
        tc.clear_cache()


def test_the_self_check_reports_a_wrong_result_or_a_failure_and_never_raises():
    k = op.served(8, "float32", 16, 16, 64, "cpu")

    def zeros(q_nope, q_pe, ckv, kpe, bt, lens, scale, out):
        return out.zero_()

    def raises(*a):
        raise RuntimeError("PTX assembly failed\nmore")
    k.run = zeros
    assert "wrong result" in op.self_check(k, torch.float16, "cpu")
    k.run = raises
    assert op.self_check(k, torch.float16, "cpu") == "RuntimeError: PTX assembly failed"
