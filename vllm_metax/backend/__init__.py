"""vLLM glue shared by the platform and the attention backends: a vLLM configuration -> the
tuned-config key of its model (`model_dims`) and the tuned entry it runs with (`served_entry`;
which entry that is, `vllm_metax.core.serving` decides). The backend classes live in this
package's modules, imported only when vLLM resolves them."""

from __future__ import annotations

import collections
import logging
import os

from vllm_metax.core import decisions, profile, serving, traffic
from vllm_metax.core.device import detect_device
from vllm_metax.core.log import get_logger, log_once
from vllm_metax.core.tuned_config import ModelDims, ModelEntry, load_tuned_config

logger = get_logger(__name__)


def model_dims(vllm_config, num_heads: int | None = None, *, q_dtype=None,
               kv_dtype=None) -> ModelDims | None:
    """The tuned-config key (`decisions.model_key`) of an MLA model served with this config, or
    None. `num_heads`: the heads a kernel sees (default: the model's per rank); `q_dtype`,
    `kv_dtype`: what the kernel is selected for (default: the model's dtype, the cache dtype)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None or not getattr(model_config, "use_mla", False):
        return None
    try:
        # lazy: `mla-tune prebuild` reads this package (served_modules) without vLLM
        from vllm.model_executor.layers.attention.mla_attention import get_mla_dims

        mla = get_mla_dims(model_config)
        if num_heads is None:
            num_heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
        if q_dtype is None:
            q_dtype = model_config.dtype
        if kv_dtype is None:
            kv_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        return decisions.model_key(num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, q_dtype,
                                   kv_dtype)
    except Exception as e:  # an odd model config must not stop vLLM: no tuned entry then
        logger.debug("vllm_metax MLA: cannot derive model dims: %s", e)
        return None


def user_block_size(vllm_config) -> int | None:
    """The KV block size the user fixed (--block-size), or None where the plugin may set it."""
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "user_specified_block_size", False):
        return getattr(cache, "block_size", None)
    return None


def served_entry(vllm_config, num_heads: int | None = None, *, q_dtype=None,
                 kv_dtype=None) -> ModelEntry | None:
    """The tuned entry a server runs with: `serving.entry_for` on this device's file (read once
    per process, `load_tuned_config`) for the model's key (`model_dims` of these arguments) and
    the user's --block-size. Says once, in the server log, which entry serves or why none does."""
    dims = model_dims(vllm_config, num_heads, q_dtype=q_dtype, kv_dtype=kv_dtype)
    if dims is None:
        return None
    cfg = load_tuned_config(detect_device().name)
    if cfg is None:
        return None
    served = serving.entry_for(cfg, dims, user_block_size(vllm_config))
    log_once(logger, logging.INFO if served.entry is not None else logging.WARNING,
             "vllm_metax MLA: %s", served.why)
    say_profile(cfg, served.entry)
    return served.entry


def say_profile(cfg, entry: ModelEntry | None) -> None:
    """Once per process: one warning where the config was tuned under another profile than the
    active one, and one line on the entry's choices the active profile cannot run (each such
    bucket is served with the device default)."""
    active = profile.active_profile()
    mismatch = profile.config_mismatch(cfg, active)
    if mismatch:
        log_once(logger, logging.WARNING, "vllm_metax MLA: %s", mismatch)
    refused = profile.unservable_choices(entry, active)
    if refused:
        whys = collections.Counter(why for _, _, why in refused)
        log_once(logger, logging.INFO, "vllm_metax MLA: %d bucket choices the %s target cannot run "
                 "are served with the device default: %s", len(refused), active.name,
                 "; ".join(f"{why} ({n} buckets)" for why, n in whys.most_common()))


def traffic_recorder(vllm_config, num_heads: int | None = None, *, kv_dtype=None):
    """This process's traffic recorder (`vllm_metax.core.traffic`) for the model a builder serves,
    or None: recording is off (`VLLM_METAX_TRAFFIC` unset), the model has no MLA key, or this
    process is not the first tensor- or pipeline-parallel rank of its replica (those ranks see
    the same steps; only one of them counts them)."""
    if not os.environ.get(traffic.TRAFFIC_ENV, "").strip():
        return None
    try:
        # lazy, as in model_dims
        from vllm.distributed.parallel_state import (get_pp_group, get_tensor_model_parallel_rank,
                                                     model_parallel_is_initialized)
        if model_parallel_is_initialized() and (get_tensor_model_parallel_rank() != 0
                                                or get_pp_group().rank_in_group != 0):
            return None
    except Exception as e:  # noqa: BLE001 - no parallel state (a test, a bench): this process records
        logger.debug("vllm_metax: no parallel state for the traffic recorder: %s", e)
    return traffic.recorder(model_dims(vllm_config, num_heads, kv_dtype=kv_dtype),
                            device_name=detect_device().name)
