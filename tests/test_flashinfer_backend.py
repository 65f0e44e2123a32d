"""The flashinfer family on the CPU, over a torch stand-in for the wrapper: space, defaults,
refusals as data, and the correctness gate through the real block-table -> metadata path."""

import pytest
import torch

from mla_tune.families import Candidate, get_family
from mla_tune.families.flashinfer import FlashInferFamily
from mla_tune.measure.trial import MeasureSettings, measure
from mla_tune.problem.workload import custom_model, workload_for
from mla_tune.problem.instance import make_problem
from tests import flashinfer_fakes as fakes
from vllm_metax.core import device as device_mod
from vllm_metax.ops import flashinfer_mla as op


def _wl(q_len=1, ragged="lognormal", heads=4):
    return workload_for(custom_model(heads), 1, 3, 24, q_len=q_len, ragged=ragged, seed=3)


def _device(monkeypatch, name="NVIDIA H200", metax=False, cap=(9, 0)):
    monkeypatch.setattr(device_mod, "detect_device",
                        lambda: device_mod.DeviceInfo(name, "torch", metax, 132, cap))


def test_registry_gives_the_flashinfer_family():
    assert get_family("flashinfer").family == "flashinfer"


def test_space_is_what_the_plugin_may_plan_times_page_size(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module(("auto", "fa2", "fa3", "cute-dsl", "xqa")))
    _device(monkeypatch)
    keys = [c.key for c in FlashInferFamily().space(_wl(), [1, 64])]
    chunks = ["x0.25", "x0.5", "x2", "x4", "none"]
    assert keys == (["flashinfer/fa3/p1", "flashinfer/fa3/p64", "flashinfer/fa2/p1", "flashinfer/fa2/p64"]
                    + [f"flashinfer/{b}/p64/kv_chunk={c}" for b in ("fa3", "fa2") for c in chunks])
    # without the default page, the chunk variants sit at the first page given
    assert {c.page_size for c in FlashInferFamily().space(_wl(), [16, 32]) if c.params} == {16}
    # no fast re-plan, no chunking: the variants are not declared at all
    assert all(not c.params for c in FlashInferFamily(fast_replan=False).space(_wl(), [64]))


def test_the_flat_api_declares_no_chunk_variants(monkeypatch):
    """MetaX's 0.2.x FlashInfer plans through its public plan() only: no schedule of ours."""
    fakes.install(monkeypatch, fakes.flat_module())
    _device(monkeypatch)
    space = FlashInferFamily().space(_wl(), [64])
    assert space and all(not c.params for c in space)


def test_blackwell_space_is_fa2_only_as_the_plugin_serves(monkeypatch):
    # the plugin plans fa2 off Hopper: xqa/trtllm-gen winners would be served as fa2
    fakes.install(monkeypatch, fakes.keyword_module(("auto", "fa2", "fa3", "cutlass", "trtllm-gen")))
    _device(monkeypatch, "NVIDIA B200", cap=(10, 0))
    assert [c.key for c in FlashInferFamily().space(_wl(), [64]) if not c.params] == ["flashinfer/fa2/p64"]
    assert {c.backend for c in FlashInferFamily().space(_wl(), [64])} == {"fa2"}
    assert FlashInferFamily().default_candidate(_wl()).key == "flashinfer/fa2/p64"


def test_metax_space_has_no_fa3(monkeypatch):
    fakes.install(monkeypatch, fakes.flat_module())
    _device(monkeypatch, "MetaX C500", metax=True, cap=(8, 0))
    backends = {c.backend for c in FlashInferFamily().space(_wl(), [16])}
    assert "fa3" not in backends and "fa2" in backends


def test_space_empty_without_flashinfer(monkeypatch):
    def boom():
        raise op.FlashInferUnavailable("no flashinfer here")
    monkeypatch.setattr(op, "_cached_api", boom)
    assert FlashInferFamily().space(_wl(), [16]) == []


def test_default_candidate_is_what_the_plugin_plans_untuned(monkeypatch):
    _device(monkeypatch)
    assert FlashInferFamily().default_candidate(_wl()).key == "flashinfer/fa3/p64"
    assert FlashInferFamily().default_candidate(_wl(), 16).key == "flashinfer/fa3/p16"
    _device(monkeypatch, "MetaX C500", metax=True, cap=(8, 0))
    assert FlashInferFamily().default_candidate(_wl()).key == "flashinfer/fa2/p64"    # never auto
    _device(monkeypatch, "NVIDIA A100", cap=(8, 0))
    assert FlashInferFamily().default_candidate(_wl()).key == "flashinfer/fa2/p64"


def test_unavailable_off_cuda():
    av = FlashInferFamily().available("cpu")
    assert not av.ok and "CUDA" in av.reason


@pytest.mark.parametrize("make", [fakes.keyword_module, fakes.flat_module])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("page", [1, 16])
def test_measure_passes_the_correctness_gate(monkeypatch, make, q_len, page):
    fakes.install(monkeypatch, make())
    w = _wl(q_len)
    r = measure(FlashInferFamily(), w, Candidate("flashinfer", "fa2", page),
                MeasureSettings(samples=3, plan_samples=3))
    assert r.status == "ok", r.message
    assert r.max_rel_error < 1e-2
    assert len(r.samples["kernel_us"]) == 3 and len(r.samples["plan_us"]) == 3


def test_wrong_metadata_fails_the_gate(monkeypatch):
    """A kernel path that mangles kv_indices must be stored invalid(wrong_result)."""
    fakes.install(monkeypatch, fakes.keyword_module())
    real = op.MLADecodeKernel.plan

    def bad_plan(self, meta, *a, **k):
        meta.kv_indices = meta.kv_indices.flip(0)
        return real(self, meta, *a, **k)

    monkeypatch.setattr(op.MLADecodeKernel, "plan", bad_plan)
    r = measure(FlashInferFamily(), _wl(ragged="uniform"), Candidate("flashinfer", "fa2", 4),
                MeasureSettings(samples=2))
    assert r.status == "invalid" and r.invalid_reason == "wrong_result"


def test_refusal_is_stored_unsupported_with_flashinfers_reason(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module())
    monkeypatch.setattr(fakes.TorchCSRWrapper, "refuse", {"trtllm-gen": "trtllm-gen MLA requires SM100/SM103"})
    r = measure(FlashInferFamily(), _wl(), Candidate("flashinfer", "trtllm-gen", 64), MeasureSettings())
    assert (r.status, r.invalid_reason) == ("invalid", "unsupported")
    assert "SM100" in r.message


def test_backend_value_flashinfer_does_not_accept(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module(("auto", "fa2")))
    r = measure(FlashInferFamily(), _wl(), Candidate("flashinfer", "cutile", 64), MeasureSettings())
    assert (r.status, r.invalid_reason) == ("invalid", "unsupported")
    assert "cutile" in r.message


def test_knobs_are_rejected(monkeypatch):
    fakes.install(monkeypatch, fakes.keyword_module())
    r = measure(FlashInferFamily(), _wl(), Candidate("flashinfer", "fa2", 16, {"num_kv_splits": 4}),
                MeasureSettings())
    assert r.invalid_reason == "unsupported"


def test_prepared_plan_replans_through_the_plugin_op(monkeypatch):
    """Timing plan() means timing the plugin's per-step host work: metadata build + plan."""
    fakes.install(monkeypatch, fakes.keyword_module())
    w = _wl()
    problem = make_problem(w, 16, "cpu", seed=1)
    prepared = FlashInferFamily().prepare(w, Candidate("flashinfer", "fa3", 16), problem)
    assert isinstance(prepared.kernel, op.MLADecodeKernel)
    n = sum(1 for c in prepared.kernel.wrapper.calls if c[0] == "plan")
    prepared.plan()
    assert sum(1 for c in prepared.kernel.wrapper.calls if c[0] == "plan") == n + 1
    assert prepared.kernel.wrapper.plan_args["sm_scale"] == w.softmax_scale
    out = prepared.run()
    assert out is prepared.out and out.shape == problem.q_nope.shape
