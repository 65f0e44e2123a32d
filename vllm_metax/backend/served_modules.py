"""Which FlashInfer JIT modules a tuned entry serves on a device (vllm-free): what `mla-tune
prebuild` builds ahead of the server, and what the plugin checks at start.

The backend values come from the functions the server chooses with, so the list cannot drift
from what it plans:

* decode: `PlanChoice.for_bucket` of every bucket (a bucket that a side kernel serves keeps its
  FlashInfer value: a step there falls back to it where the side kernel cannot run, e.g. q_len > 1
  for the split kernel, and a captured graph votes over every bucket of its batch size); an entry
  without buckets plans the device default;
* prefill: `decisions.prefill_backend` of every prefill bucket, and the device default (a plan
  whose size is not known on the host, vLLM's FA3 where the plan cannot take it); vLLM's FA3
  ships compiled and needs no module. Only entries whose dims the plugin's prefill serves
  (`ops.flashinfer_prefill.MLA_DIMS`) prefill through FlashInfer.

A refused backend's fallback (fa2 on Hopper) is not listed: it is built only where FlashInfer
refuses a value the device should run.
"""

from __future__ import annotations

import logging

from vllm_metax.backend.plan_choice import PlanChoice
from vllm_metax.core import decisions
from vllm_metax.core.log import get_logger, log_once
from vllm_metax.ops import device_backends
from vllm_metax.ops.flashinfer_jit import JIT_BACKENDS, JitModule, decode_module, prefill_module
from vllm_metax.ops.flashinfer_prefill import MLA_DIMS

logger = get_logger(__name__)


def decode_modules(entry, backends: decisions.FlashInferBackends,
                   choice: PlanChoice | None = None) -> list[JitModule]:
    """The FlashInfer MLA decode modules FLASHINFER_MLA may load serving `entry` (`choice`: the
    builder's own PlanChoice of it, else one is made, which warns about values it cannot serve)."""
    choice = choice or PlanChoice(entry, backends)
    values = {choice.for_bucket(b) for b in entry.buckets} or {backends.default}
    d = entry.dims
    return sorted(decode_module(v, d.q_dtype, d.kv_dtype, d.kv_lora_rank, d.qk_rope_head_dim)
                  for v in values if v in JIT_BACKENDS)


def prefill_modules(entry, backends: decisions.FlashInferBackends) -> list[JitModule]:
    """The FlashInfer ragged-prefill modules the plugin's MLA prefill may load serving `entry`."""
    nope, rope, v = MLA_DIMS
    if entry.dims.qk_rope_head_dim != rope:
        return []
    values = {decisions.prefill_backend(entry, b.causal, b.query_tokens, b.kv_len, backends)
              for b in entry.prefill} | {backends.default}
    return sorted(prefill_module(x, entry.dims.q_dtype, nope + rope, v)
                  for x in values if x in JIT_BACKENDS)


def entry_modules(entry, decode: decisions.FlashInferBackends,
                  prefill: decisions.FlashInferBackends, choice: PlanChoice | None = None) -> list[JitModule]:
    """Every FlashInfer JIT module a server of `entry` may load (decode first)."""
    return decode_modules(entry, decode, choice) + prefill_modules(entry, prefill)


def config_modules(entries, decode: decisions.FlashInferBackends,
                   prefill: decisions.FlashInferBackends) -> list[JitModule]:
    """The modules of every entry (a config serves the model it is started with: prebuild builds
    them all unless told the model), each once, in first-needed order."""
    return list(dict.fromkeys(m for e in entries for m in entry_modules(e, decode, prefill)))


def say_unbuilt(choice: PlanChoice, prefill: decisions.FlashInferBackends | None = None) -> list[JitModule]:
    """Once per process, at start: one INFO line naming the modules the decode builder's tuned
    entry (`choice`: its PlanChoice) serves that are not in FlashInfer's cache (each then compiles
    the first time a step needs it, in warm-up, graph capture or a request) and the command that
    builds them ahead. `prefill`: default the device's. Returns them; never raises."""
    try:
        prefill = prefill or device_backends.device_prefill_backends()
        missing = [m for m in entry_modules(choice.entry, choice.backends, prefill, choice)
                   if not m.built()]
    except Exception as e:  # noqa: BLE001 - a log line must never stop a server
        logger.debug("vllm_metax MLA: cannot check FlashInfer's JIT cache: %s", e)
        return []
    if missing:
        log_once(logger, logging.INFO, "vllm_metax MLA: %d FlashInfer module(s) this config serves "
                 "are not built yet (%s); each compiles (nvcc) when first needed: `mla-tune "
                 "prebuild` builds them ahead", len(missing), "; ".join(m.describe() for m in missing))
    return missing
