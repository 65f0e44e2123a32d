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
index pointers (what FA3 reads must live on the device: with `device`, a host pointer is copied
there once per plan) and the longest query and KV span, which vLLM's metadata carries on the host
(`max_query_len`, a context chunk's `max_seq_len`); `run` attends. The LSE comes back as vLLM
merges it ([heads, tokens], natural log, `LSE_FORM = "vllm"`), where FlashInfer's is [tokens,
heads], base 2.

Constraints: Hopper with vLLM's FA3 library (`vllm_metax.ops.fa3_mla.fa3_available`), bf16 or
fp16, q/k head dim 192 and v 128 (DeepSeek's MLA up-projection: the dims the plugin's prefill
serves).
"""

from __future__ import annotations

import torch

from vllm_metax.core.tuned_config import VLLM_FA3_PREFILL as BACKEND   # the prefill backend value
from vllm_metax.ops.fa3_mla import OP_NAMESPACE, fa3_available
from vllm_metax.ops.flashinfer_prefill import LSE_VLLM

DTYPES = (torch.bfloat16, torch.float16)      # what FA3's prefill runs


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
             q_dtype: torch.dtype, out_dtype: torch.dtype | None = None, *, max_q: int,
             max_kv: int, device: torch.device | None = None) -> None:
        """Keep one plan's index pointers (int32, on `device` or where they are) and spans; the
        head counts and dims are the tensors' own at run time."""
        if q_dtype not in DTYPES:
            raise ValueError(f"vLLM's FA3 prefill runs bf16 or fp16, not {q_dtype}")

        def placed(t):
            t = t.to(torch.int32)
            return t.to(device, non_blocking=True) if device is not None else t

        self.planned = dict(cu_q=placed(qo_indptr), cu_kv=placed(kv_indptr), max_q=max(int(max_q), 1),
                            max_kv=max(int(max_kv), 1), causal=bool(causal), sm_scale=float(sm_scale))

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


__all__ = ["BACKEND", "DTYPES", "FA3PrefillKernel", "fa3_available"]
