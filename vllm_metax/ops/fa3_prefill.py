"""vLLM's FA3 varlen attention as an MLA prefill kernel (what vLLM's own FLASH_ATTN MLA prefill
backend runs on Hopper), without importing vllm: the `vllm_fa3` prefill backend value that the
tuner measures beside FlashInfer's fa2/fa3 ragged prefill and the plugin plans where a tuned
prefill bucket names it.

vLLM's FlashAttnPrefillBackend calls `flash_attn_varlen_func(q, k, v, cu_seqlens_q,
cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, return_softmax_lse, out,
fa_version=3)`; on Hopper FA3 takes MLA's different head dims (q/k 192, v 128) unpadded. That
wrapper reaches `torch.ops._vllm_fa3_C.fwd` with the positional arguments below (vLLM 0.33.0,
vllm/vllm_flash_attn/flash_attn_interface.py), the call made here. The library is the one the
`fa3_mla` decode op loads (`vllm_metax.ops.fa3_mla.load_library`).

The kernel object has the plan/run shape of `vllm_metax.ops.flashinfer_prefill.MLAPrefillKernel`
so the plugin's prefill backend and the tuner's prefill family plan either: `plan` takes the
index pointers (device or host; what FA3 reads must live on the device, so a host pointer is
copied there once per plan) and the longest query/KV span (computed from a host pointer when not
given); `run` attends. The LSE comes back as vLLM merges it ([heads, tokens], natural log,
`LSE_FORM = "vllm"`), where FlashInfer's is [tokens, heads], base 2.

Constraints: Hopper with vLLM's FA3 library (`vllm_metax.ops.fa3_mla.fa3_available`), bf16 or
fp16, q/k head dim 192 and v 128 (DeepSeek's MLA up-projection: the dims the plugin's prefill
serves).
"""

from __future__ import annotations

import torch

from vllm_metax.ops.fa3_mla import OP_NAMESPACE, fa3_available, load_library

BACKEND = "vllm_fa3"          # the prefill backend value (tuned config, tuner candidate)
LSE_FLASHINFER, LSE_VLLM = "flashinfer", "vllm"


def _span(indptr) -> int | None:
    """The longest segment of a host index pointer; None for a device tensor (a sync)."""
    if not isinstance(indptr, torch.Tensor) or indptr.device.type != "cpu":
        return None
    if indptr.numel() < 2:
        return 0
    return int((indptr[1:] - indptr[:-1]).max())


class FA3PrefillKernel:
    """vLLM's FA3 varlen forward planned for one prefill (the new tokens or one context chunk)."""

    LSE_FORM = LSE_VLLM
    backend = BACKEND

    def __init__(self, device: torch.device | str | None = None, fwd=None):
        """`fwd` stands in for `torch.ops._vllm_fa3_C.fwd` (CPU tests)."""
        if fwd is None:
            ok, why = fa3_available(device)
            if not ok:
                raise RuntimeError(why)
            fwd = getattr(torch.ops, OP_NAMESPACE).fwd
        self._fwd = fwd
        self.planned: dict | None = None

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_heads: int,
             head_dim_qk: int, head_dim_vo: int, causal: bool, sm_scale: float,
             q_dtype: torch.dtype, out_dtype: torch.dtype | None = None,
             max_q: int | None = None, max_kv: int | None = None,
             device: torch.device | None = None) -> None:
        """Keep one plan's index pointers (int32, on `device` or where they are) and spans."""
        if q_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"vLLM's FA3 prefill runs bf16 or fp16, not {q_dtype}")
        max_q = _span(qo_indptr) if max_q is None else int(max_q)
        max_kv = _span(kv_indptr) if max_kv is None else int(max_kv)
        if max_q is None or max_kv is None:
            raise ValueError("FA3 prefill needs the longest query and KV span: pass max_q/max_kv "
                             "with device index pointers")

        def placed(t):
            t = t.to(torch.int32)
            return t.to(device, non_blocking=True) if device is not None else t

        self.planned = dict(cu_q=placed(qo_indptr), cu_kv=placed(kv_indptr), max_q=max(max_q, 1),
                            max_kv=max(max_kv, 1), causal=bool(causal), sm_scale=float(sm_scale),
                            num_heads=num_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
            return_lse: bool = False):
        """q, k: [tokens, heads, head_dim_qk]; v: [tokens, heads, head_dim_vo] (last dim
        contiguous) -> out (, lse [heads, query tokens], natural log)."""
        p = self.planned
        if p is None:
            raise RuntimeError("FA3PrefillKernel.run before plan")
        o, lse, _, _ = self._fwd(
            q, k, v, None, None, None, out, p["cu_q"], p["cu_kv"], None, None, None,
            p["max_q"], p["max_kv"], None, None, None, None, None, None, None, None, None,
            p["sm_scale"], p["causal"], -1, -1, 0.0, True, None, 0, None, 0, None, 1, 0, None)
        return (o, lse) if return_lse else o


__all__ = ["BACKEND", "FA3PrefillKernel", "LSE_FLASHINFER", "LSE_VLLM", "fa3_available",
           "load_library"]
