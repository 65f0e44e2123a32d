"""Kernel families the tuner can measure, by name. Imports are lazy: a family's heavy or optional
dependencies (flashinfer, vllm) load only when it is asked for."""

from __future__ import annotations

from importlib import import_module

from mla_tune.families.base import Availability, Candidate, CandidateInvalid, Family, Prepared

# family -> "module:Class"; test-only families register themselves through `register_family`.
_FAMILIES = {
    "reference": "mla_tune.families.reference:ReferenceFamily",
    "flashinfer": "mla_tune.families.flashinfer:FlashInferFamily",
    "triton": "mla_tune.families.triton_mla:TritonMLAFamily",
    "flashmla": "mla_tune.families.flashmla:FlashMLAFamily",
    "split": "mla_tune.families.split:SplitFamily",
}


def register_family(name: str, target: str) -> None:
    _FAMILIES[name] = target


def family_names() -> list[str]:
    return list(_FAMILIES)


def family_targets() -> dict[str, str]:
    """family -> "module:Class", so a worker process can rebuild the same registry."""
    return dict(_FAMILIES)


def check_candidate(c: Candidate) -> Candidate:
    """Refuse (ValueError) a candidate its family would not understand: an unknown family, a
    backend or knob the family does not have, a knob value out of range. Families registered by
    tests have no rule beyond the page size."""
    from vllm_metax import tuned_config as tc
    if c.family not in _FAMILIES:
        raise ValueError(f"unknown kernel family {c.family!r} in {c.key!r}; known: {', '.join(_FAMILIES)}")
    if c.family == "reference":
        if c.backend != "torch" or c.params:
            raise ValueError(f"{c.key!r}: the reference family is reference/torch/p<page>, no knobs")
    elif c.family == "flashmla":
        if c.backend != tc.FLASHMLA_BACKEND or c.params or c.page_size != tc.FLASHMLA_PAGE_SIZE:
            raise ValueError(f"{c.key!r}: the flashmla family is flashmla/{tc.FLASHMLA_BACKEND}/"
                             f"p{tc.FLASHMLA_PAGE_SIZE}, no knobs")
    elif c.family == "split":
        if c.backend != tc.SPLIT_BACKEND:
            raise ValueError(f"{c.key!r}: the split family's backend is {tc.SPLIT_BACKEND!r}")
        if not {"num_splits", "partial"} <= set(c.params) <= {"num_splits", "partial", "pipe"}:
            raise ValueError(f"{c.key!r}: a split candidate names num_splits=N,partial=<dtype>[,pipe=<pipe>]")
        try:
            tc.check_params(c.family, {"backend": c.backend, **c.params}, f"candidate {c.key!r}")
        except tc.TunedConfigError as e:
            raise ValueError(str(e)) from None
    elif c.family in ("flashinfer", "triton"):
        if c.family == "flashinfer" and c.params:
            raise ValueError(f"{c.key!r}: a flashinfer candidate has no knobs (its backend is the "
                             "second part: flashinfer/<backend>/p<page>)")
        params = dict(c.params) if c.family == "triton" else {"backend": c.backend}
        if c.family == "triton":
            if c.backend != tc.TRITON_BACKEND:
                raise ValueError(f"{c.key!r}: the triton family's backend is {tc.TRITON_BACKEND!r}")
            if "num_kv_splits" not in params:
                raise ValueError(f"{c.key!r}: a triton candidate names num_kv_splits=N")
        try:
            tc.check_params(c.family, params, f"candidate {c.key!r}")
        except tc.TunedConfigError as e:
            raise ValueError(str(e)) from None
    return c


def get_family(family: str) -> Family:
    """Instantiate a family by name; unknown names raise KeyError with the known ones."""
    if family not in _FAMILIES:
        raise KeyError(f"unknown kernel family {family!r}; known: {', '.join(_FAMILIES)}")
    mod, _, cls = _FAMILIES[family].partition(":")
    try:
        return getattr(import_module(mod), cls)()
    except ImportError as e:
        return _Unavailable(family, f"cannot import {mod}: {e}")


class _Unavailable:
    """Stands in for a family whose module cannot be imported here, so the sweep can go on."""

    def __init__(self, family: str, reason: str):
        self.family = family
        self._reason = reason

    def available(self, device: str) -> Availability:
        return Availability(False, self._reason)

    def space(self, workload, page_sizes):
        return []

    def default_candidate(self, workload, page_size):
        raise CandidateInvalid("unsupported", self._reason)

    def prepare(self, workload, candidate, problem):
        raise CandidateInvalid("unsupported", self._reason)


__all__ = ["Availability", "Candidate", "CandidateInvalid", "Family", "Prepared",
           "family_names", "family_targets", "get_family", "register_family"]
