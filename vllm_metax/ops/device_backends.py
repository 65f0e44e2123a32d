"""The FlashInfer backend values the visible device may plan, for decode and for MLA prefill: the
device rules of `vllm_metax.core.decisions` (`flashinfer_backends`, `prefill_backends`) applied to
this machine (vllm_metax.core.device) under a target profile. Here, not in core/, because whether
vLLM's FA3 prefill serves depends on its library loading (`vllm_metax.ops.fa3_mla`)."""

from __future__ import annotations

from vllm_metax.core import device as vdevice
from vllm_metax.core.decisions import FlashInferBackends, flashinfer_backends, prefill_backends
from vllm_metax.core.profile import target_profile
from vllm_metax.ops import fa3_mla


def device_flashinfer_backends(profile=None, device=None) -> FlashInferBackends:
    """`flashinfer_backends` for the visible device (cached per process; `device`: another
    DeviceInfo, e.g. a build target) under `profile` (default: the active one)."""
    dev, prof = device or vdevice.detect_device(), target_profile(profile)
    return flashinfer_backends(dev.is_metax or prof.is_metax, dev.capability).limited_to(
        prof.flashinfer_backends)


def device_prefill_backends(profile=None, device=None) -> FlashInferBackends:
    """`prefill_backends` for the visible device (cached per process; `device`: another
    DeviceInfo, whose vLLM FA3 is taken to load where the visible one's does) under `profile`
    (default: the active one)."""
    dev, prof = device or vdevice.detect_device(), target_profile(profile)
    is_metax = dev.is_metax or prof.is_metax
    vllm_fa3 = not is_metax and fa3_mla.fa3_available()[0]     # a Hopper check first: loads only there
    return prefill_backends(is_metax, dev.capability, vllm_fa3).limited_to(prof.flashinfer_backends)
