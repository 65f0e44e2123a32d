"""vllm-free MLA prefill op: FlashInfer's ragged-KV prefill (`BatchPrefillWithRaggedKVCacheWrapper`)
planned for MLA's up-projected heads (q/k: qk_nope + qk_rope, v: v_head_dim).

MLA prefill is plain multi-head attention over the tokens of the prompt (causal) and over chunks
of already cached context (non-causal, merged by the caller through the LSE). Both FlashInfer API
forms the plugin supports (0.7.x `flashinfer-python`, MetaX's 0.2.6-based `flashinfer`) take the
same keyword `plan()`; the 0.2.x line has no `o_data_type`, so that argument is passed only where
the signature has it. The LSE comes back as FlashInfer writes it: [tokens, heads], base 2.
"""

from __future__ import annotations

import functools
import inspect

import torch

from vllm_metax.core.log import get_logger
from vllm_metax.ops.flashinfer_mla import BackendRefused, FlashInferUnavailable, is_refusal

logger = get_logger(__name__)

PREFILL_BACKENDS = ("fa2", "fa3", "auto")    # what the ragged wrapper accepts on Hopper / MetaX
# The MLA dims the plugin's prefill serves (qk_nope, qk_rope, v): DeepSeek's MLA (V2, V2-Lite, V3,
# R1, Kimi-K2) up-projects to 128 nope + 64 rope and 128-wide values; the ragged prefill compiles a
# module per (head_dim_qk, head_dim_vo), so one module per backend and dtype serves them all.
MLA_DIMS = (128, 64, 128)
# the LSE form a prefill kernel returns (its LSE_FORM): FlashInfer's [tokens, heads] in base 2, or
# vLLM's [heads, tokens] in natural log (vllm_metax.ops.fa3_prefill), what vLLM merges chunks by
LSE_FLASHINFER, LSE_VLLM = "flashinfer", "vllm"


@functools.lru_cache(maxsize=1)
def ragged_wrapper_cls() -> type:
    """FlashInfer's ragged prefill wrapper class; raises FlashInferUnavailable."""
    try:
        # lazy: FlashInfer is optional, and a broken install must be an answer, not an import error
        from flashinfer import BatchPrefillWithRaggedKVCacheWrapper
    except Exception as e:  # a broken install raises more than ImportError
        raise FlashInferUnavailable(
            f"cannot import flashinfer.BatchPrefillWithRaggedKVCacheWrapper: {type(e).__name__}: {e}"
        ) from None
    return BatchPrefillWithRaggedKVCacheWrapper


def prefill_available() -> tuple[bool, str]:
    try:
        ragged_wrapper_cls()
    except FlashInferUnavailable as e:
        return False, str(e)
    return True, "flashinfer ragged prefill"


@functools.lru_cache(maxsize=None)
def _plan_params(wrapper_cls: type) -> frozenset:
    return frozenset(inspect.signature(wrapper_cls.plan).parameters)


class MLAPrefillKernel:
    """One ragged prefill wrapper: plan once per step (or per context chunk), run per layer."""

    LSE_FORM = LSE_FLASHINFER

    def __init__(self, workspace: torch.Tensor, backend: str = "fa2", wrapper_cls: type | None = None):
        self.wrapper_cls = wrapper_cls or ragged_wrapper_cls()
        self.backend = backend
        self.workspace = workspace
        self.wrapper = self.wrapper_cls(workspace, "NHD", backend=backend)
        self.planned: dict | None = None

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_heads: int,
             head_dim_qk: int, head_dim_vo: int, causal: bool, sm_scale: float,
             q_dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> None:
        """Plan one batch; raises BackendRefused when FlashInfer declines this backend/shape."""
        kwargs = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, num_qo_heads=num_heads,
                      num_kv_heads=num_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
                      causal=causal, sm_scale=sm_scale, q_data_type=q_dtype, kv_data_type=q_dtype)
        if out_dtype is not None and "o_data_type" in _plan_params(self.wrapper_cls):
            kwargs["o_data_type"] = out_dtype
        try:
            self.wrapper.plan(**kwargs)
        except Exception as e:
            if is_refusal(e):
                raise BackendRefused(self.backend, str(e)) from e
            raise
        self.planned = dict(num_heads=num_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
                            causal=causal, sm_scale=sm_scale)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
            return_lse: bool = False):
        """q, k: [tokens, heads, head_dim_qk]; v: [tokens, heads, head_dim_vo] -> out (, lse)."""
        if self.planned is None:
            raise RuntimeError("MLAPrefillKernel.run before plan")
        return self.wrapper.run(q, k, v, out=out, return_lse=return_lse)
