"""The plugin's FlashInfer MLA op on the CPU: API detection, and exactly what reaches FlashInfer."""

import pytest
import torch

from tests import flashinfer_fakes as fakes
from vllm_metax.ops import fast_replan as fr
from vllm_metax.ops import flashinfer_mla as op
from vllm_metax.ops.paged_metadata import build_paged_metadata


def _meta(page_size=16, lens=(40, 7, 16), q_len=1):
    lens_t = torch.tensor(lens, dtype=torch.int32)
    max_pages = max((n + page_size - 1) // page_size for n in lens)
    bt = torch.arange(len(lens) * max_pages, dtype=torch.int32).flip(0).reshape(len(lens), max_pages)
    return build_paged_metadata(bt, lens_t, page_size, q_len)


def test_detects_keyword_api_and_reads_backend_table():
    api = op.detect_api(fakes.keyword_module(("auto", "fa2", "fa3", "xqa", "new-one")))
    assert api.form == op.API_KEYWORD
    assert api.plan_metadata_cls is fakes.FakeMLAPlanMetadata
    assert api.backends == ("auto", "fa2", "fa3", "xqa", "new-one")


def test_detects_flat_api_and_documented_backends():
    api = op.detect_api(fakes.flat_module())
    assert api.form == op.API_FLAT
    assert api.plan_metadata_cls is None
    assert set(api.backends) == {"auto", "fa2", "fa3", "cutlass"}


def test_module_without_wrapper_is_unavailable():
    import types
    with pytest.raises(op.FlashInferUnavailable):
        op.detect_api(types.SimpleNamespace())


def test_concrete_backends_drop_aliases():
    assert op.concrete_backends(("auto", "fa2", "cute-dsl", "cute-dsl-modular")) == ("fa2", "cute-dsl-modular")


def test_keyword_plan_hands_metadata_and_dims_through(monkeypatch):
    api = fakes.install(monkeypatch, fakes.keyword_module())
    meta = _meta()
    k = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa3")
    k.plan(meta, 16, 512, 64, 16, False, 0.0721, torch.bfloat16, torch.bfloat16)
    name, args, kw = k.wrapper.calls[-1]
    assert name == "plan" and args == ()
    m = kw["metadata"]
    assert isinstance(m, api.plan_metadata_cls)
    assert m.qo_indptr is meta.qo_indptr and m.kv_indptr is meta.kv_indptr
    assert m.kv_indices is meta.kv_indices and m.kv_len_arr is meta.kv_len
    pa = k.wrapper.plan_args
    # head_dim_ckv is kv_lora_rank (not num_kv_heads), sm_scale the layer's scale (not 1.0)
    assert (pa["num_heads"], pa["head_dim_ckv"], pa["head_dim_kpe"], pa["page_size"]) == (16, 512, 64, 16)
    assert pa["sm_scale"] == 0.0721 and pa["causal"] is False
    assert (kw["query_layout"], kw["kv_cache_layout"], kw["lse_mode"]) == ("split", "split", "none")


def test_keyword_layout_packed_for_packed_only_backends(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module())
    k = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "cutlass")
    k.plan(_meta(), 16, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16, return_lse=True)
    kw = k.wrapper.calls[-1][2]
    assert (kw["query_layout"], kw["kv_cache_layout"], kw["lse_mode"]) == ("packed", "packed", "base2")


def test_flat_plan_is_positional_in_documented_order(monkeypatch):
    fakes.install(monkeypatch, fakes.flat_module())
    meta = _meta()
    k = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa2")
    assert k.api == op.API_FLAT
    k.plan(meta, 8, 512, 64, 16, True, 0.5, torch.float16, torch.float16)
    name, args, _ = k.wrapper.calls[-1]
    assert name == "plan"
    assert args[:4] == (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_len)
    assert args[4:] == (8, 512, 64, 16, True, 0.5, torch.float16, torch.float16)


def test_constructor_passes_graph_buffers_and_backend(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module())
    gb = op.GraphBuffers.allocate(3, 10, "cpu")
    ws = torch.empty(8, dtype=torch.uint8)
    k = op.MLADecodeKernel(ws, "fa2", use_cuda_graph=True, graph_buffers=gb)
    _, args, kw = k.wrapper.calls[0]
    assert args == (ws, True, gb.qo_indptr, gb.kv_indptr, gb.kv_indices, gb.kv_len)
    assert kw == {"backend": "fa2"}
    assert gb.qo_indptr.shape == (4,) and gb.kv_len.shape == (3,) and gb.kv_indices.dtype == torch.int32


def test_graph_mode_needs_buffers(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module())
    with pytest.raises(ValueError, match="graph_buffers"):
        op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa2", use_cuda_graph=True)


def test_forcing_keyword_on_flat_install_is_an_error(monkeypatch):
    fakes.install(monkeypatch, fakes.flat_module())
    with pytest.raises(ValueError, match="keyword"):
        op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa2", api="keyword")
    with pytest.raises(ValueError, match="api must be"):
        op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa2", api="positional")


def test_keyword_install_can_be_driven_through_the_flat_form(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module())
    k = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa2", api="flat")
    assert k.api == op.API_FLAT


def test_refusal_becomes_backend_refused_with_flashinfers_message(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module())
    monkeypatch.setattr(fakes.TorchCSRWrapper, "refuse", {"trtllm-gen": "trtllm-gen requires SM100"})
    k = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "trtllm-gen")
    with pytest.raises(op.BackendRefused) as ei:
        k.plan(_meta(), 16, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16)
    assert ei.value.reason == "trtllm-gen requires SM100" and ei.value.backend == "trtllm-gen"
    assert not k.planned


def test_is_refusal_separates_refusals_from_bugs():
    assert op.is_refusal(fakes._BackendPlanUnsupportedError("anything"))
    assert op.is_refusal(RuntimeError("fa3 MLA requires SM90 and CUDA >= 12.3 (not supported)"))
    assert not op.is_refusal(TypeError("missing argument"))
    assert not op.is_refusal(RuntimeError("CUDA error: illegal memory access"))


@pytest.mark.parametrize("make", [fakes.keyword_module, fakes.flat_module])
@pytest.mark.parametrize("q_len", [1, 3])
def test_op_result_matches_reference_through_real_metadata(monkeypatch, make, q_len):
    """Block table -> build_paged_metadata -> op -> (fake) kernel equals the paged reference."""
    from mla_tune.problem.reference import mla_decode_reference, relative_error
    fakes.install(monkeypatch, make())
    torch.manual_seed(0)
    page, lens = 4, [9, 3, 16]
    pages_needed = sum((n + page - 1) // page for n in lens)
    perm = torch.randperm(pages_needed + 5)[:pages_needed].to(torch.int32)
    bt = torch.zeros(3, 4, dtype=torch.int32)
    o = 0
    for b, n in enumerate(lens):
        k = (n + page - 1) // page
        bt[b, :k] = perm[o:o + k]
        o += k
    kv = torch.randn(pages_needed + 5, page, 576).to(torch.bfloat16)
    q = torch.randn(3 * q_len, 2, 576).to(torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32)
    kern = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa2")
    kern.plan(build_paged_metadata(bt, seq, page, q_len), 2, 512, 64, page, q_len > 1, 0.08,
              torch.bfloat16, torch.bfloat16, return_lse=True)
    out = torch.full_like(q[..., :512], float("nan"))
    got, lse = kern.run(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], out=out, return_lse=True)
    ref, ref_lse = mla_decode_reference(q[..., :512], q[..., 512:], kv[..., :512], kv[..., 512:], bt,
                                        seq, 0.08, q_len, return_lse=True)
    assert got is out
    assert relative_error(out, ref) < 1e-2
    assert torch.allclose(lse * torch.log(torch.tensor(2.0)), ref_lse, atol=1e-3)   # base-2 LSE


def test_keyword_run_passes_split_tuples_and_checks_lse_contract(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module())
    k = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa2")
    k.plan(_meta(page_size=16, lens=(16,)), 1, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16)
    qn, qp = torch.zeros(1, 1, 512, dtype=torch.bfloat16), torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    ckv = torch.zeros(48, 16, 512, dtype=torch.bfloat16)
    kpe = torch.zeros(48, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="return_lse"):
        k.run(qn, qp, ckv, kpe, return_lse=True)
    k.run(qn, qp, ckv, kpe)
    kw = k.wrapper.calls[-1][2]
    assert kw["query"][0] is qn and kw["query"][1] is qp
    assert kw["kv_cache"][0] is ckv and kw["kv_cache"][1] is kpe


def test_resolved_backend_after_plan(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module())
    k = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "auto")
    assert k.resolved_backend is None
    k.plan(_meta(), 16, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16)
    assert k.resolved_backend == "fa2"


def test_without_flashinfer_available_says_why(monkeypatch):
    def boom():
        raise op.FlashInferUnavailable("cannot import flashinfer.mla: ImportError: nope")
    monkeypatch.setattr(op, "_cached_api", boom)
    ok, why = op.flashinfer_available()
    assert not ok and "nope" in why


def test_import_is_cheap():
    import subprocess
    import sys
    code = ("import sys, vllm_metax.ops.flashinfer_mla; "
            "print(any(m == 'flashinfer' or m.startswith('flashinfer.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class _FakeModule:
    def __init__(self):
        self.calls = []

    def plan_with_staged_workspace_bytes(self, *args):
        self.calls.append(args)
        return ("plan-info", len(self.calls)), 7


class _FakePlanned:
    _backend = "fa3"

    def __init__(self):
        self._cached_module = _FakeModule()
        self._float_workspace_buffer = torch.empty(1)
        self._int_workspace_buffer = torch.empty(2)
        self._pin_memory_int_workspace_buffer = torch.empty(3)
        self._use_cuda_graph = False
        self.device = torch.device("cpu")
        self._kv_indices_buf = None
        self._plan_info = None


def _fast_kernel(monkeypatch, graph_pages=None, batch=3):
    fakes.install(monkeypatch, fakes.keyword_module())
    monkeypatch.setattr(fr, "sm_count", lambda device: 132)       # an H200's SM count
    gb = op.GraphBuffers.allocate(batch, graph_pages, "cpu") if graph_pages else None
    k = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa3", use_cuda_graph=gb is not None,
                           graph_buffers=gb)
    k.wrapper._planned_backend = _FakePlanned()
    if gb is not None:
        k.wrapper._planned_backend._use_cuda_graph = True
        k.wrapper._planned_backend._kv_indices_buf = gb.kv_indices
    return k


def test_fast_replan_calls_native_plan_and_stages_metadata(monkeypatch):
    k = _fast_kernel(monkeypatch)
    args = (16, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16)
    k.plan(_meta(), *args)                      # first plan: public path
    assert k.fast_replans == 0
    meta = _meta(lens=(17, 1, 2))
    k.plan(meta, *args)                         # same arguments, new metadata: fast path
    assert k.fast_replans == 1
    be = k.wrapper._planned_backend
    call = be._cached_module.calls[-1]
    assert call[:3] == (be._float_workspace_buffer, be._int_workspace_buffer, be._pin_memory_int_workspace_buffer)
    assert call[3] is meta.qo_indptr and call[4] is meta.kv_indptr and call[5] is meta.kv_len
    assert call[6:] == (16, 512, False)
    assert be._kv_indices_buf is meta.kv_indices
    assert k.wrapper._plan_info == be._plan_info == ("plan-info", 1)


def test_fast_replan_causal_only_where_flashinfers_tile_check_cannot_fire(monkeypatch):
    for heads, fast in ((16, True), (128, False), (12, False)):
        k = _fast_kernel(monkeypatch)
        args = (heads, 512, 64, 16, True, 0.1, torch.bfloat16, torch.bfloat16)
        k.plan(_meta(q_len=2), *args)
        k.plan(_meta(lens=(5, 6, 7), q_len=2), *args)
        assert k.fast_replans == int(fast), heads
        if fast:
            assert k.wrapper._planned_backend._cached_module.calls[-1][6:] == (heads, 512, True)


@pytest.mark.parametrize("change", ["scale", "causal", "lse", "off"])
def test_fast_replan_only_for_identical_non_causal_plans(monkeypatch, change):
    k = _fast_kernel(monkeypatch)
    args = [16, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16]
    k.plan(_meta(), *args)
    kw = {}
    if change == "scale":
        args[5] = 0.2
    elif change == "causal":
        args[4] = True
    elif change == "lse":
        kw["return_lse"] = True
    else:
        k.fast_replan = False
    k.plan(_meta(lens=(3, 4, 5)), *args, **kw)
    assert k.fast_replans == 0
    assert k.wrapper.plan_args["sm_scale"] == args[5]      # the public plan ran with the new arguments


def _strided(lens, page_size=16, width=6):
    bt = torch.arange(len(lens) * width, dtype=torch.int32).flip(0).reshape(len(lens), width)
    meta = build_paged_metadata(bt, torch.tensor(lens, dtype=torch.int32), page_size, compact=False)
    assert not meta.compact
    return meta, bt


def test_strided_metadata_goes_to_the_native_plan_and_is_compacted_for_the_public_one(monkeypatch):
    """The block table itself is the page list on the fast path; FlashInfer's public plan(), which
    demands compact CSR, gets the compacted form of the same pages."""
    k = _fast_kernel(monkeypatch)
    args = (16, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16)
    first, bt = _strided((40, 7, 16))
    k.plan(first, *args)                                        # public path
    assert k.fast_replans == 0
    compact = build_paged_metadata(bt, torch.tensor([40, 7, 16]), 16)
    assert k.wrapper.plan_args["kv_indices"].tolist() == compact.kv_indices.tolist()
    assert k.wrapper.plan_args["kv_indptr"].tolist() == [0, 3, 4, 5]
    meta, _ = _strided((90, 1, 33))
    k.plan(meta, *args)                                         # fast path: strided as is
    assert k.fast_replans == 1
    call = k.wrapper._planned_backend._cached_module.calls[-1]
    assert call[4].tolist() == [0, 6, 12, 18] and call[5].tolist() == [90, 1, 33]
    assert k.wrapper._planned_backend._kv_indices_buf.data_ptr() == meta.block_table.data_ptr()


def test_graph_fast_replan_copies_page_indices_into_the_captured_buffer(monkeypatch):
    k = _fast_kernel(monkeypatch, graph_pages=18)
    args = (16, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16)
    k.plan(_strided((40, 7, 16))[0], *args)
    meta, bt = _strided((90, 1, 33))
    k.plan(meta, *args)
    assert k.fast_replans == 1
    assert k.graph_buffers.kv_indices.tolist() == bt.reshape(-1).tolist()   # 3 rows x 6 = 18 pages
    small = _fast_kernel(monkeypatch, graph_pages=12)            # too small for 18 strided pages
    small.plan(_strided((40, 7, 16))[0], *args)
    small.plan(meta, *args)
    assert small.fast_replans == 0                               # the public plan ran (compact fits)
    assert small.wrapper.plan_args["kv_indptr"].tolist() == [0, 6, 7, 10]


def test_fast_replan_never_where_flashinfers_checks_could_fail(monkeypatch):
    """Work counts near MLAPlan's native capacity, backends other than fa2/fa3, the 0.2.x API."""
    args = (128, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16)
    big = build_paged_metadata(torch.zeros(8200, 1, dtype=torch.int32), torch.ones(8200, dtype=torch.int32), 16)
    k = _fast_kernel(monkeypatch)
    k.plan(big, *args)
    k.plan(big, *args)
    assert k.fast_replans == 0                  # 8200 x 2 tiles + 132 SMs > 16384 work items
    ok = build_paged_metadata(torch.zeros(8000, 1, dtype=torch.int32), torch.ones(8000, dtype=torch.int32), 16)
    k.plan(ok, *args)
    assert k.fast_replans == 1                  # 16000 + 132 fits (the last public plan had these arguments)
    other = _fast_kernel(monkeypatch)
    other.wrapper._planned_backend._backend = "cutlass"
    other.plan(_meta(), *args)
    other.plan(_meta(), *args)
    assert other.fast_replans == 0
    fakes.install(monkeypatch, fakes.flat_module())          # the 0.2.x wrapper: plan() is cheap already
    flat = op.MLADecodeKernel(torch.empty(8, dtype=torch.uint8), "fa2")
    flat.wrapper._planned_backend = _FakePlanned()
    assert flat.api == op.API_FLAT
    flat.plan(_meta(), *args)
    flat.plan(_meta(), *args)
    assert flat.fast_replans == 0


def test_fast_replan_switches_itself_off_when_internals_differ(monkeypatch):
    k = _fast_kernel(monkeypatch)
    args = (16, 512, 64, 16, False, 0.1, torch.bfloat16, torch.bfloat16)
    k.plan(_meta(), *args)

    def broken(*a):
        raise TypeError("plan() takes 12 arguments")
    k.wrapper._planned_backend._cached_module.plan_with_staged_workspace_bytes = broken
    k.plan(_meta(lens=(3, 4, 5)), *args)
    assert k.fast_replans == 0 and k.fast_replan is False
    assert k.wrapper.plan_args["kv_len"].tolist() == [3, 4, 5]    # the public plan ran
