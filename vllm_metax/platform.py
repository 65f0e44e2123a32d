"""The vLLM platform for MetaX GPUs: a CUDA-like out-of-tree platform whose MLA backend selection
and KV block size follow this device's tuned config.

It subclasses `vllm.platforms.interface.Platform`, not `CudaPlatform`: importing
`vllm.platforms.cuda` needs libcuda and vLLM's compiled ops, which neither a MetaX host nor a
GPU-less test machine has. Everything device-specific goes through torch's CUDA API (MetaX's torch
build exposes it) and `vllm_metax.core.device`.
"""

from __future__ import annotations

import importlib.util
import os
from datetime import timedelta
from functools import cache
from typing import TYPE_CHECKING

import torch

from vllm import envs
from vllm.logger import init_logger
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum
from vllm.v1.attention.backends.mla.prefill.registry import (
    MLAPrefillBackendEnum,
    register_mla_prefill_backend,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from vllm_metax.backend import served_entry
from vllm_metax.core.device import FORCE_ENV, detect_device
from vllm_metax.core.log import PARENT as LOG_PARENT
from vllm_metax.core.profile import PROFILE_ENV, profile_source
from vllm_metax.core.serving import mla_backend_order
from vllm_metax.core.traffic import TRAFFIC_ENV
from vllm_metax.core.tuned_config import FOLDER_ENV, PACKAGED_ENV, STRICT_ENV
from vllm_metax.kernels import load_compiled_ops, missing_kernels_message

# vllm.config (and what imports it: vLLM's custom_op module, so vllm_metax.custom_ops) is imported
# inside the methods that need it: it resolves vLLM's `current_platform` on import, and this
# module is imported while vLLM resolves it.

if TYPE_CHECKING:
    from torch.distributed import PrefixStore, ProcessGroup

    from vllm.config import VllmConfig
    from vllm.config.kernel import IrOpPriorityConfig
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
    from vllm.v1.attention.backends.mla.prefill.selector import MLAPrefillSelectorConfig
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(f"{LOG_PARENT}.{__name__}")   # under vLLM's handler (vllm_metax.core.log)

FLASHINFER_MLA_CLASS = "vllm_metax.backend.flashinfer_mla.FlashInferMLABackend"
TRITON_MLA_CLASS = "vllm_metax.backend.triton_mla.MetaxTritonMLABackend"    # tuned num_kv_splits
FLASHMLA_CLASS = "vllm_metax.backend.flashmla.MetaxFlashMLABackend"       # the plugin's FlashMLA op
FLASHINFER_MLA_PREFILL_CLASS = "vllm_metax.backend.flashinfer_prefill.FlashInferMLAPrefillBackend"

SPARSE_MLA_ORDER = ("FLASHMLA_SPARSE",)
DEFAULT_ATTN_ORDER = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
PLUGIN_BACKENDS = {"FLASHINFER_MLA": FLASHINFER_MLA_CLASS, "TRITON_MLA": TRITON_MLA_CLASS,
                   "FLASHMLA": FLASHMLA_CLASS}
PLUGIN_PREFILL_BACKENDS = {"FLASHINFER": FLASHINFER_MLA_PREFILL_CLASS}
# MLA prefill by priority: the plugin's FlashInfer ragged prefill, then vLLM's dense torch prefill
# (correct anywhere, slow: for hosts without FlashInfer). vLLM's FLASH_ATTN prefill needs
# is_cuda() and its compiled flash-attn, neither of which an out-of-tree platform has.
MLA_PREFILL_ORDER = ("FLASHINFER", "CPU")
# Our variables start with VLLM_ (vLLM-metax convention), so vLLM's environment check must know them.
WORKER_CLASS = "vllm_metax.worker.MetaxWorker"
OWN_ENV_VARS = frozenset({FORCE_ENV, FOLDER_ENV, STRICT_ENV, PACKAGED_ENV, PROFILE_ENV, TRAFFIC_ENV})


def register_backends() -> None:
    """Point FLASHINFER_MLA, TRITON_MLA, FLASHMLA and the FLASHINFER MLA prefill at the plugin's
    backends (idempotent)."""
    for backend, path in PLUGIN_BACKENDS.items():
        if AttentionBackendEnum[backend].get_path() != path:
            register_backend(AttentionBackendEnum[backend], class_path=path)
    for backend, path in PLUGIN_PREFILL_BACKENDS.items():
        if MLAPrefillBackendEnum[backend].get_path() != path:
            register_mla_prefill_backend(MLAPrefillBackendEnum[backend], class_path=path)


def _reasons_str(reasons: dict) -> str:
    return "{" + ", ".join(f"{b.name}: [{', '.join(r)}]" for b, r in reasons.items()) + "}"


class MetaxPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "metax"
    device_type: str = "cuda"
    dispatch_key: str = "CUDA"
    ray_device_key: str = "GPU"
    dist_backend: str = "nccl"
    device_control_env_var: str = "CUDA_VISIBLE_DEVICES"
    ray_noset_device_env_vars: list[str] = ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    # ------------------------------------------------------------------ device
    def is_cuda_alike(self) -> bool:
        return True

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        return _device_capability(device_id)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        """The name tuned configs are filed under (pymxsml's name on MetaX hosts)."""
        if device_id == 0:
            return detect_device().name
        return torch.cuda.get_device_name(device_id)

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return str(torch.cuda.get_device_properties(device_id).uuid)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return int(torch.cuda.get_device_properties(device_id).total_memory)

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return torch.cuda.get_device_properties(device_id).multi_processor_count

    @classmethod
    def device_count(cls) -> int:
        return torch.cuda.device_count()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.cuda.set_device(device)
        _ = torch.zeros(1, device=device)  # set the device eagerly (pytorch#155668)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.max_memory_allocated(device)

    @classmethod
    def get_all_gpu_pci_bus_ids(cls) -> dict[int, str]:
        """GPU index -> PCI bus id ("0000:3b:00.0"), from torch's device properties (no NVML on
        MetaX); vLLM maps GPUs to NUMA nodes and NICs with it."""
        out = {}
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            if not hasattr(p, "pci_bus_id"):
                raise RuntimeError("torch does not report PCI bus ids on this build")
            out[i] = (f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:"
                      f"{getattr(p, 'pci_device_id', 0):02x}.0")
        if not out:
            raise RuntimeError("no GPU visible to torch")
        return out

    @classmethod
    def is_fully_connected(cls, device_ids: list[int]) -> bool:
        return False  # no link query without a management library: assume none

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype):
        if dtype == torch.bfloat16 and not cls.has_device_capability(80):
            raise ValueError(f"bfloat16 needs compute capability 8.0 or newer; "
                             f"{cls.get_device_name()} has {cls.get_device_capability()}. "
                             "Use --dtype=half.")

    # ------------------------------------------------------------------ engine wiring
    @classmethod
    def import_kernels(cls) -> None:
        """Load vLLM's compiled ops (vllm._C_stable_libtorch, the MoE ops) or, on MetaX, the
        vendor's mcoplib first; one warning naming the ops serving needs that are still missing
        (the worker refuses to start without them: vllm_metax.worker)."""
        report = compiled_ops()
        if report.missing:
            logger.warning_once(missing_kernels_message(report))

    @classmethod
    def get_default_ir_op_priority(cls, vllm_config: "VllmConfig") -> "IrOpPriorityConfig":
        """CudaPlatform's provider order for vLLM's IR ops (rms_norm, fused_add_rms_norm): its
        compiled `vllm_c` kernels first where they are loaded and inductor does not compile, not
        the base platform's PyTorch code (vllm_metax.custom_ops)."""
        from vllm.config.compilation import CompilationMode    # lazy: see the imports
        from vllm.config.kernel import IrOpPriorityConfig

        from vllm_metax.custom_ops import ir_op_priority

        compiled_ops()                      # loaded, so the check below sees the kernels
        cc = vllm_config.compilation_config
        using_inductor = cc.backend == "inductor" and cc.mode != CompilationMode.NONE
        return IrOpPriorityConfig.with_default(["native"], **ir_op_priority(using_inductor))

    @classmethod
    def get_punica_wrapper(cls) -> str:
        return "vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU"

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        return "vllm.compilation.cuda_graph.CUDAGraphWrapper"

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return True

    @classmethod
    def use_custom_allreduce(cls) -> bool:
        return False  # vLLM's custom all-reduce is a compiled CUDA op

    @classmethod
    def supports_fp8(cls) -> bool:
        return False

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        pass  # the GPU model runner is vLLM's own CUDA one

    @classmethod
    def insert_blocks_to_device(cls, src_cache, dst_cache, src_block_indices, dst_block_indices):
        dst_cache[dst_block_indices] = src_cache[src_block_indices].to(dst_cache.device)

    @classmethod
    def swap_out_blocks_to_host(cls, src_cache, dst_cache, src_block_indices, dst_block_indices):
        dst_cache[dst_block_indices] = src_cache[src_block_indices].cpu()

    @classmethod
    def stateless_init_device_torch_dist_pg(cls, backend: str, prefix_store: "PrefixStore",
                                            group_rank: int, group_size: int,
                                            timeout: timedelta) -> "ProcessGroup":
        # lazy: a torch built without NCCL has no ProcessGroupNCCL (only this method needs it)
        from torch.distributed import ProcessGroup
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        pg = ProcessGroup(prefix_store, group_rank, group_size)
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        nccl = ProcessGroupNCCL(prefix_store, group_rank, group_size, options)
        pg._set_default_backend(ProcessGroup.BackendType.NCCL)
        nccl._set_sequence_number_for_group()
        pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl)
        return pg

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        """vLLM's check of unknown VLLM_* variables, knowing this plugin's own."""
        for env in os.environ:
            if env.startswith("VLLM_") and env not in envs.environment_variables \
                    and env not in OWN_ENV_VARS:
                if hard_fail:
                    raise ValueError(f"Unknown vLLM environment variable detected: {env}")
                logger.warning("Unknown vLLM environment variable detected: %s", env)

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        register_backends()

    # ------------------------------------------------------------------ configuration
    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        register_backends()
        target, why = profile_source()
        logger.info_once("vllm_metax: target profile %s (%s)", target.name, why)
        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER_CLASS
        cls._apply_tuned_block_size(vllm_config)
        cls._fit_flashinfer_autotune(vllm_config)

    @classmethod
    def _fit_flashinfer_autotune(cls, vllm_config: "VllmConfig") -> None:
        """vLLM's warmup autotunes FlashInfer's kernels on capability >= 9.0 through
        `flashinfer.autotuner.set_autotune_process_group`, which FlashInfer 0.2.x (MetaX's flat
        build) lacks: the engine would die at start. Off, in one line, where it is missing."""
        kernel_config = getattr(vllm_config, "kernel_config", None)
        why = flashinfer_autotune_missing()
        if kernel_config is None or why is None or kernel_config.enable_flashinfer_autotune is False:
            return
        kernel_config.enable_flashinfer_autotune = False
        logger.info_once("vllm_metax: FlashInfer autotune at warmup off: %s", why)

    @classmethod
    def tuned_entry_for_config(cls, vllm_config: "VllmConfig"):
        """The tuned-config entry this server runs with (None: untuned; `served_entry`)."""
        return served_entry(vllm_config)

    @classmethod
    def _apply_tuned_block_size(cls, vllm_config: "VllmConfig") -> None:
        cache_config = vllm_config.cache_config
        entry = cls.tuned_entry_for_config(vllm_config)
        if cache_config is None or entry is None:
            return
        if not cache_config.user_specified_block_size:
            cache_config.block_size = entry.page_size
        logger.info_once("vllm_metax MLA: KV cache block size %d %s", entry.page_size,
                         "(--block-size, as tuned)" if cache_config.user_specified_block_size
                         else "from the tuned config")

    @classmethod
    def _preferred_block_size_for_backends(cls, backend_classes: "list[type[AttentionBackend]]",
                                           default_block_size: int,
                                           vllm_config: "VllmConfig") -> int:
        # vLLM re-picks the block size after model load unless the user set one; keep the tuned
        # page size through that when every backend in use accepts it.
        entry = cls.tuned_entry_for_config(vllm_config)
        if entry is not None and all(b.supports_block_size(entry.page_size) for b in backend_classes):
            return entry.page_size
        return super()._preferred_block_size_for_backends(backend_classes, default_block_size,
                                                          vllm_config)

    # ------------------------------------------------------------------ attention selection
    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config: "MLAPrefillSelectorConfig"
                                    ) -> "type[MLAPrefillBackend]":
        """The first valid MLA prefill backend of MLA_PREFILL_ORDER; ValueError with every
        backend's reasons when none is."""
        register_backends()
        capability = cls.get_device_capability()
        invalid: dict = {}
        for name in MLA_PREFILL_ORDER:
            backend = MLAPrefillBackendEnum[name]
            try:
                backend_cls = backend.get_class()
                reasons = backend_cls.validate_configuration(capability, mla_selector_config)
            except (ImportError, OSError, AttributeError) as e:
                backend_cls, reasons = None, [f"{type(e).__name__}: {e}"]
            if not reasons:
                if invalid:
                    logger.info_once("vllm_metax: MLA prefill %s (skipped %s)",
                                     backend_cls.get_name(), _reasons_str(invalid))
                return backend_cls
            invalid[backend] = reasons
        raise ValueError(f"No valid MLA prefill backend found for {cls.device_name} with "
                         f"{mla_selector_config!r}. Reasons: {_reasons_str(invalid)}.")

    @classmethod
    def attention_priorities(cls, attn_selector_config: "AttentionSelectorConfig",
                             num_heads: int | None = None) -> tuple[list[AttentionBackendEnum], str]:
        """Backends to try, best first, and why this order."""
        if not attn_selector_config.use_mla:
            return [AttentionBackendEnum[n] for n in DEFAULT_ATTN_ORDER], "default order"
        entry = cls._tuned_entry_for_selection(attn_selector_config, num_heads)
        order, why = mla_backend_order(entry.backend_order if entry is not None else None)
        if entry is not None:
            why = f"{why} for {cls.get_device_name()}"
        order += [b for b in SPARSE_MLA_ORDER if b not in order]
        return [AttentionBackendEnum[n] for n in order], why

    @classmethod
    def _warn_tuned_skipped(cls, invalid: dict, chosen: AttentionBackendEnum,
                            attn_selector_config, num_heads) -> None:
        """One warning where backends the tuned config orders first cannot run here."""
        entry = cls._tuned_entry_for_selection(attn_selector_config, num_heads)
        tuned = set(entry.backend_order) if entry is not None else set()
        skipped = {b: r for b, r in invalid.items() if b.name in tuned}
        if skipped:
            logger.warning_once("vllm_metax MLA: the tuned config's %s cannot run here %s; using %s",
                                ", ".join(b.name for b in skipped), _reasons_str(skipped), chosen.name)

    @classmethod
    def _tuned_entry_for_selection(cls, attn_selector_config, num_heads):
        """The served entry for the model keyed with the dtypes vLLM selects a backend for."""
        from vllm.config import get_current_vllm_config_or_none    # lazy: see the imports

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None:
            return None
        return served_entry(vllm_config, num_heads, q_dtype=attn_selector_config.dtype,
                            kv_dtype=attn_selector_config.kv_cache_dtype)

    @classmethod
    def _invalid_reasons(cls, backend: AttentionBackendEnum, capability: DeviceCapability,
                         attn_selector_config) -> tuple[type | None, list[str]]:
        try:
            backend_cls = backend.get_class()
            return backend_cls, backend_cls.validate_configuration(
                device_capability=capability, **attn_selector_config._asdict())
        except (ImportError, OSError, AttributeError) as e:
            logger.debug("Attention backend %s is unavailable", backend.name, exc_info=True)
            return None, [f"{type(e).__name__}: {e}"]

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: AttentionBackendEnum | None,
                             attn_selector_config: "AttentionSelectorConfig",
                             num_heads: int | None = None) -> str:
        register_backends()
        capability = cls.get_device_capability() or DeviceCapability(0, 0)

        if selected_backend is not None:
            backend_cls, reasons = cls._invalid_reasons(selected_backend, capability,
                                                        attn_selector_config)
            if reasons:
                raise ValueError(f"Selected backend {selected_backend.name} is not valid for this "
                                 f"configuration. Reason: {reasons}")
            logger.info("Using %s backend.", selected_backend.name)
            return selected_backend.get_path()

        order, why = cls.attention_priorities(attn_selector_config, num_heads)
        invalid: dict = {}
        for backend in order:
            _, reasons = cls._invalid_reasons(backend, capability, attn_selector_config)
            if reasons:
                invalid[backend] = reasons
                continue
            if invalid:
                logger.debug("vllm_metax: skipped %s", _reasons_str(invalid))
                cls._warn_tuned_skipped(invalid, backend, attn_selector_config, num_heads)
            logger.info_once("Using %s attention backend (%s: %s).", backend.name, why,
                             ", ".join(b.name for b in order))
            return backend.get_path()
        raise ValueError(f"No valid attention backend found for {cls.device_name} with "
                         f"{attn_selector_config!r}. Reasons: {_reasons_str(invalid)}.")


@cache
def flashinfer_autotune_missing() -> str | None:
    """Why vLLM's FlashInfer autotune cannot run with the FlashInfer installed here (None: it can,
    or there is no FlashInfer, which vLLM checks itself)."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    try:
        # lazy: FlashInfer is optional, and a broken one must be an answer here, not an import error
        from flashinfer import autotuner
    except Exception as e:  # noqa: BLE001 - a broken install: vLLM's own import would fail too
        return f"flashinfer.autotuner does not import ({type(e).__name__}: {e})"
    if not hasattr(autotuner, "set_autotune_process_group"):
        import flashinfer

        return (f"FlashInfer {getattr(flashinfer, '__version__', '?')} has no "
                "flashinfer.autotuner.set_autotune_process_group, which vLLM 0.33's warmup calls")
    return None


@cache
def compiled_ops():
    """What this process loaded of vLLM's compiled ops (a vllm_metax.kernels.KernelReport)."""
    return load_compiled_ops(detect_device().is_metax)


@cache
def _device_capability(device_id: int) -> DeviceCapability | None:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major=major, minor=minor)
    cap = detect_device().capability
    return DeviceCapability(*cap) if cap else None
