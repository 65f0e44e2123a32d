"""MLA prefill inputs and an independent float64 reference, shared by the CPU and GPU prefill tests.

A prefill batch is what vLLM's MLA layer hands its prefill backend: ragged [tokens, heads, dim]
q/k/v for the new tokens (causal within each request), or for one context chunk (the request's
queries against its cached context, no mask), with CSR index pointers per request.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

HEADS, NOPE, ROPE, V_DIM, KV_LORA = 16, 128, 64, 128, 512


def ragged(lens, heads=HEADS, dim=NOPE + ROPE, seed=0, device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lens), heads, dim, generator=g).to(device=device, dtype=dtype)


def indptr(lens, device="cpu") -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    return out.to(device)


def reference(q, k, v, q_lens, kv_lens, scale, causal):
    """float64 attention per request; returns (out [T, H, V], lse [H, T] natural log). With
    causal=True query i of a request sees keys 0..i + (kv_len - q_len) (vLLM's prefix alignment)."""
    outs, lses = [], []
    qs = ks = 0
    for ql, kl in zip(q_lens, kv_lens):
        qq = q[qs:qs + ql].double().transpose(0, 1)
        kk = k[ks:ks + kl].double().transpose(0, 1)
        vv = v[ks:ks + kl].double().transpose(0, 1)
        s = qq @ kk.transpose(-1, -2) * scale
        if causal:
            allowed = torch.ones(ql, kl, dtype=torch.bool, device=q.device).tril(kl - ql)
            s = s.masked_fill(~allowed, -math.inf)
        lses.append(torch.logsumexp(s, -1))
        outs.append((s.softmax(-1) @ vv).transpose(0, 1))
        qs, ks = qs + ql, ks + kl
    return torch.cat(outs), torch.cat(lses, 1)


def prefill_metadata(q_lens, device, chunk_kv_lens=None, dtype=torch.bfloat16, chunks=None):
    """The fields of vLLM's MLACommonPrefillMetadata a prefill backend reads, with one context
    chunk whose per-request context lengths are `chunk_kv_lens` (or one chunk per list in
    `chunks`). Each chunk carries vLLM's host fields (token_slice, num_context_tokens,
    request_slice, max_query_len, max_seq_len, seq_lens) beside its device index pointers, as vLLM 0.33.0's
    ContextChunk does."""
    chunked = None
    if chunk_kv_lens is not None:
        chunks = [chunk_kv_lens]
    if chunks is not None:
        chunked = SimpleNamespace(chunks=[SimpleNamespace(
            index=i, query_start_loc=indptr(q_lens, device), cu_seq_lens=indptr(kv, device),
            token_slice=slice(0, sum(q_lens)), num_context_tokens=sum(kv),
            request_slice=slice(0, len(q_lens)), max_query_len=max(q_lens), max_seq_len=max(kv),
            seq_lens=torch.tensor(kv, dtype=torch.int32))
            for i, kv in enumerate(chunks)])
    return SimpleNamespace(query_start_loc=indptr(q_lens, device),
                           query_lens_cpu=torch.tensor(q_lens, dtype=torch.int32),
                           max_query_len=max(q_lens), q_data_type=dtype, output_dtype=dtype,
                           chunked_context=chunked)


def scale() -> float:
    return (NOPE + ROPE) ** -0.5


class RecordingRaggedWrapper:
    """Stand-in for FlashInfer's BatchPrefillWithRaggedKVCacheWrapper on the CPU: records plan(),
    computes with the float64 reference from exactly the planned index pointers, and returns the
    LSE as FlashInfer does ([tokens, heads], base 2). `refuse` makes plan() refuse that backend."""

    instances: list = []
    refuse: set = set()

    def __init__(self, workspace, layout, backend="auto"):
        self.backend, self.plans = backend, []
        RecordingRaggedWrapper.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             causal=False, sm_scale=None, q_data_type=None, kv_data_type=None, o_data_type=None):
        if self.backend in self.refuse:
            raise ValueError(f"{self.backend} is not supported on this device")
        self.plans.append(dict(qo=qo_indptr.clone(), kv=kv_indptr.clone(), heads=num_qo_heads,
                               kv_heads=num_kv_heads, qk=head_dim_qk, vo=head_dim_vo, causal=causal,
                               scale=sm_scale, q_dtype=q_data_type, o_dtype=o_data_type))

    def run(self, q, k, v, out=None, lse=None, return_lse=False):
        p = self.plans[-1]
        qo, kv = p["qo"].tolist(), p["kv"].tolist()
        q_lens = [b - a for a, b in zip(qo, qo[1:])]
        kv_lens = [b - a for a, b in zip(kv, kv[1:])]
        o, lse_e = reference(q, k, v, q_lens, kv_lens, p["scale"], p["causal"])
        o = o.to(q.dtype)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, (lse_e / torch.log(torch.tensor(2.0, dtype=torch.float64))).T.float()) if return_lse else o


class RecordingFA3Fwd:
    """Stand-in for vLLM's `torch.ops._vllm_fa3_C.fwd` on the CPU, called with the positional
    arguments vLLM's flash_attn_varlen_func passes (fa_version=3): records each call's index
    pointers, spans and mask, computes with the float64 reference from exactly those pointers,
    and returns the LSE as FA3 does ([heads, tokens], natural log)."""

    def __init__(self):
        self.calls: list = []

    def __call__(self, q, k, v, k_new, v_new, q_v, out, cu_q, cu_k, cu_k_new, seqused_q, seqused_k,
                 max_q, max_k, block_table, *rest):
        softmax_scale, causal = rest[8], rest[9]
        assert q_v is None and block_table is None and seqused_k is None
        self.calls.append(dict(cu_q=cu_q.clone(), cu_k=cu_k.clone(), max_q=max_q, max_k=max_k,
                               causal=causal, scale=softmax_scale))
        qo, kv = cu_q.tolist(), cu_k.tolist()
        q_lens = [b - a for a, b in zip(qo, qo[1:])]
        kv_lens = [b - a for a, b in zip(kv, kv[1:])]
        assert max(q_lens) <= max_q and max(kv_lens) <= max_k
        o, lse = reference(q, k, v, q_lens, kv_lens, softmax_scale, causal)
        o = o.to(q.dtype)
        if out is not None:
            out.copy_(o)
            o = out
        return o, lse.float(), None, None
