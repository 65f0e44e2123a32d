"""What the plugin's MLA metadata builders share (FLASHINFER_MLA's, FLASHMLA's, TRITON_MLA's):
vLLM's common attention metadata kept through `build` for `_build_decode`, and from it the decode
rows' lengths on the host; the uniform decode batches of FLASHINFER_MLA and FLASHMLA.

vLLM's `MLACommonMetadataBuilder.build` hands `_build_decode` the device sequence lengths only
(each rank's own under decode context parallelism); both builders decide on host lengths. The
one difference is kept explicit: FLASHINFER_MLA plans the step from them, so they must be exact
(`EXACT_HOST_LENGTHS`), and vLLM's host upper bound is exact only without speculative tokens;
TRITON_MLA only looks a bucket up by their mean, where the bound's few drafts are nothing on a
log2 scale.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
from vllm.v1.attention.backend import AttentionCGSupport


class HostLengthsBuilder:
    """Mixin for a subclass of vLLM's `MLACommonMetadataBuilder` (listed before it)."""

    # whether `_host_seq_lens` must be exact (each builder says; see the module docstring)
    EXACT_HOST_LENGTHS: ClassVar[bool]
    _common = None               # the CommonAttentionMetadata of the `build` in progress
    traffic = None               # the step recorder where VLLM_METAX_TRAFFIC asks (`traffic_recorder`)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        self._common = common_attn_metadata
        try:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        finally:
            self._common = None

    def _host_seq_lens(self, seq_lens_device: torch.Tensor, num_decodes: int) -> torch.Tensor:
        """The decode rows' lengths on the host, matching `seq_lens_device`: vLLM's host upper
        bound (each rank's own under decode context parallelism) where it may be used, else one
        device copy (a sync, as vLLM's own FlashInfer backend makes)."""
        common = self._common
        lens = None
        if common is not None and not (self.EXACT_HOST_LENGTHS and self._speculative_tokens()):
            lens = (common.dcp_local_seq_lens_cpu_upper_bound if self.dcp_world_size > 1
                    else common.seq_lens_cpu_upper_bound)
        if lens is None:
            return seq_lens_device[:num_decodes].to("cpu")
        return lens if lens.shape[0] == num_decodes else lens[:num_decodes]

    def _speculative_tokens(self) -> int:
        """Draft tokens per request a step may carry (vLLM's upper bound counts them)."""
        spec = self.vllm_config.speculative_config
        return (spec.num_speculative_tokens or 0) if spec is not None else 0


class UniformDecodeBuilder(HostLengthsBuilder):
    """HostLengthsBuilder for the builders whose decode runs uniform batches (FLASHINFER_MLA's,
    FLASHMLA's): every request of a step has the same query length, and a uniform batch replays
    as a full CUDA graph."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
