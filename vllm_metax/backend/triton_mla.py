"""TRITON_MLA with tuned KV chunking: vLLM's Triton MLA backend, num_kv_splits from the tuned config.

vLLM's TritonMLAImpl picks num_kv_splits with a fixed rule (next_power_of_2(max_seq_len // 512),
capped at 2 x SM count), too coarse at small batch. Here the metadata builder (once per step, the
"plan") looks the decode batch up in the tuned config's Triton choices (by the mean sequence
length, `vllm_metax.core.decisions.bucket_context`, as for FlashInfer and as the tuner measured) and
records num_kv_splits in the decode metadata; the impl hands that to vLLM's own forward_mqa. Where
the bucket kept vLLM's rule (`"rule": "vllm"`), and on a miss (no config, no entry for these dims,
no Triton choice in the bucket, a context more than 2x from the nearest tuned one:
`decisions.triton_choice`), the metadata carries None and vLLM's rule applies unchanged, for the
batch's own max_seq_len.

vLLM computes the split count inside forward_mqa through its module function
`_compute_num_kv_splits`; this module wraps that function once so that, only while one of our
forward_mqa calls runs, it answers the tuned value. Everything else in forward_mqa (workspace,
q_len > 1 rows, DCP, batch invariance, which forces 1 split) stays vLLM's.
"""

from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass

import torch

import vllm.v1.attention.backends.mla.triton_mla as _vllm_triton_mla
from vllm.model_executor.layers.attention.mla_attention import MLACommonDecodeMetadata
from vllm.v1.attention.backend import max_decode_query_len
from vllm.v1.attention.backends.mla.triton_mla import (
    TritonMLABackend,
    TritonMLAImpl,
    TritonMLAMetadataBuilder,
)
from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

from vllm_metax.backend import model_dims, traffic_recorder, user_block_size
from vllm_metax.backend.builder import HostLengthsBuilder
from vllm_metax.core import choices, decisions, serving
from vllm_metax.core.device import detect_device
from vllm_metax.core.log import get_logger, log_once
from vllm_metax.core.profile import active_profile
from vllm_metax.core.tuned_config import ModelDims, ModelEntry, load_tuned_config
from vllm_metax.ops import triton_launch

logger = get_logger(__name__)

# ------------------------------------------------------------------ the split-count hook

_TUNED_SPLITS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "vllm_metax_triton_mla_num_kv_splits", default=None)


def _install_split_hook():
    """Wrap vLLM's `_compute_num_kv_splits` once; returns vLLM's original rule."""
    current = _vllm_triton_mla._compute_num_kv_splits
    original = getattr(current, "__wrapped__", current)

    def _compute_num_kv_splits(max_seq_len: int, sm_count: int) -> int:
        tuned = _TUNED_SPLITS.get()
        return original(max_seq_len, sm_count) if tuned is None else tuned

    _compute_num_kv_splits.__wrapped__ = original
    _vllm_triton_mla._compute_num_kv_splits = _compute_num_kv_splits
    return original


vllm_num_kv_splits = _install_split_hook()

# The launch variant (`choices.TRITON_VARIANTS`) of the forward_mqa call in progress: vLLM's own
# `decode_attention_fwd` ("vllm"), or vLLM's kernels launched with a vendor's settings
# (`vllm_metax.ops.triton_launch`), wrapped like the split count.
_VARIANT: contextvars.ContextVar[str] = contextvars.ContextVar(
    "vllm_metax_triton_mla_variant", default=choices.DEFAULT_TRITON_VARIANT)


def _install_launch_hook():
    """Wrap the `decode_attention_fwd` vLLM's TRITON_MLA module calls once; returns vLLM's."""
    current = _vllm_triton_mla.decode_attention_fwd
    original = getattr(current, "__wrapped__", current)

    def decode_attention_fwd(*args, **kwargs):
        variant = _VARIANT.get()
        if variant == choices.DEFAULT_TRITON_VARIANT:
            return original(*args, **kwargs)
        return triton_launch.decode_attention_fwd(*args, variant=variant, **kwargs)

    decode_attention_fwd.__wrapped__ = original
    _vllm_triton_mla.decode_attention_fwd = decode_attention_fwd
    return original


vllm_decode_attention_fwd = _install_launch_hook()


# ------------------------------------------------------------------ tuned choice per step

dtype_name = decisions.dtype_name


class TunedSplits:
    """num_kv_splits per decode batch from one model entry of the tuned config (None: vLLM's rule),
    and the launch variant of each (`launch`; untuned: the active profile's default)."""

    def __init__(self, entry: ModelEntry | None, why: str = ""):
        self.entry = entry
        self.why = why
        self.max_splits = max(self._values(), default=None)
        self.default_variant = active_profile().triton_default
        self.variants = decisions.triton_variants(entry)
        self._memo: tuple | None = None
        self._launch_memo: tuple | None = None

    def _values(self):
        for b in (self.entry.buckets if self.entry else ()):
            choice = decisions.bucket_choice(b, choices.TRITON)
            if choice is not None and choice.served_splits is not None:
                yield choice.served_splits

    @classmethod
    def load(cls, dims: ModelDims | None, device_name: str | None = None,
             block_size: int | None = None) -> "TunedSplits":
        """The Triton choices of the entry this device's tuned config (read once per process)
        serves for these dims and the user's --block-size (`serving.entry_for`)."""
        if dims is None:
            return cls(None, "vLLM's config gives no MLA model dims")
        device_name = device_name or detect_device().name
        cfg = load_tuned_config(device_name)
        if cfg is None:
            return cls(None, f"no tuned config for {device_name!r}")
        served = serving.entry_for(cfg, dims, block_size)
        if served.entry is None:
            return cls(None, served.why)
        entry = served.entry
        out = cls(entry, f"{cfg.path}")
        if out.max_splits is None:
            out.why = f"{cfg.path}: the entry for {dims} has no Triton choices but vLLM's rule"
        return out

    def choose(self, batch_size: int, context_len: int, q_len: int = 1) -> int | None:
        """The tuned num_kv_splits for this decode batch, or None to keep vLLM's rule (a bucket
        that kept vLLM's rule, or a miss). `context_len` is `decisions.bucket_context` of the
        batch's sequence lengths, as for FlashInfer."""
        if self.max_splits is None or batch_size < 1:
            return None
        key = (batch_size, context_len, q_len)
        if self._memo is not None and self._memo[0] == key:   # every layer of a step asks the same
            return self._memo[1]
        n = self._lookup(batch_size, context_len, q_len)
        self._memo = (key, n)
        return n

    def _lookup(self, batch_size: int, context_len: int, q_len: int) -> int | None:
        choice = self._choice(batch_size, context_len, q_len)
        return choice.served_splits if choice is not None else None

    def _choice(self, batch_size: int, context_len: int, q_len: int):
        """The nearest bucket's TritonChoice, or None (no entry, or too far in context:
        `decisions.triton_choice`)."""
        return decisions.triton_choice(self.entry, batch_size, context_len, q_len)

    def launch(self, batch_size: int, context_len: int, q_len: int = 1) -> str:
        """The launch variant for this decode batch (`decisions.triton_launch`): the entry's where
        it names one launch only (no lookup), else the nearest bucket's, else (a miss) the
        profile's default."""
        key = (batch_size, context_len, q_len)
        if self._launch_memo is None or self._launch_memo[0] != key:
            self._launch_memo = (key, decisions.triton_launch(self.entry, *key, self.default_variant,
                                                              self.variants))
        return self._launch_memo[1]


def reserve_tuned_workspace(max_decode_rows: int, q_num_heads: int, kv_lora_rank: int,
                            max_splits: int | None) -> None:
    """Grow vLLM's shared workspace so attn_logits fit the largest tuned split count.

    vLLM reserves for its own rule at max_model_len and locks the workspace after warm-up; a
    tuned count above that would otherwise fail at the first large-split step.
    """
    if not max_splits or not is_workspace_manager_initialized():
        return
    current_workspace_manager().get_simultaneous(
        ((max_decode_rows, q_num_heads, max_splits, kv_lora_rank + 1), torch.float32),
    )


# ------------------------------------------------------------------ the backend trio

@dataclass
class MetaxTritonMLADecodeMetadata(MLACommonDecodeMetadata):
    num_kv_splits: int | None = None      # None: vLLM's rule
    variant: str = choices.DEFAULT_TRITON_VARIANT     # the kernels' launch


class MetaxTritonMLAMetadataBuilder(HostLengthsBuilder, TritonMLAMetadataBuilder):
    EXACT_HOST_LENGTHS = False     # only a bucket lookup statistic: vLLM's upper bound serves

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        heads = self.num_heads * self.dcp_world_size      # forward_mqa sees DCP-gathered heads
        dims = model_dims(vllm_config, heads, kv_dtype=getattr(kv_cache_spec, "dtype", None))
        self.tuned_splits = TunedSplits.load(dims, block_size=user_block_size(vllm_config))
        self.traffic = traffic_recorder(vllm_config, heads, kv_dtype=getattr(kv_cache_spec, "dtype", None))
        if self.tuned_splits.max_splits is None:
            log_once(logger, logging.INFO, "vllm_metax TRITON_MLA: vLLM's num_kv_splits rule (%s)",
                     self.tuned_splits.why)
        else:
            log_once(logger, logging.INFO, "vllm_metax TRITON_MLA: tuned num_kv_splits from %s",
                     self.tuned_splits.why)
        launches = sorted(self.tuned_splits.variants | {self.tuned_splits.default_variant})
        if launches != [choices.DEFAULT_TRITON_VARIANT]:
            log_once(logger, logging.INFO, "vllm_metax TRITON_MLA: kernel launch %s (untuned: %s)",
                     " / ".join(launches), self.tuned_splits.default_variant)
        reserve_tuned_workspace(vllm_config.scheduler_config.max_num_seqs * self.reorder_batch_threshold,
                                heads, self.mla_dims.kv_lora_rank, self.tuned_splits.max_splits)

    def _build_decode(
        self,
        block_table_tensor: torch.Tensor,
        seq_lens_device: torch.Tensor,
        max_seq_len: int,
        query_start_loc_cpu: torch.Tensor,
        query_start_loc_device: torch.Tensor,
        num_decode_tokens: int,
        max_query_len: int,
        dcp_tot_seq_lens_device: torch.Tensor | None,
    ) -> MetaxTritonMLADecodeMetadata:
        num_decodes = block_table_tensor.shape[0]
        q_len = max(1, num_decode_tokens // max(num_decodes, 1))
        splits, variant = self._tuned_splits_for(seq_lens_device, num_decodes, q_len)
        return MetaxTritonMLADecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            num_kv_splits=splits,
            variant=variant,
        )

    def _tuned_splits_for(self, seq_lens_device, num_decodes: int, q_len: int) -> tuple:
        """(num_kv_splits or None for vLLM's rule, launch variant) of this decode batch."""
        tuned = self.tuned_splits
        no_lookup = num_decodes < 1 or (tuned.max_splits is None and len(tuned.variants) <= 1)
        if no_lookup and (self.traffic is None or num_decodes < 1):
            return None, tuned.launch(num_decodes, 1, q_len)   # no lookup: no host lengths needed
        context = decisions.bucket_context(self._host_seq_lens(seq_lens_device, num_decodes))
        if self.traffic is not None:
            self.traffic.decode(num_decodes, context, q_len)     # the key the lookup is asked
        if no_lookup:
            return None, tuned.launch(num_decodes, 1, q_len)
        return (tuned.choose(num_decodes, context, q_len),
                tuned.launch(num_decodes, context, q_len))


class MetaxTritonMLAImpl(TritonMLAImpl):
    def reserve_workspace(self) -> None:
        super().reserve_workspace()
        cfg = self._vllm_config
        heads = self.num_heads * self.dcp_world_size
        dims = model_dims(cfg, heads, kv_dtype=self.kv_cache_dtype)
        reserve_tuned_workspace(cfg.scheduler_config.max_num_seqs * max_decode_query_len(cfg), heads,
                                self.kv_lora_rank,
                                TunedSplits.load(dims, block_size=user_block_size(cfg)).max_splits)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        splits = getattr(attn_metadata.decode, "num_kv_splits", None)
        variant = getattr(attn_metadata.decode, "variant", choices.DEFAULT_TRITON_VARIANT)
        tokens = (_TUNED_SPLITS.set(splits), _VARIANT.set(variant))
        try:
            return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        finally:
            _VARIANT.reset(tokens[1])
            _TUNED_SPLITS.reset(tokens[0])


class MetaxTritonMLABackend(TritonMLABackend):
    """TRITON_MLA (same name, block sizes and capabilities) with tuned num_kv_splits."""

    @staticmethod
    def get_impl_cls() -> type[MetaxTritonMLAImpl]:
        return MetaxTritonMLAImpl

    @staticmethod
    def get_builder_cls() -> type[MetaxTritonMLAMetadataBuilder]:
        return MetaxTritonMLAMetadataBuilder
