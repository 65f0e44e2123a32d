"""`mla-tune show --lookup` says what the server runs: every bucket of both shipped configs, and
lookups between and beyond them, fed to the plugin's per-step choice (FLASHINFER_MLA's
`PlanChoice.kernel`, what its builder asks; TRITON_MLA's `TunedSplits`) and to show, compared.
Both follow `vllm_metax.core.decisions.decode_kernel`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mla_tune.views import show
from vllm_metax.core import choices, decisions
from vllm_metax.core import tuned_config as tc

SHIPPED = sorted((Path(__file__).resolve().parents[1] / "vllm_metax" / "configs").glob("device_name=*.json"))
HOPPER = decisions.flashinfer_backends(False, (9, 0))


def _requests(entry) -> list[tuple]:
    """Every bucket's own key, and off-bucket lookups around each: between tuned contexts and
    batches, beyond the tuned range, and at another q_len."""
    out = set()
    for b in entry.buckets:
        B, C, Q = b.batch_size, b.context_len, b.q_len
        out |= {(B, C, Q), (B, C * 3 // 4, Q), (B, C * 2, Q), (B, C * 2 + 1, Q), (B, C * 5, Q),
                (max(1, B - 1), C, Q), (B + 1, max(1, C // 3), Q), (B * 3, C, Q), (B, C, Q + 1)}
    return sorted(out)


def _entries():
    for path in SHIPPED:
        cfg = tc.read_tuned_config(path)
        for i, e in enumerate(cfg.models):
            yield pytest.param(cfg, e, id=f"{path.stem.split('=')[1]}-{i}-H{e.dims.num_heads}")


def test_both_shipped_configs_are_here():
    assert {p.name for p in SHIPPED} >= {"device_name=NVIDIA_H200.json", "device_name=NVIDIA_H100_80GB_HBM3.json"}


def _shown(cfg, entry, request) -> show.Served:
    one = dataclasses.replace(cfg, models=[entry])
    (answer,) = show.lookup(one, request)
    return answer.served


@pytest.mark.vllm
def test_show_names_the_kernel_flashinfer_mla_decodes_with(monkeypatch):
    from vllm_metax.backend.plan_choice import PlanChoice
    monkeypatch.setenv("VLLM_METAX_PROFILE", "nvidia")
    families, compared = set(), 0
    for param in _entries():
        cfg, entry = param.values
        assert entry.backend_order[0] == "FLASHINFER_MLA"
        choice = PlanChoice(entry, HOPPER)
        for request in _requests(entry):
            served = choice.kernel(*request, page_size=entry.page_size)
            shown = _shown(cfg, entry, request)
            assert (shown.attention_backend, shown.family, shown.params) == \
                ("FLASHINFER_MLA", served.family, served.choice.to_params()), (param.id, request)
            families.add(served.family)
            compared += 1
    # the shipped configs exercise FlashInfer, the split kernel and vLLM's FA3
    assert families == {choices.FLASHINFER, choices.SPLIT, choices.FA3} and compared > 1000


@pytest.mark.vllm
@pytest.mark.parametrize("cfg, entry", list(_entries()))
def test_show_names_the_split_count_and_launch_triton_mla_runs(cfg, entry, monkeypatch):
    pytest.importorskip("vllm")
    from vllm_metax.backend.triton_mla import TunedSplits
    monkeypatch.setenv("VLLM_METAX_PROFILE", "nvidia")
    entry = dataclasses.replace(entry, backend_order=["TRITON_MLA", "FLASHINFER_MLA"])
    splits = TunedSplits(entry)
    rules = 0
    for request in _requests(entry):
        shown = _shown(cfg, entry, request)
        assert (shown.attention_backend, shown.family) == ("TRITON_MLA", choices.TRITON), request
        assert shown.params.get("num_kv_splits") == splits.choose(*request), request
        assert shown.params.get("variant", choices.DEFAULT_TRITON_VARIANT) == splits.launch(*request), request
        rules += splits.choose(*request) is None
    assert rules      # the context window sent some lookups to vLLM's rule
