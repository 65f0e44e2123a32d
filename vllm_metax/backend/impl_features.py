"""What the plugin's MLA attention impls (FLASHINFER_MLA's, FLASHMLA's) refuse at construction:
the layer features their decode kernels do not compute, named in one NotImplementedError."""

from __future__ import annotations

from typing import ClassVar

from vllm.v1.attention.backend import AttentionType


class FeatureCheckedImpl:
    """Mixin, listed before vLLM's `MLACommonImpl`: after vLLM's construction, refuses ALiBi, a
    sliding window, a logits soft-cap, attention other than decoder self-attention and a KV cache
    dtype outside `kv_cache_dtypes`, naming `backend_name`."""

    backend_name: ClassVar[str]
    kv_cache_dtypes: ClassVar[list]

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
