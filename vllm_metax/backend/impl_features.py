"""What the plugin's MLA attention impls (FLASHINFER_MLA's, FLASHMLA's) share: the layer features
their decode kernels do not compute, refused at construction in one NotImplementedError, the
context parallelism they do not run, and the planned decode step they read and check."""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.attention.backend import AttentionType


class FeatureCheckedImpl:
    """Mixin, listed before vLLM's `MLACommonImpl`: after vLLM's construction, refuses ALiBi, a
    sliding window, a logits soft-cap, attention other than decoder self-attention and a KV cache
    dtype outside `kv_cache_dtypes`, naming `backend_name`."""

    backend_name: ClassVar[str]
    kv_cache_dtypes: ClassVar[list]
    can_return_lse_for_decode: bool = True
    # Context parallelism has never run through these backends (DCP needs the sharded block table
    # and the cross-rank LSE combine, PCP the prefill split): vLLM's selector refuses both with
    # "DCP not supported" / "PCP not supported" rather than serving unverified output.
    supports_dcp: bool = False
    supports_pcp: bool = False

    @staticmethod
    def planned_decode(attn_metadata):
        """The decode part of a step's metadata, which the builder planned (a kernel to run)."""
        decode = attn_metadata.decode
        assert decode is not None and decode.kernel is not None, "decode step was not planned"
        return decode

    def check_planned(self, planned_scale: float, planned_page_size: int, kv_cache) -> None:
        """Refuse to run a step planned for another layer's softmax scale or another KV block
        size than the cache's (`kv_cache`: [pages, block size, ...])."""
        if planned_scale != self.scale:
            raise ValueError(f"the step was planned with softmax scale {planned_scale}, "
                             f"this layer's scale is {self.scale}")
        if kv_cache.shape[1] != planned_page_size:
            raise ValueError(f"{self.backend_name} planned KV block size {planned_page_size}, "
                             f"the cache pages hold {kv_cache.shape[1]}")

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                         **mla_args)
        name = self.backend_name
        unsupported = [n for n, v in (("alibi_slopes", alibi_slopes),
                                      ("sliding_window", sliding_window),
                                      ("logits_soft_cap", logits_soft_cap)) if v]
        if unsupported:
            raise NotImplementedError(f"{name} does not support {', '.join(unsupported)}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{name} implements decoder self-attention only")
        if kv_cache_dtype not in self.kv_cache_dtypes:
            raise NotImplementedError(f"{name} does not support kv_cache_dtype {kv_cache_dtype}")
