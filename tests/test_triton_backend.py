"""The plugin's TRITON_MLA subclass: num_kv_splits per decode batch from the tuned config, vLLM's
rule on a miss. Runs vLLM's own forward_mqa with the kernel replaced by a recorder."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_metax.core import tuned_config as tc

pytestmark = pytest.mark.vllm

DEVICE = "Test GPU 9000"
DIMS = tc.ModelDims(16, 512, 64, "bfloat16", "bfloat16")
# (batch, context) -> tuned num_kv_splits; vLLM's rule would give 2 / 8 / 64 for these contexts
TUNED = {(1, 1024): 32, (1, 4096): 64, (64, 1024): 4, (64, 32768): 128}


@pytest.fixture(scope="module")
def tm():
    import vllm_metax.backend.triton_mla as tm
    return tm


@pytest.fixture
def real_triton(monkeypatch):
    """vLLM's rule calls triton.next_power_of_2; on a GPU-less host vllm holds a placeholder."""
    import triton

    import vllm.v1.attention.backends.mla.triton_mla as vtm
    monkeypatch.setattr(vtm, "triton", triton)


def _config(tmp_path, monkeypatch, tuned=TUNED, dims=DIMS, family="triton"):
    buckets = [tc.Bucket(b, c, 1, {family: tc.FamilyChoice({"num_kv_splits": n} if family == "triton"
                                                            else {"backend": "fa3"})})
               for (b, c), n in tuned.items()]
    cfg = tc.TunedConfig(DEVICE, {"test": True},
                         [tc.ModelEntry(dims, 64, ["TRITON_MLA", "FLASHINFER_MLA"], buckets)])
    tc.write_tuned_config(cfg, tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()


@pytest.fixture(autouse=True)
def _fresh_cache():
    tc.clear_cache()
    yield
    tc.clear_cache()


def test_backend_class_is_vllms_triton_mla_with_our_builder_and_impl(tm):
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    assert issubclass(tm.MetaxTritonMLABackend, TritonMLABackend)
    assert tm.MetaxTritonMLABackend.get_name() == "TRITON_MLA"
    assert tm.MetaxTritonMLABackend.get_impl_cls() is tm.MetaxTritonMLAImpl
    assert tm.MetaxTritonMLABackend.get_builder_cls() is tm.MetaxTritonMLAMetadataBuilder
    assert tm.MetaxTritonMLABackend.supports_block_size(64)
    assert not tm.MetaxTritonMLABackend.supports_block_size(8)


def test_tuned_splits_exact_and_snapped(tm, tmp_path, monkeypatch):
    _config(tmp_path, monkeypatch)
    ts = tm.TunedSplits.load(DIMS, DEVICE)
    assert ts.max_splits == 128
    assert ts.choose(1, 1024) == 32
    assert ts.choose(1, 4096) == 64
    assert ts.choose(64, 32768) == 128
    assert ts.choose(2, 1100) == 32            # nearest bucket (1, 1024)
    assert ts.choose(50, 1024) == 4            # nearest batch 64
    assert ts.choose(64, 20000) == 128         # 20000 -> 32768 on the log2 scale, within 2x


def test_tuned_splits_miss_keeps_vllms_rule(tm, tmp_path, monkeypatch):
    _config(tmp_path, monkeypatch)
    ts = tm.TunedSplits.load(DIMS, DEVICE)
    assert ts.choose(1, 300) is None           # > 2x below the shortest tuned context
    assert ts.choose(64, 100_000) is None      # > 2x above the longest
    other = tm.TunedSplits.load(tc.ModelDims(128, 512, 64, "bfloat16", "bfloat16"), DEVICE)
    assert other.max_splits is None and other.choose(1, 1024) is None
    assert "no entry" in other.why
    fp8 = tm.TunedSplits.load(tc.ModelDims(16, 512, 64, "bfloat16", "float8_e4m3fn"), DEVICE)
    assert fp8.choose(1, 1024) is None
    nocfg = tm.TunedSplits.load(DIMS, "Some Other GPU")
    assert nocfg.choose(1, 1024) is None and "no tuned config" in nocfg.why


def test_a_bucket_that_kept_vllms_rule_is_served_with_vllms_rule(tm, tmp_path, monkeypatch):
    # what emit writes where vLLM's rule stayed: the count the rule gave at the bucket's length
    buckets = [tc.Bucket(1, 1024, 1, {"triton": tc.FamilyChoice({"backend": "triton", "num_kv_splits": 32})}),
               tc.Bucket(1, 4096, 1, {"triton": tc.FamilyChoice(
                   {"backend": "triton", "num_kv_splits": 256, "rule": "vllm"})})]
    cfg = tc.TunedConfig(DEVICE, {"test": True}, [tc.ModelEntry(DIMS, 64, ["TRITON_MLA"], buckets)])
    tc.write_tuned_config(cfg, tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    ts = tm.TunedSplits.load(DIMS, DEVICE)
    assert ts.choose(1, 1024) == 32
    assert ts.choose(1, 4096) is None and ts.choose(1, 6000) is None     # not a frozen 256
    assert ts.max_splits == 32                  # the rule's counts need no extra workspace


def test_only_rule_buckets_is_vllms_rule_everywhere(tm, tmp_path, monkeypatch):
    buckets = [tc.Bucket(1, 1024, 1, {"triton": tc.FamilyChoice({"num_kv_splits": 2, "rule": "vllm"})})]
    tc.write_tuned_config(tc.TunedConfig(DEVICE, {}, [tc.ModelEntry(DIMS, 64, ["TRITON_MLA"], buckets)]),
                          tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    ts = tm.TunedSplits.load(DIMS, DEVICE)
    assert ts.max_splits is None and ts.choose(1, 1024) is None
    assert "vLLM's rule" in ts.why


def test_entry_without_triton_choices_is_a_miss(tm, tmp_path, monkeypatch):
    _config(tmp_path, monkeypatch, family="flashinfer")
    ts = tm.TunedSplits.load(DIMS, DEVICE)
    assert ts.max_splits is None and ts.choose(1, 1024) is None
    assert "no Triton choices" in ts.why


def test_builder_records_tuned_splits_in_decode_metadata(tm, tmp_path, monkeypatch):
    _config(tmp_path, monkeypatch)
    builder = object.__new__(tm.MetaxTritonMLAMetadataBuilder)
    builder.tuned_splits = tm.TunedSplits.load(DIMS, DEVICE)

    def build(batch, max_seq_len, q_len=1):
        return builder._build_decode(
            block_table_tensor=torch.zeros(batch, 4, dtype=torch.int32),
            seq_lens_device=torch.full((batch,), max_seq_len, dtype=torch.int32),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32),
            query_start_loc_device=torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32),
            num_decode_tokens=batch * q_len, max_query_len=q_len, dcp_tot_seq_lens_device=None)

    md = build(1, 4096)
    assert isinstance(md, tm.MetaxTritonMLADecodeMetadata)
    assert md.num_kv_splits == 64
    assert md.block_table.shape == (1, 4) and md.dcp_tot_seq_lens is None
    assert build(64, 1024).num_kv_splits == 4
    assert build(1, 200).num_kv_splits is None


def _forward(tm, monkeypatch, splits, max_seq_len, batch=2, heads=16, q_len=1):
    """Run MetaxTritonMLAImpl.forward_mqa (vLLM's body) with the kernel replaced by a recorder."""
    import vllm.v1.attention.backends.mla.triton_mla as vtm
    seen = {}

    def fake_kernel(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits,
                    num_kv_splits, sm_scale, page_size, **kw):
        seen.update(num_kv_splits=num_kv_splits, logits_shape=tuple(attn_logits.shape),
                    page_size=page_size, rows=q.shape[0], seq_lens=b_seq_len.tolist())

    monkeypatch.setattr(vtm, "decode_attention_fwd", fake_kernel)
    impl = object.__new__(tm.MetaxTritonMLAImpl)
    impl.kv_lora_rank, impl._sm_count, impl.scale, impl.dcp_world_size = 512, 132, 0.07, 1
    decode = tm.MetaxTritonMLADecodeMetadata(
        block_table=torch.zeros(batch, 8, dtype=torch.int32),
        seq_lens=torch.full((batch,), max_seq_len, dtype=torch.int32),
        dcp_tot_seq_lens=None, num_kv_splits=splits)
    md = SimpleNamespace(decode=decode, max_seq_len=max_seq_len, causal=True)
    q = torch.zeros(batch * q_len, heads, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    layer = SimpleNamespace(_k_scale=torch.ones(()))
    o, lse = impl.forward_mqa(q, kv, md, layer)
    assert o.shape == (batch * q_len, heads, 512)
    return seen


def test_forward_uses_the_tuned_split_count(tm, monkeypatch):
    seen = _forward(tm, monkeypatch, splits=32, max_seq_len=1024)
    assert seen["num_kv_splits"] == 32
    assert seen["logits_shape"] == (2, 16, 32, 513)
    assert seen["page_size"] == 64


def test_forward_without_a_tuned_value_uses_vllms_rule(tm, monkeypatch, real_triton):
    seen = _forward(tm, monkeypatch, splits=None, max_seq_len=4096)
    assert seen["num_kv_splits"] == 8                      # next_power_of_2(4096 // 512)
    assert seen["logits_shape"][2] == 8


def test_tuned_value_does_not_leak_past_the_call(tm, monkeypatch, real_triton):
    import vllm.v1.attention.backends.mla.triton_mla as vtm
    _forward(tm, monkeypatch, splits=32, max_seq_len=1024)
    assert vtm._compute_num_kv_splits(1024, 132) == 2      # vLLM's rule again for everyone else
    assert tm.vllm_num_kv_splits(32768, 132) == 64
    assert tm.vllm_num_kv_splits(32768, 8) == 16           # the SM cap


def test_forward_q_len_2_keeps_vllms_causal_rows(tm, monkeypatch):
    seen = _forward(tm, monkeypatch, splits=4, max_seq_len=100, batch=2, q_len=2)
    assert seen["num_kv_splits"] == 4 and seen["rows"] == 4
    assert seen["seq_lens"] == [99, 100, 99, 100]


def test_batch_invariant_mode_still_forces_one_split(tm, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    seen = _forward(tm, monkeypatch, splits=32, max_seq_len=1024)
    assert seen["num_kv_splits"] == 1


def test_workspace_reserved_for_the_largest_tuned_split_count(tm, monkeypatch):
    asked = []
    monkeypatch.setattr(tm, "is_workspace_manager_initialized", lambda: True)
    monkeypatch.setattr(tm, "current_workspace_manager",
                        lambda: SimpleNamespace(get_simultaneous=lambda *s: asked.append(s)))
    tm.reserve_tuned_workspace(256, 16, 512, 128)
    assert asked == [(((256, 16, 128, 513), torch.float32),)]
    tm.reserve_tuned_workspace(256, 16, 512, None)         # nothing tuned: vLLM's own reservation
    assert len(asked) == 1


def test_dtype_names(tm):
    assert tm.dtype_name(torch.bfloat16) == "bfloat16"
    assert tm.dtype_name("auto", torch.float16) == "float16"
    assert tm.dtype_name("bfloat16") == "bfloat16"


def test_a_recording_builder_counts_every_steps_lookup_key(tm, tmp_path, monkeypatch):
    """VLLM_METAX_TRAFFIC: the step's (batch, mean length, q_len) is counted, also where no tuned
    split count needs the lengths (untuned: vLLM's rule)."""
    from vllm_metax.core import traffic as rec
    builder = object.__new__(tm.MetaxTritonMLAMetadataBuilder)
    builder.tuned_splits = tm.TunedSplits(None, "untuned")
    builder.traffic = rec.TrafficRecorder(str(tmp_path / "t.db"), DIMS, flush_seconds=0)
    for batch, length, q_len in ((4, 3000, 1), (4, 3000, 1), (32, 9000, 2)):
        md = builder._build_decode(
            block_table_tensor=torch.zeros(batch, 4, dtype=torch.int32),
            seq_lens_device=torch.full((batch,), length, dtype=torch.int32), max_seq_len=length,
            query_start_loc_cpu=torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32),
            query_start_loc_device=torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32),
            num_decode_tokens=batch * q_len, max_query_len=q_len, dcp_tot_seq_lens_device=None)
        assert md.num_kv_splits is None
    assert builder.traffic.decode_counts == {(4, 1, rec.fine_bin(3000)): 2, (32, 2, rec.fine_bin(9000)): 1}
    builder.traffic.close()
