"""Kernel families the tuner can measure, by name. Imports are lazy: a family's heavy or optional
dependencies (flashinfer, vllm) load only when it is asked for."""

from __future__ import annotations

import inspect
from importlib import import_module

from mla_tune.families.base import Availability, Candidate, CandidateInvalid, Family, Prepared

from vllm_metax.core.choices import SPECS, ChoiceError, candidate_choice

# family -> "module:Class": the torch reference, then every kernel spec's (`KernelSpec.tuner`);
# test-only families register themselves through `register_family`.
_FAMILIES = {"reference": "mla_tune.families.reference:ReferenceFamily",
             **{f: spec.tuner for f, spec in SPECS.items()}}


def register_family(name: str, target: str) -> None:
    _FAMILIES[name] = target


def family_names() -> list[str]:
    return list(_FAMILIES)


def family_targets() -> dict[str, str]:
    """family -> "module:Class", so a worker process can rebuild the same registry."""
    return dict(_FAMILIES)


def check_candidate(c: Candidate) -> Candidate:
    """Refuse (ValueError) a candidate its family would not understand: an unknown family, a page
    size its kernel does not run at (`KernelSpec.page`), a backend or knob the family does not
    have, a knob value out of range (the plugin's rule: `vllm_metax.core.choices.candidate_choice`).
    Families registered by tests have no rule beyond the page size."""
    if c.family not in _FAMILIES:
        raise ValueError(f"unknown kernel family {c.family!r} in {c.key!r}; known: {', '.join(_FAMILIES)}")
    if c.family == "reference":
        if c.backend != "torch" or c.params:
            raise ValueError(f"{c.key!r}: the reference family is reference/torch/p<page>, no knobs")
    elif c.family in SPECS:
        spec = SPECS[c.family]
        if not spec.page.allows(c.page_size):
            raise ChoiceError(f"{c.key!r}: the {c.family} family runs at page {spec.page}, not "
                              f"{c.page_size} ({spec.form})")
        candidate_choice(c.family, c.backend, c.params, f"candidate {c.key!r}")
    return c


def get_family(family: str, profile=None) -> Family:
    """Instantiate a family by name, limited to `profile`'s target (`vllm_metax.core.profile`;
    None: the active one) where the family takes one; unknown names raise KeyError with the
    known ones."""
    if family not in _FAMILIES:
        raise KeyError(f"unknown kernel family {family!r}; known: {', '.join(_FAMILIES)}")
    mod, _, cls = _FAMILIES[family].partition(":")
    try:
        klass = getattr(import_module(mod), cls)
    except ImportError as e:
        return _Unavailable(family, f"cannot import {mod}: {e}")
    if profile is not None and "profile" in inspect.signature(klass).parameters:
        return klass(profile=profile)
    return klass()


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
