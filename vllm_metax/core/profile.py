"""The target profiles: what the machine a tuned config is for runs, decided once for the tuner and
the plugin alike (vllm-free, stdlib only).

A profile limits every kernel family to what its target runs. "nvidia" is the GPU the project is
measured on (Hopper and its peers, flashinfer-python 0.7, vLLM's Triton, vLLM's FlashMLA build).
"metax" is what MetaX's vendor plugin (vLLM-metax master) ships: `flashinfer==0.2.6+metax` (the
flat 0.2.x API, fa2 only), `flash_mla==1.0.1+metax` (dense FlashMLA at KV block 64) and
`triton==3.6.0+metax`, with the vendor's Triton MLA launch (BLOCK 16, one stage,
`vllm_metax.core.triton_facts`) and no tensor-memory accelerator and no programmatic dependent
launch; its MLA order is FLASHMLA, then TRITON_MLA. So a MetaX user's untuned baseline is
FlashMLA at block 64, and the metax profile's default order and sweep start there.

Which profile runs (`active_profile`): `VLLM_METAX_PROFILE=metax|nvidia` where set (a bad value:
one warning, then detection), else the device (`vllm_metax.core.device.detect_device().is_metax`:
pymxsml or a MetaX device name -> metax). The sweep takes `--profile` and records it in the
results and in the emitted config's provenance; the plugin compares that with the active one
(`config_mismatch`) and serves any bucket choice the active profile cannot run
(`why_unservable`) with the device default.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from vllm_metax.core import choices, device
from vllm_metax.core.log import get_logger, log_once
from vllm_metax.core.split_facts import PIPES

logger = get_logger(__name__)

PROFILE_ENV = "VLLM_METAX_PROFILE"
NVIDIA = "nvidia"
METAX = "metax"
PROVENANCE_KEY = "profile"          # the emitted config's provenance field naming its profile


@dataclass(frozen=True)
class Profile:
    """One target's decisions. `flashinfer_backends` None: the device's own rule
    (`decisions.flashinfer_backends`); a tuple limits it further."""

    name: str
    is_metax: bool                  # the FlashInfer backend rule of a MetaX device (fa2 only)
    flashinfer_backends: tuple | None
    flashinfer_api: str | None      # "flat": FlashInfer's 0.2.x API form; None: as installed
    split_pipes: tuple              # split-kernel pipes (`split_facts.PIPES`) the target runs
    split_tma: bool                 # the split kernel may use its TMA kernel where the GPU has one
    triton_variants: tuple          # Triton launches the sweep measures (`choices.TRITON_VARIANTS`)
    triton_default: str             # the launch TRITON_MLA runs untuned
    mla_order: tuple                # MLA attention backends by priority when no tuned config decides
    sweep_families: tuple           # the families a default GPU sweep measures
    families: tuple                 # the families whose choices the target can serve
    target: str                     # one line for people

    def __str__(self) -> str:
        return self.name


def _pipes_without_tma_or_pdl() -> tuple:
    return tuple(name for name, pipe in PIPES.items() if not pipe.tma_only)


PROFILES = {
    NVIDIA: Profile(
        NVIDIA, is_metax=False, flashinfer_backends=None, flashinfer_api=None,
        split_pipes=choices.SPLIT_PIPES, split_tma=True,
        triton_variants=(choices.DEFAULT_TRITON_VARIANT,),
        triton_default=choices.DEFAULT_TRITON_VARIANT,
        mla_order=("FLASHINFER_MLA", "FLASHMLA", "TRITON_MLA"),
        # every kernel spec's family; flashmla stays opt-in (`KernelSpec.default_sweep`)
        sweep_families=tuple(f for f, spec in choices.SPECS.items() if spec.default_sweep),
        families=tuple(choices.SPECS),
        target="NVIDIA GPUs: flashinfer-python 0.7 (fa2/fa3), vLLM's Triton and FlashMLA builds"),
    METAX: Profile(
        METAX, is_metax=True, flashinfer_backends=("fa2",), flashinfer_api="flat",
        split_pipes=_pipes_without_tma_or_pdl(), split_tma=False,
        triton_variants=(choices.DEFAULT_TRITON_VARIANT, METAX),
        triton_default=METAX,
        mla_order=("FLASHMLA", "TRITON_MLA", "FLASHINFER_MLA"),
        sweep_families=(choices.FLASHMLA, choices.FLASHINFER, choices.TRITON, choices.SPLIT),
        families=(choices.FLASHINFER, choices.TRITON, choices.FLASHMLA, choices.SPLIT),
        target="MetaX GPUs as vLLM-metax runs them: flashinfer 0.2.6+metax (flat API, fa2), "
               "flash_mla 1.0.1+metax (block 64), the vendor's Triton MLA launch, no TMA or PDL"),
}
PROFILE_NAMES = tuple(PROFILES)


def get_profile(name) -> Profile:
    """The profile named `name` (a Profile passes through); ValueError naming the known ones."""
    if isinstance(name, Profile):
        return name
    if name not in PROFILES:
        raise ValueError(f"unknown profile {str(name)[:40]!r}; known: {', '.join(PROFILE_NAMES)}")
    return PROFILES[name]


def profile_source() -> tuple[Profile, str]:
    """The active profile and why it is active (for `mla-tune doctor` and the server log)."""
    raw = os.environ.get(PROFILE_ENV, "").strip()
    if raw:
        if raw.lower() in PROFILES:
            return PROFILES[raw.lower()], f"${PROFILE_ENV}={raw}"
        log_once(logger, logging.WARNING, "vllm_metax: %s=%r is not a profile (known: %s); detecting the device "
                 "instead", PROFILE_ENV, raw[:40], ", ".join(PROFILE_NAMES))
    dev = device.detect_device()
    if dev.is_metax:
        return PROFILES[METAX], f"detected: {dev.name} is a MetaX device (via {dev.source})"
    return PROFILES[NVIDIA], f"detected: {dev.name} is not a MetaX device"


def active_profile() -> Profile:
    """The profile this process runs: $VLLM_METAX_PROFILE, else the device's."""
    return profile_source()[0]


def target_profile(profile=None) -> Profile:
    """The profile a caller targets: `profile` (a name or a Profile), None: the active one."""
    return active_profile() if profile is None else get_profile(profile)


# ---------------------------------------------------------------- what a profile cannot serve

def why_unservable(family: str, params, profile: Profile) -> str | None:
    """Why a bucket's stored choice of `family` (its params) cannot run under `profile`, or None
    if it can. Only what the profile rules out; a device's own limits are the plugin's rules."""
    if family not in profile.families:
        return f"{family} does not run on the {profile.name} target"
    if not isinstance(params, dict):
        return None
    if family == choices.FLASHINFER:
        backend = params.get("backend")
        if profile.flashinfer_backends is not None and backend not in profile.flashinfer_backends:
            return (f"FlashInfer backend {backend!r}: the {profile.name} target runs "
                    f"{', '.join(profile.flashinfer_backends)} only")
    elif family == choices.SPLIT:
        pipe = params.get("pipe", choices.DEFAULT_SPLIT_PIPE)
        if pipe not in profile.split_pipes:
            return (f"split-kernel pipe {pipe!r} needs a tensor-memory accelerator or programmatic "
                    f"dependent launch, which the {profile.name} target has not")
    return None


def unservable_choices(entry, profile: Profile) -> list[tuple]:
    """(bucket, family, why) for every family choice of a tuned entry's buckets that `profile`
    cannot run (`why_unservable`), in bucket order."""
    out = []
    for b in getattr(entry, "buckets", None) or ():
        for family, fc in b.families.items():
            why = why_unservable(family, fc.params, profile)
            if why:
                out.append((b, family, why))
    return out


def config_profile(config) -> str | None:
    """The profile a tuned config's provenance names (None: written before profiles, or unnamed)."""
    name = (getattr(config, "provenance", None) or {}).get(PROVENANCE_KEY)
    return name if isinstance(name, str) else None


def config_mismatch(config, profile: Profile) -> str | None:
    """One line where a config was tuned under another profile than `profile`, else None."""
    tuned = config_profile(config)
    if tuned is None or tuned == profile.name:
        return None
    return (f"{getattr(config, 'path', None) or 'the tuned config'} was tuned under the {tuned!r} "
            f"profile, this process runs the {profile.name!r} profile: each bucket choice the "
            f"{profile.name} target cannot run is served with the device default")
