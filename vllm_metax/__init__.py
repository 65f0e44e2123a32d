"""vLLM platform plugin for MetaX GPUs (and, forced, any CUDA-like GPU) with a tuned FlashInfer MLA
backend. Importing this package is cheap: vllm, torch and FlashInfer are imported only by the
functions that need them.

Entry points (pyproject.toml):
  vllm.platform_plugins  metax            -> register()
  vllm.general_plugins   metax_attention  -> register_attention_backends()
  vllm.general_plugins   metax_ops        -> register_custom_ops()

The package is two halves: `core/` and `ops/` never import vLLM (the tuned config, the decisions
tuner and plugin share, the kernels both run); this module, `platform.py`, `worker.py`,
`kernels.py` and `backend/` are the vLLM glue. Nothing below imports this module back.
"""

from __future__ import annotations

# every entry point asks `should_activate` first: the device module is needed in every process
from vllm_metax.core import device
from vllm_metax.core.log import get_logger

PLATFORM_CLASS = "vllm_metax.platform.MetaxPlatform"


def should_activate() -> tuple[bool, str]:
    """Whether the platform plugin activates here, and why (also shown by `mla-tune doctor`)."""
    if device.forced():
        return True, f"forced by ${device.FORCE_ENV}"
    dev = device.detect_device()
    if dev.is_metax:
        return True, f"MetaX device {dev.name!r} found through {dev.source}"
    if dev.source == "none":
        return False, f"no accelerator found (set ${device.FORCE_ENV}=1 to force)"
    return False, f"{dev.name!r} is not a MetaX device (set ${device.FORCE_ENV}=1 to force)"


def register() -> str | None:
    """vllm.platform_plugins entry point: the platform class path when active, else None.
    Says so, in one line, when another distribution (MetaX's vLLM-metax) also installs
    `vllm_metax`. Where `VLLM_METAX_TRAFFIC` names a folder, picks the server's traffic file in
    it here, in the server's first process (`vllm_metax.core.traffic.resolve_path`)."""
    active, _ = should_activate()
    if active:
        # lazy: only where the platform is active (vLLM imports this package in every process,
        # on machines where it stays inactive too)
        from vllm_metax.core import distribution, traffic

        traffic.resolve_path()      # a traffic folder -> this server's file, before any process is spawned
        message = distribution.clash_message(distribution.other_owners())
        if message:
            get_logger(__name__).warning("vllm_metax: %s", message)
    return PLATFORM_CLASS if active else None


def register_attention_backends() -> None:
    """vllm.general_plugins entry point: point FLASHINFER_MLA, TRITON_MLA and FLASHMLA at our
    backends, only when our platform is the active one (elsewhere vLLM's own backends must stay
    untouched).

    Idempotent; the platform also calls the registration itself before it selects a backend.
    """
    if not should_activate()[0]:
        return
    from vllm_metax.platform import register_backends   # lazy: imports vLLM and torch

    register_backends()


def register_custom_ops() -> dict | None:
    """vllm.general_plugins entry point (every vLLM process, before its model is built): vLLM's
    compiled kernels for norms, activations, rotary and the MLA prefill's merge instead of PyTorch's
    (or Triton's) code, only when our platform is the active one (vllm_metax.custom_ops). Returns
    what each op runs, or None."""
    if not should_activate()[0]:
        return None
    # lazy: only where the platform is active (the platform module imports vLLM and torch)
    from vllm_metax.custom_ops import register_cuda_forward, route_merge_attn_states, summary
    from vllm_metax.platform import compiled_ops

    compiled_ops()                          # the kernels loaded first, so they can be found
    outcome = register_cuda_forward()
    outcome["merge_attn_states"] = route_merge_attn_states()
    get_logger(__name__).info(summary(outcome))
    return outcome
