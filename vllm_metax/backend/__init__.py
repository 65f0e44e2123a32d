"""vLLM glue shared by the platform and the attention backend: which tuned-config entry applies to a
vLLM configuration. The backend classes live in `vllm_metax.backend.flashinfer_mla` (imported only
when vLLM resolves them)."""

from __future__ import annotations

import logging

from vllm_metax import decisions
from vllm_metax.device import detect_device
from vllm_metax.log import get_logger, log_once
from vllm_metax.tuned_config import ModelDims, ModelEntry, load_tuned_config

logger = get_logger(__name__)

# MLA backends by priority when no tuned config decides. FLASHINFER_MLA is ours (wrapper-based
# fa2/fa3, runs on Hopper and MetaX); FLASHMLA and TRITON_MLA are what vLLM-metax ships.
DEFAULT_MLA_ORDER = ("FLASHINFER_MLA", "FLASHMLA", "TRITON_MLA")


def mla_backend_order(tuned_order: list[str] | None = None) -> tuple[list[str], str]:
    """The MLA backends to try, best first, and why: a tuned order first, the defaults after it
    (so a backend the tuned order lists that cannot run still has a fallback)."""
    if not tuned_order:
        return list(DEFAULT_MLA_ORDER), "default MLA order"
    return list(dict.fromkeys(list(tuned_order) + list(DEFAULT_MLA_ORDER))), "tuned config"


def model_dims(vllm_config, num_heads: int | None = None) -> ModelDims | None:
    """The tuned-config key of an MLA model served with this config (heads per rank), or None."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or not getattr(model_config, "use_mla", False):
        return None
    try:
        from vllm.model_executor.layers.attention.mla_attention import get_mla_dims

        mla = get_mla_dims(model_config)
        if num_heads is None:
            num_heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
        cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        return decisions.model_key(num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim,
                                   model_config.dtype, cache_dtype)
    except Exception as e:  # an odd model config must not stop vLLM: no tuned entry then
        logger.debug("vllm_metax MLA: cannot derive model dims: %s", e)
        return None


def describe_dims(dims: ModelDims) -> str:
    return (f"{dims.num_heads} heads, kv_lora_rank {dims.kv_lora_rank}, rope {dims.qk_rope_head_dim}, "
            f"{dims.q_dtype}/{dims.kv_dtype}")


def describe_entry(entry: ModelEntry) -> str:
    """One line: what a tuned entry sets (for the server log and `mla-tune doctor`)."""
    who = f"{entry.model} TP{entry.tp_size}" if entry.model else "no model named"
    decode = [b for b in entry.buckets if b.q_len == 1]
    split = sum(decisions.split_serves(b) is not None for b in decode)
    return (f"{describe_dims(entry.dims)} ({who}): KV page size {entry.page_size}, backend order "
            f"{' > '.join(entry.backend_order) or 'default'}, {len(entry.buckets)} decode buckets "
            f"({split} served by the split-KV kernel), {len(entry.prefill)} prefill buckets")


def served_entry(vllm_config, num_heads: int | None = None,
                 dims: ModelDims | None = None) -> ModelEntry | None:
    """The tuned entry a server runs with: this device's entry for the model's dims (`model_dims`,
    or `dims`), unless the KV block size in force was set with --block-size to another page size
    than the entry was tuned at; then none, and the server runs untuned. Says once, in the
    server log, which entry matched or why none serves (the file itself: `load_tuned_config`)."""
    dims = dims if dims is not None else model_dims(vllm_config, num_heads)
    if dims is None:
        return None
    cfg = load_tuned_config(detect_device().name)
    if cfg is None:
        return None
    entry = cfg.entry_for(dims)
    if entry is None:
        log_once(logger, logging.WARNING, "vllm_metax MLA: %s has no entry for this model (%s; it "
                 "has %s): serving untuned", cfg.path, describe_dims(dims),
                 "; ".join(describe_dims(m.dims) for m in cfg.models) or "none")
        return None
    cache = getattr(vllm_config, "cache_config", None)
    block = getattr(cache, "block_size", None)
    if getattr(cache, "user_specified_block_size", False) and block is not None \
            and block != entry.page_size:
        log_once(logger, logging.WARNING, "vllm_metax MLA: --block-size %d differs from the page "
                 "size %d the tuned config %s was measured at: serving untuned (drop --block-size "
                 "to use it)", block, entry.page_size, cfg.path)
        return None
    log_once(logger, logging.INFO, "vllm_metax MLA: tuned entry %s", describe_entry(entry))
    return entry


def tuned_entry(device_name: str, dims: ModelDims | None) -> ModelEntry | None:
    """The tuned entry for these dims on this device (the file is read once per process)."""
    if dims is None:
        return None
    cfg = load_tuned_config(device_name)
    return cfg.entry_for(dims) if cfg is not None else None


def device_backends() -> tuple[tuple[str, ...], str]:
    """(FlashInfer MLA backend values that may plan here, the default) for the visible device:
    `vllm_metax.decisions.flashinfer_backends`, the rule the tuner measures by too."""
    fb = flashinfer_backends()
    return fb.allowed, fb.default


def flashinfer_backends() -> decisions.FlashInferBackends:
    """This device's FlashInfer MLA backend values, default and fallback (`decisions`' rule)."""
    dev = detect_device()
    return decisions.flashinfer_backends(dev.is_metax, dev.capability)


def prefill_backends() -> decisions.FlashInferBackends:
    """This device's FlashInfer ragged-prefill backend values and default (`decisions`' rule)."""
    dev = detect_device()
    return decisions.prefill_backends(dev.is_metax, dev.capability)
