"""FLASHMLA for the vllm_metax platform: vLLM's FlashMLA backend (dense decode, KV block 64) whose
decode runs the plugin's op, `vllm_metax.ops.flashmla.FlashMLADecode` (what the tuner's flashmla
family measures).

vLLM's own FlashMLA builder and impl reach the kernel through `vllm.v1.attention.ops.flashmla`,
which loads `vllm._flashmla_C` only when `current_platform.is_cuda()`: on this out-of-tree
platform they report FlashMLA unavailable even on a Hopper GPU with the library installed. The
backend class here is vLLM's (name, block size 64, head size, capabilities), with a builder and
an impl over the plugin's op, which runs vLLM's library on Hopper and MetaX's `flash_mla` package
on a MetaX device (the library the vendor's vLLM-metax FLASHMLA backend calls).

Per decode step the builder marks the op's schedule stale (`new_step`); the step's first layer
computes FlashMLA's tile schedule from the sequence lengths and every later layer reuses it, as
vLLM's backend does with a fresh schedule per step. The platform chooses FLASHMLA where the tuned
config's backend order (or the profile's default order, `vllm_metax.core.profile`) names it and
`validate_configuration` passes: the op must find a library that runs here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.config import VllmConfig
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionLayer
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
from vllm.v1.attention.backends.utils import (
    reshape_attn_output_for_spec_decode,
    reshape_query_for_spec_decode,
)

from vllm_metax.backend import traffic_recorder
from vllm_metax.backend.builder import UniformDecodeBuilder
from vllm_metax.backend.impl_features import FeatureCheckedImpl
from vllm_metax.core import decisions
from vllm_metax.core.log import get_logger, log_once
from vllm_metax.ops import flashmla as op

logger = get_logger(__name__)


@dataclass
class MetaxFlashMLADecodeMetadata(MLACommonDecodeMetadata):
    """One decode step: every layer runs `kernel` (its schedule computed on the first layer)."""

    kernel: op.FlashMLADecode | None = None
    q_len: int = 1


@dataclass
class MetaxFlashMLAMetadata(MLACommonMetadata[MetaxFlashMLADecodeMetadata]):
    pass


class MetaxFlashMLAMetadataBuilder(UniformDecodeBuilder, MLACommonMetadataBuilder[MetaxFlashMLAMetadata]):
    reorder_batch_threshold: int = 128      # vLLM's FlashMLA value: small prefills decode
    # host lengths only for a recording server's traffic (a statistic: vLLM's upper bound serves)
    EXACT_HOST_LENGTHS: ClassVar[bool] = False

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, MetaxFlashMLAMetadata)
        if kv_cache_spec.block_size != op.PAGE_SIZE:
            raise ValueError(f"FLASHMLA needs KV block size {op.PAGE_SIZE}, "
                             f"got {kv_cache_spec.block_size}")
        layer = self.compilation_config.static_forward_context[layer_names[0]]
        self.sm_scale = float(layer.scale)          # the model's scale, YaRN mscale included
        self.page_size = kv_cache_spec.block_size
        self.kernel: op.FlashMLADecode | None = None
        self.traffic = traffic_recorder(vllm_config, self.num_heads)    # None unless asked

    def _op(self) -> op.FlashMLADecode:
        if self.kernel is None:
            # vLLM's FlashMLA passes causal=True (a no-op at q_len 1, the draft rows' mask above)
            self.kernel = op.FlashMLADecode(self.sm_scale, causal=True)
            log_once(logger, logging.INFO, "vllm_metax MLA: FLASHMLA decodes with %s (KV block %d)",
                     "vLLM's FlashMLA library" if self.kernel.library == op.VLLM_LIBRARY
                     else "the flash_mla package", self.page_size)
        return self.kernel

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor,
                      max_seq_len: int, query_start_loc_cpu: torch.Tensor,
                      query_start_loc_device: torch.Tensor, num_decode_tokens: int,
                      max_query_len: int,
                      dcp_tot_seq_lens_device: torch.Tensor | None) -> MetaxFlashMLADecodeMetadata:
        num_decodes = int(query_start_loc_cpu.shape[0]) - 1      # a Python int, never a tensor
        q_len, rest = divmod(int(num_decode_tokens), max(num_decodes, 1))
        if rest or q_len < 1:
            raise ValueError(f"FLASHMLA decodes uniform batches; got {num_decode_tokens} tokens over "
                             f"{num_decodes} requests")
        if self.traffic is not None:       # what a tuned FLASHINFER_MLA would look this step up by
            self.traffic.decode(num_decodes, decisions.bucket_context(
                self._host_seq_lens(seq_lens_device, num_decodes)), q_len)
        kernel = self._op()
        kernel.new_step()                  # the step's first layer schedules these lengths
        return MetaxFlashMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                           dcp_tot_seq_lens=dcp_tot_seq_lens_device, kernel=kernel,
                                           q_len=q_len)


class MetaxFlashMLABackend(FlashMLABackend):
    """FLASHMLA (vLLM's name, block size 64, head sizes) over the plugin's FlashMLA op."""

    # the op runs FlashMLA's dense 16-bit kernel; its fp8 path needs scales this impl does not pass
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_builder_cls() -> type[MetaxFlashMLAMetadataBuilder]:
        return MetaxFlashMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[MetaxFlashMLAImpl]:
        return MetaxFlashMLAImpl

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # MetaX reports its own capability numbers: whether FlashMLA runs is the op's answer
        return True

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                             use_sparse, use_mm_prefix, device_capability) -> str | None:
        if use_sparse:
            return "sparse FlashMLA is not served by the plugin (FLASHMLA_SPARSE is vLLM's)"
        ok, why = op.flashmla_available()
        return None if ok else why


class MetaxFlashMLAImpl(FeatureCheckedImpl, MLACommonImpl[MetaxFlashMLAMetadata]):
    backend_name = "FLASHMLA"                        # what FeatureCheckedImpl refuses names
    kv_cache_dtypes = MetaxFlashMLABackend.supported_kv_cache_dtypes

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MetaxFlashMLAMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
        decode = self.planned_decode(attn_metadata)
        self.check_planned(decode.kernel.softmax_scale, op.PAGE_SIZE, kv_c_and_k_pe_cache)
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        num_decodes = decode.block_table.shape[0]
        q = reshape_query_for_spec_decode(q, num_decodes)          # [B, q_len, H, 576]
        o, lse = decode.kernel.run(q, kv_c_and_k_pe_cache, decode.block_table, decode.seq_lens)
        o = reshape_attn_output_for_spec_decode(o)                  # [B * q_len, H, 512]
        if self.need_to_return_lse_for_decode:
            # FlashMLA's LSE is [B, H, q_len]; its consumers take [tokens, H]
            b, h, s = lse.shape
            lse = lse.permute(0, 2, 1).reshape(b * s, h).contiguous()
        return o, lse
