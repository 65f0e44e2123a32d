"""The plugin's FLASHINFER_MLA metadata builder and impl with the real vllm==0.33.0 on the CPU.

FlashInfer's wrapper is replaced by `plugin_support.RecordingKernel`, which records every plan and
computes MLA with the torch reference from exactly the CSR metadata it was planned with, so a wrong
block-table hand-off, a wrong dimension or a wrong scale shows up as a wrong result."""

from __future__ import annotations

import math
import timeit
from types import SimpleNamespace

import pytest
import torch

import plugin_support as ps
from mla_tune.problem.reference import mla_decode_reference, relative_error
from vllm_metax.core import tuned_config as tc
from vllm_metax.core.device import DeviceInfo

pytestmark = pytest.mark.vllm

PAGE = 16
H200 = DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0))
METAX = DeviceInfo("MetaX C500", "pymxsml", True, 104, (8, 0))
DIMS = tc.ModelDims(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM, "bfloat16", "bfloat16")


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("model")


@pytest.fixture(scope="module")
def base_config(model_root):
    return ps.make_vllm_config(model_root, block_size=PAGE)


@pytest.fixture
def fb(monkeypatch):
    """The backend module with the recording kernel and a pretend Hopper GPU."""
    fb = ps.install_recording_plugin(monkeypatch, H200)
    monkeypatch.delenv(tc.FOLDER_ENV, raising=False)
    tc.clear_cache()
    yield fb
    tc.clear_cache()


def _config(base_config, block_size=PAGE, cudagraph=False, spec_tokens=0):
    from vllm.config import CacheConfig, CompilationConfig, SpeculativeConfig, VllmConfig

    kw = {}
    if spec_tokens:
        kw["speculative_config"] = SpeculativeConfig(method="ngram", num_speculative_tokens=spec_tokens)
    mode = "FULL_AND_PIECEWISE" if cudagraph else "PIECEWISE"
    return VllmConfig(model_config=base_config.model_config,
                      cache_config=CacheConfig(block_size=block_size),
                      compilation_config=CompilationConfig(cudagraph_mode=mode,
                                                           cudagraph_capture_sizes=[1, 2, 4, 8]),
                      **kw)


def _tuned(tmp_path, monkeypatch, choices, device=H200.name):
    """choices: (batch, context, q_len) -> FlashInfer backend value, or its params dict."""
    buckets = [tc.Bucket(b, c, q, {"flashinfer": tc.FamilyChoice(v if isinstance(v, dict) else {"backend": v})})
               for (b, c, q), v in choices.items()]
    entry = tc.ModelEntry(DIMS, PAGE, ["FLASHINFER_MLA", "TRITON_MLA"], buckets)
    tc.write_tuned_config(tc.TunedConfig(device, {"test": True}, [entry]), tmp_path)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()


def _decode(builder, seq_lens, q_len=1, extra_rows=3, seed=0):
    """Call _build_decode with the arguments vLLM's MLA build() passes for a decode batch."""
    return ps.build_decode(builder, seq_lens, PAGE, q_len, extra_rows, seed)


def _qkv(rows, num_pages, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, ps.NUM_HEADS, ps.NOPE_DIM + ps.ROPE_DIM + ps.KV_LORA_RANK, generator=g)
    kv = torch.randn(num_pages, PAGE, ps.KV_LORA_RANK + ps.ROPE_DIM, generator=g)
    return q.to(torch.bfloat16), kv.to(torch.bfloat16)


def _forward(impl, md, q_nope, q_pe, kv):
    """forward_mqa as vLLM's MLAAttention calls it: (ql_nope, q_pe) with q_pe a strided view."""
    return impl.forward_mqa((q_nope, q_pe), kv, SimpleNamespace(decode=md), None)


# ---------------------------------------------------------------- _build_decode

def test_build_decode_plans_the_reference_page_table(fb, base_config):
    builder = ps.make_builder(_config(base_config))
    seq_lens = [5, 33, 17, 64, 1]
    md, bt, lens, _ = _decode(builder, seq_lens)

    assert isinstance(md, fb.FlashInferMLADecodeMetadata) and md.kernel is not None
    (kernel,) = ps.RecordingKernel.instances
    (plan,) = kernel.plans
    meta = plan["meta"]
    pages = [-(-s // PAGE) for s in seq_lens]
    assert meta.qo_indptr.tolist() == list(range(len(seq_lens) + 1))
    assert meta.kv_len.tolist() == seq_lens
    # eager steps hand over the block table itself (strided: request b starts at b * width)
    assert not meta.compact and meta.kv_indices.data_ptr() == bt.data_ptr()
    for b, n in enumerate(pages):     # each request reads exactly its block-table row, in order
        start = int(meta.kv_indptr[b])
        assert meta.kv_indices[start:start + n].tolist() == bt[b, :n].tolist()
    assert 7 not in meta.kv_indices.tolist()          # rows past the batch are never read
    compact = meta.compacted()                        # what FlashInfer's public plan() gets
    assert compact.kv_indptr.tolist() == [sum(pages[:i]) for i in range(len(pages) + 1)]
    for b, n in enumerate(pages):
        assert compact.kv_indices[compact.kv_indptr[b]:compact.kv_indptr[b + 1]].tolist() == bt[b, :n].tolist()
    # the dims and scale FlashInfer is planned with
    assert plan["num_heads"] == ps.NUM_HEADS
    assert plan["head_dim_ckv"] == ps.KV_LORA_RANK   # not num_kv_heads (1)
    assert plan["head_dim_kpe"] == ps.ROPE_DIM
    assert plan["sm_scale"] == pytest.approx(ps.softmax_scale()) and plan["sm_scale"] != 1.0
    assert plan["sm_scale"] != pytest.approx(576 ** -0.5)
    assert plan["page_size"] == PAGE and plan["causal"] is False
    assert plan["q_dtype"] == torch.bfloat16 and plan["kv_dtype"] == torch.bfloat16
    assert (md.num_rows, md.q_len, md.page_size) == (5, 1, PAGE)


def test_build_returns_planned_metadata_for_a_mixed_batch(fb, base_config, monkeypatch):
    """vLLM's build(): decodes first, then a prefill; only the decodes are planned (int count)."""
    import vllm.model_executor.layers.attention.mla_attention as mla
    import vllm.utils.torch_utils as tu
    from vllm.v1.attention.backend import CommonAttentionMetadata

    for mod in (mla, tu):                              # no pinned memory without a GPU
        monkeypatch.setattr(mod, "PIN_MEMORY", False)

    builder = ps.make_builder(_config(base_config))
    seq_lens, q_lens = [40, 7, 90], [1, 1, 30]
    bt, _, _, _ = ps.ragged_batch(seq_lens, PAGE, extra_rows=2)
    qsl = torch.tensor([0, 1, 2, 32], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=lens, num_reqs=3,
        num_actual_tokens=32, max_query_len=30, max_seq_len=90, block_table_tensor=bt[:3],
        slot_mapping=torch.zeros(32, dtype=torch.int64), seq_lens_cpu_upper_bound=lens.clone())
    md = builder.build(0, common)
    assert md is not None and (md.num_decodes, md.num_prefills) == (2, 1)
    plan = ps.RecordingKernel.instances[0].plans[-1]
    assert plan["meta"].kv_len.tolist() == [40, 7]
    assert md.decode.num_rows == 2 and md.prefill is not None


def test_build_uses_host_lengths_without_a_device_copy(fb, base_config, monkeypatch):
    builder = ps.make_builder(_config(base_config))
    _, lens, common, _ = ps.ragged_batch([9, 20], PAGE)
    device_lens = common.seq_lens.clone()

    class NoCopy(torch.Tensor):
        def to(self, *a, **k):
            raise AssertionError("seq_lens copied from the device")
    common.seq_lens = device_lens.as_subclass(NoCopy)
    md = builder.build(0, common)
    assert md.decode.paged.kv_len.tolist() == [9, 20]


def test_forward_matches_the_reference(fb, base_config):
    builder = ps.make_builder(_config(base_config))
    impl = ps.make_impl(_config(base_config))
    seq_lens = [5, 33, 17, 64, 1, 100]
    md, bt, lens, num_pages = _decode(builder, seq_lens)
    q, kv = _qkv(len(seq_lens), num_pages)
    q_nope, q_pe = q[..., ps.NOPE_DIM + ps.ROPE_DIM:], q[..., ps.NOPE_DIM:ps.NOPE_DIM + ps.ROPE_DIM]
    assert not q_pe.is_contiguous()
    out, lse = _forward(impl, md, q_nope, q_pe, kv)
    ref = mla_decode_reference(q_nope, q_pe, kv[..., :512], kv[..., 512:], bt, lens, ps.softmax_scale())
    assert lse is None and out.shape == (6, ps.NUM_HEADS, ps.KV_LORA_RANK)
    assert relative_error(out, ref) < 1e-2


def test_single_tensor_q_is_split(fb, base_config):
    builder = ps.make_builder(_config(base_config))
    impl = ps.make_impl(_config(base_config))
    md, bt, lens, num_pages = _decode(builder, [20, 3])
    q, kv = _qkv(2, num_pages)
    packed = q[..., :576].contiguous()                  # [T, H, kv_lora_rank + rope]
    out, _ = impl.forward_mqa(packed, kv, SimpleNamespace(decode=md), None)
    ref = mla_decode_reference(packed[..., :512], packed[..., 512:], kv[..., :512], kv[..., 512:],
                               bt, lens, ps.softmax_scale())
    assert relative_error(out, ref) < 1e-2
    run = ps.RecordingKernel.instances[0].runs[-1]
    assert run["q_nope"].shape[-1] == 512 and run["q_pe"].shape[-1] == 64


def test_uniform_multi_token_decode_is_causal(fb, base_config):
    vc = _config(base_config, spec_tokens=2)
    builder = ps.make_builder(vc)
    assert builder.reorder_batch_threshold == 3
    impl = ps.make_impl(vc)
    seq_lens = [10, 40, 3]
    md, bt, lens, num_pages = _decode(builder, seq_lens, q_len=3)
    plan = ps.RecordingKernel.instances[0].plans[-1]
    assert plan["causal"] is True and plan["meta"].qo_indptr.tolist() == [0, 3, 6, 9]
    q, kv = _qkv(9, num_pages)
    out, _ = _forward(impl, md, q[..., 192:], q[..., 128:192], kv)
    ref = mla_decode_reference(q[..., 192:], q[..., 128:192], kv[..., :512], kv[..., 512:], bt,
                               lens, ps.softmax_scale(), q_len=3)
    assert relative_error(out, ref) < 1e-2


def test_non_uniform_decode_batch_is_refused(fb, base_config):
    builder = ps.make_builder(_config(base_config))
    with pytest.raises(ValueError, match="uniform"):
        builder._build_decode(torch.zeros(2, 4, dtype=torch.int32), torch.tensor([5, 6]), 6,
                              torch.tensor([0, 1, 3], dtype=torch.int32), None, 3, 2, None)


def test_lse_when_vllm_asks_for_it(fb, base_config):
    builder = ps.make_builder(_config(base_config))
    builder.plan_lse = True                          # what decode context parallelism sets
    impl = ps.make_impl(_config(base_config))
    impl.need_to_return_lse_for_decode = True
    md, bt, lens, num_pages = _decode(builder, [30, 8])
    assert ps.RecordingKernel.instances[0].plans[-1]["return_lse"] is True
    q, kv = _qkv(2, num_pages)
    out, lse = _forward(impl, md, q[..., 192:], q[..., 128:192], kv)
    _, ref_lse = mla_decode_reference(q[..., 192:], q[..., 128:192], kv[..., :512], kv[..., 512:],
                                      bt, lens, ps.softmax_scale(), return_lse=True)
    assert impl.lse_base_on_e is False                 # FlashInfer's LSE is base 2
    torch.testing.assert_close(lse * math.log(2), ref_lse, rtol=1e-3, atol=1e-3)
    impl2 = ps.make_impl(_config(base_config))
    impl2.need_to_return_lse_for_decode = True
    builder.plan_lse = False
    md2, *_ = _decode(builder, [30, 8])
    with pytest.raises(ValueError, match="planned without it"):
        _forward(impl2, md2, q[..., 192:], q[..., 128:192], kv)


def test_a_layer_with_another_scale_is_not_run_with_this_plan(fb, base_config):
    builder = ps.make_builder(_config(base_config))
    impl = ps.make_impl(_config(base_config), scale=1.0)
    md, _, _, num_pages = _decode(builder, [12])
    q, kv = _qkv(1, num_pages)
    with pytest.raises(ValueError, match="softmax scale"):
        _forward(impl, md, q[..., 192:], q[..., 128:192], kv)


def test_a_cache_of_another_block_size_is_not_run_with_this_plan(fb, base_config):
    builder = ps.make_builder(_config(base_config))
    impl = ps.make_impl(_config(base_config))
    md, _, _, num_pages = _decode(builder, [12])
    q, kv = _qkv(1, num_pages)
    with pytest.raises(ValueError,
                       match=f"FLASHINFER_MLA planned KV block size {PAGE}, the cache pages hold {PAGE // 2}"):
        _forward(impl, md, q[..., 192:], q[..., 128:192], kv.view(2 * num_pages, PAGE // 2, -1))


def test_impl_refuses_what_it_cannot_do(fb, base_config):
    for kw in ({"sliding_window": 128}, {"alibi_slopes": [1.0]}, {"logits_soft_cap": 30.0},
               {"kv_cache_dtype": "fp8"}):
        with pytest.raises(NotImplementedError):
            ps.make_impl(_config(base_config), **kw)


# ---------------------------------------------------------------- tuned plan-time choice

def test_per_bucket_backend_with_one_kernel_per_backend(fb, base_config, tmp_path, monkeypatch):
    _tuned(tmp_path, monkeypatch, {(1, 64, 1): "fa2", (1, 4096, 1): "fa3", (8, 64, 1): "fa3"})
    builder = ps.make_builder(_config(base_config))
    chosen = []
    for lens in ([60], [4000], [70] * 8, [50], [3000]):
        md, *_ = _decode(builder, lens)
        chosen.append(md.backend)
    assert chosen == ["fa2", "fa3", "fa3", "fa2", "fa3"]
    assert sorted(k.backend for k in ps.RecordingKernel.instances) == ["fa2", "fa3"]


def test_per_bucket_kv_chunk_reaches_the_plan_eager_and_in_graphs(fb, base_config, tmp_path, monkeypatch):
    """A bucket's kv_chunk is planned in the step that looks that bucket up, in a captured graph
    too (the chunking is schedule data, not the graph's kernel); a bucket without one plans
    MLAPlan's limit (None)."""
    _tuned(tmp_path, monkeypatch, {(1, 64, 1): {"backend": "fa3", "kv_chunk": "x0.5"},
                                   (1, 4096, 1): {"backend": "fa3", "kv_chunk": "none"},
                                   (4, 64, 1): "fa3", (4, 4096, 1): {"backend": "fa3", "kv_chunk": "x4"}})
    for cudagraph in (False, True):
        ps.RecordingKernel.instances.clear()
        builder = ps.make_builder(_config(base_config, cudagraph=cudagraph))
        got = []
        for lens in ([60], [4000], [70] * 4, [3900] * 4):
            md, *_ = _decode(builder, lens)
            assert md.cuda_graph == cudagraph
            got.append(md.kernel.plans[-1]["kv_chunk"])
        assert got == [0.5, float("inf"), None, 4.0], cudagraph


def test_kv_chunk_of_a_backend_the_device_does_not_serve_is_not_applied(fb, base_config, tmp_path,
                                                                       monkeypatch):
    import vllm_metax.backend as backend_pkg
    import vllm_metax.platform as P
    from vllm_metax.core import device as device_mod
    for mod in (device_mod, backend_pkg, P):
        monkeypatch.setattr(mod, "detect_device", lambda: METAX)
    _tuned(tmp_path, monkeypatch, {(1, 64, 1): {"backend": "fa3", "kv_chunk": "x0.25"},
                                   (1, 4096, 1): {"backend": "fa2", "kv_chunk": "x2"}}, device=METAX.name)
    builder = ps.make_builder(_config(base_config))
    md, *_ = _decode(builder, [60])
    assert md.backend == "fa2" and md.kernel.plans[-1]["kv_chunk"] is None   # tuned for fa3
    md, *_ = _decode(builder, [4000])
    assert md.backend == "fa2" and md.kernel.plans[-1]["kv_chunk"] == 2.0


def test_simulated_metax_keeps_fa3_out(fb, base_config, tmp_path, monkeypatch):
    import vllm_metax.backend as backend_pkg
    import vllm_metax.platform as P
    from vllm_metax.core import device as device_mod
    from vllm_metax.ops import device_backends

    for mod in (device_mod, backend_pkg, P):
        monkeypatch.setattr(mod, "detect_device", lambda: METAX)
    fb_values = device_backends.device_flashinfer_backends()
    assert (fb_values.allowed, fb_values.default) == (("fa2",), "fa2")
    _tuned(tmp_path, monkeypatch, {(1, 64, 1): "fa3", (8, 4096, 1): "fa3"}, device=METAX.name)
    builder = ps.make_builder(_config(base_config))
    assert builder.choice.entry is not None          # MetaX_C500.json was found and read
    md, *_ = _decode(builder, [60])
    assert md.backend == "fa2"
    assert [k.backend for k in ps.RecordingKernel.instances] == ["fa2"]


def test_values_the_device_does_not_run_plan_the_default_with_one_warning(fb, base_config, tmp_path,
                                                                        monkeypatch, caplog):
    # "auto" (the baseline of configs written before the tuner measured the device default) is
    # the default by name; a Blackwell-only value is not served, and the log says so once
    _tuned(tmp_path, monkeypatch, {(1, 64, 1): "auto", (1, 4096, 1): "xqa", (8, 64, 1): "fa2"})
    with caplog.at_level("WARNING", logger="vllm.vllm_metax.backend.plan_choice"):
        builder = ps.make_builder(_config(base_config))
        chosen = [_decode(builder, lens)[0].backend for lens in ([60], [4000], [70] * 8, [60])]
    assert chosen == ["fa3", "fa3", "fa2", "fa3"]
    warnings = [r.getMessage() for r in caplog.records if "does not run" in r.getMessage()]
    assert len(warnings) == 1 and "xqa" in warnings[0] and "auto" not in warnings[0]
    assert "auto" not in {k.backend for k in ps.RecordingKernel.instances}


def test_no_config_uses_the_device_default(fb, base_config):
    builder = ps.make_builder(_config(base_config))
    md, *_ = _decode(builder, [60])
    assert md.backend == "fa3"                       # Hopper: fa3 measured faster everywhere


def test_a_refused_backend_falls_back_and_is_not_tried_again(fb, base_config, monkeypatch):
    from vllm_metax.ops.flashinfer_mla import BackendRefused

    class Refusing(ps.RecordingKernel):
        def plan(self, *a, **k):
            if self.backend == "fa3":
                raise BackendRefused("fa3", "fa3 MLA requires SM90 and CUDA >= 12.3.")
            return super().plan(*a, **k)

    monkeypatch.setattr(fb, "MLADecodeKernel", Refusing)
    builder = ps.make_builder(_config(base_config))
    for _ in range(3):
        md, *_ = _decode(builder, [60])
        assert md.backend == "fa2"
    assert [k.backend for k in ps.RecordingKernel.instances] == ["fa3", "fa2"]


def test_config_is_read_once_and_lookup_is_cheap(fb, base_config, tmp_path, monkeypatch):
    _tuned(tmp_path, monkeypatch, {(b, c, 1): "fa3" if b > 4 else "fa2"
                                   for b in (1, 2, 4, 8, 16, 32, 64, 128)
                                   for c in (512, 1024, 2048, 4096, 8192, 16384, 32768)})
    builder = ps.make_builder(_config(base_config))
    assert builder.choice.entry is not None

    def no_io(*a, **k):
        raise AssertionError("tuned config read during a decode step")
    monkeypatch.setattr(tc, "read_tuned_config", no_io)
    monkeypatch.setattr(tc, "resolve_tuned_config", no_io)
    for lens in ([100] * 3, [3000] * 40, [9] * 128):
        _decode(builder, lens)
    n = 2000
    per_call = min(timeit.repeat(lambda: builder.choice.for_step(37, 3000), number=n, repeat=5)) / n
    assert per_call < 20e-6, f"plan-time lookup took {per_call * 1e6:.1f} us"


# ---------------------------------------------------------------- CUDA graphs

def test_full_cudagraph_uses_persistent_buffers_per_batch_size(fb, base_config):
    builder = ps.make_builder(_config(base_config, cudagraph=True))
    assert builder.full_cudagraph and builder.max_graph_tokens == 8
    md4, *_ = _decode(builder, [10, 20, 30, 40])
    md4b, *_ = _decode(builder, [50, 60, 70, 80], seed=3)
    md2, *_ = _decode(builder, [10, 20])
    k4 = md4.kernel
    assert md4.cuda_graph and k4 is md4b.kernel and md2.kernel is not k4
    assert k4.use_cuda_graph and k4.graph_buffers.kv_len.shape == (4,)
    # a small table goes whole into the graph's buffer, which holds every row at full width
    assert not md4b.paged.compact and k4.graph_buffers.kv_indices.numel() >= md4b.paged.kv_indices.numel()
    assert len(ps.RecordingKernel.instances) == 2
    big, *_ = _decode(builder, [10] * 16)            # beyond the largest capture size: eager
    assert not big.cuda_graph and not big.kernel.use_cuda_graph


def test_large_graph_tables_are_compacted_straight_into_the_graph_buffer(fb, base_config, monkeypatch):
    monkeypatch.setattr(fb, "_GRAPH_STRIDED_MAX_PAGES", 8)     # a 4-row table is "large" here
    builder = ps.make_builder(_config(base_config, cudagraph=True))
    md, bt, lens, _ = _decode(builder, [10, 20, 30, 40])
    buf = md.kernel.graph_buffers.kv_indices
    assert md.cuda_graph and md.paged.compact
    assert md.paged.kv_indices.data_ptr() == buf.data_ptr()      # gathered straight into it
    assert md.paged.kv_indices.tolist() == [p for b, n in enumerate(lens.tolist())
                                            for p in bt[b, :-(-n // PAGE)].tolist()]


def test_cudagraph_padding_rows_read_the_null_block(fb, base_config):
    """vLLM pads a captured batch with zero-length requests whose block-table rows are block 0."""
    builder = ps.make_builder(_config(base_config, cudagraph=True))
    bt, lens, common, _ = ps.ragged_batch([10, 20, 5, 5], PAGE)
    bt[2:] = 0
    lens[2:] = 0
    common.seq_lens_cpu_upper_bound = lens.clone()
    common.seq_lens = lens.clone()
    common.block_table_tensor = bt[:4]
    md = builder.build(0, common)
    meta = md.decode.paged
    assert meta.kv_len.tolist() == [10, 20, 1, 1]
    assert meta.kv_indices.tolist()[-2:] == [0, 0]


@pytest.mark.parametrize("api", ["keyword", "flat"])
def test_through_the_real_op_with_a_fake_flashinfer(fb, base_config, monkeypatch, api):
    """The plugin drives vllm_metax.ops.flashinfer_mla.MLADecodeKernel, not a double of it; only
    FlashInfer's wrapper is faked (both API forms)."""
    import flashinfer_fakes
    from vllm_metax.ops import flashinfer_mla as op

    module = flashinfer_fakes.keyword_module() if api == "keyword" else flashinfer_fakes.flat_module()
    flashinfer_fakes.install(monkeypatch, module)
    monkeypatch.setattr(fb, "MLADecodeKernel", op.MLADecodeKernel)
    builder = ps.make_builder(_config(base_config))
    impl = ps.make_impl(_config(base_config))
    seq_lens = [70, 3, 40]
    md, bt, lens, num_pages = _decode(builder, seq_lens)
    assert isinstance(md.kernel, op.MLADecodeKernel) and md.kernel.api == api
    q, kv = _qkv(3, num_pages)
    out, _ = _forward(impl, md, q[..., 192:], q[..., 128:192], kv)
    ref = mla_decode_reference(q[..., 192:], q[..., 128:192], kv[..., :512], kv[..., 512:], bt, lens,
                               ps.softmax_scale())
    assert relative_error(out, ref) < 1e-2


def test_mla_backend_order():
    from vllm_metax.core.serving import DEFAULT_MLA_ORDER, mla_backend_order

    assert mla_backend_order(None) == (list(DEFAULT_MLA_ORDER), "default MLA order")
    order, why = mla_backend_order(["TRITON_MLA"])
    assert order[0] == "TRITON_MLA" and set(order) == set(DEFAULT_MLA_ORDER) and why == "tuned config"


def test_a_captured_batch_size_plans_one_backend_for_every_context(fb, base_config, tmp_path,
                                                                    monkeypatch):
    """A graph fixes its kernel: per captured batch size the choice most tuned contexts make."""
    _tuned(tmp_path, monkeypatch, {(4, 64, 1): "fa2", (4, 4096, 1): "fa3", (4, 8192, 1): "fa3",
                                   (2, 64, 1): "fa2", (2, 4096, 1): "fa2", (2, 8192, 1): "fa3"})
    builder = ps.make_builder(_config(base_config, cudagraph=True))
    short, *_ = _decode(builder, [60] * 4)
    long, *_ = _decode(builder, [5000] * 4)
    assert (short.backend, long.backend) == ("fa3", "fa3") and short.kernel is long.kernel
    two, *_ = _decode(builder, [5000] * 2)
    assert two.backend == "fa2" and two.cuda_graph
    eager_builder = ps.make_builder(_config(base_config))
    md, *_ = _decode(eager_builder, [60] * 4)
    assert md.backend == "fa2"                       # eager steps follow the bucket


def test_start_says_which_flashinfer_modules_are_not_built_and_the_command(fb, base_config, tmp_path,
                                                                          monkeypatch, caplog):
    """One INFO line at start names the modules the tuned entry serves that FlashInfer's cache
    lacks, and `mla-tune prebuild`; none once they are built (the cache FlashInfer reads)."""
    from flashinfer.jit import env
    from vllm_metax.backend import served_modules
    from vllm_metax.core import log
    cache = tmp_path / "cached_ops"
    monkeypatch.setattr(env, "FLASHINFER_JIT_DIR", cache)
    monkeypatch.setattr(log, "_SAID", set())
    _tuned(tmp_path / "cfg", monkeypatch, {(1, 64, 1): "fa3", (8, 4096, 1): "fa2"})
    logger = "vllm.vllm_metax.backend.served_modules"
    with caplog.at_level("INFO", logger=logger):
        ps.make_builder(_config(base_config))
    said = [r.getMessage() for r in caplog.records if r.name == logger]
    assert len(said) == 1 and said[0].startswith("vllm_metax MLA: 3 FlashInfer module(s)"), said
    assert "MLA decode ckv 512 kpe 64, fa2" in said[0] and "ragged prefill qk 192 vo 128, fa3" in said[0]
    assert "`mla-tune prebuild`" in said[0]
    from vllm_metax.ops import device_backends
    entry = fb.served_entry(_config(base_config), ps.NUM_HEADS)
    for m in served_modules.entry_modules(entry, device_backends.device_flashinfer_backends(),
                                          device_backends.device_prefill_backends()):
        (cache / m.name).mkdir(parents=True)
        (cache / m.name / f"{m.name}.so").write_bytes(b"")
    caplog.clear()
    monkeypatch.setattr(log, "_SAID", set())
    with caplog.at_level("INFO", logger=logger):
        ps.make_builder(_config(base_config))
    assert not [r for r in caplog.records if r.name == logger]
