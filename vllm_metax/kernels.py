"""vLLM's compiled ops for the metax platform: where they come from and whether the ones serving
needs are there.

vLLM 0.33.0 ships its CUDA ops as `vllm._C_stable_libtorch` (torch's stable ABI; there is no
`vllm._C` any more) and the fused-MoE ops as `vllm._moe_C_stable_libtorch`. On a MetaX host the
vendor builds the same ops for MACA in `mcoplib` (`mcoplib._C`, `mcoplib._moe_C`), which register
the same `torch.ops._C*` namespaces; those come first there, since the CUDA build cannot load.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from vllm_metax.core.log import get_logger

logger = get_logger(__name__)

VLLM_SOURCES = ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch")
METAX_SOURCES = ("mcoplib._C", "mcoplib._moe_C")
# What the serving path of an MLA model calls: the model runner's host->device views, the KV-cache
# write of every attention layer, the chunked-prefill context gather.
REQUIRED_OPS = ("_C.get_cuda_view_from_cpu_tensor", "_C_cache_ops.concat_and_cache_mla",
                "_C_cache_ops.gather_and_maybe_dequant_cache")


class MissingKernelsError(RuntimeError):
    """vLLM's compiled ops the serving path needs are not loaded; the message names them."""


@dataclass
class KernelReport:
    loaded: list = field(default_factory=list)        # module names imported
    failed: dict = field(default_factory=dict)        # module name -> why not
    missing: list = field(default_factory=list)       # REQUIRED_OPS not registered afterwards

    def summary(self) -> str:
        parts = [f"loaded {', '.join(self.loaded) or 'nothing'}"]
        if self.missing:
            parts.append(f"missing ops {', '.join(self.missing)}")
        if self.failed:
            parts.append("not loaded: " + "; ".join(f"{m} ({why})" for m, why in self.failed.items()))
        return "; ".join(parts)


def has_op(qualname: str) -> bool:
    """Whether `torch.ops.<namespace>.<op>` is registered (no import side effects beyond torch)."""

    namespace, op = qualname.split(".", 1)
    try:
        getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return False
    return True


def load_compiled_ops(is_metax: bool, importer=importlib.import_module) -> KernelReport:
    """Import the op libraries that exist here (the vendor's first on MetaX) and report which of
    REQUIRED_OPS are still missing. Never raises for a library that is absent."""
    report = KernelReport()
    for name in (METAX_SOURCES + VLLM_SOURCES) if is_metax else VLLM_SOURCES:
        try:
            importer(name)
        except Exception as e:  # an ABI mismatch raises OSError/RuntimeError, absence ImportError
            report.failed[name] = f"{type(e).__name__}: {e}"
            continue
        report.loaded.append(name)
    report.missing = [op for op in REQUIRED_OPS if not has_op(op)]
    return report


def missing_kernels_message(report: KernelReport) -> str:
    return ("vllm_metax: vLLM's compiled ops are not available, so a model cannot be served: "
            f"{report.summary()}. Install vllm==0.33.0 with its compiled extensions "
            "(vllm/_C_stable_libtorch.abi3.so), or on MetaX the vendor's mcoplib.")
