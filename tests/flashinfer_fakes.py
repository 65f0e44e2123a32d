"""Stand-ins for FlashInfer's MLA wrapper on machines without a GPU.

`TorchCSRWrapper` computes MLA from exactly the CSR metadata it was planned with (qo_indptr,
kv_indptr, kv_indices, kv_len), so a wrong hand-off from block table to plan shows up as a wrong
result against the reference. `keyword_module()` / `flat_module()` build module-like objects with
the 0.7 keyword API or the 0.2.x flat API around it.
"""

from __future__ import annotations

import types

import torch


class _BackendPlanUnsupportedError(ValueError):
    """Same name as FlashInfer 0.7's typed refusal."""


class FakeMLAPlanMetadata:
    def __init__(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_len_arr = (
            qo_indptr, kv_indptr, kv_indices, kv_len_arr)

    @classmethod
    def csr(cls, qo_indptr, kv_indptr, kv_indices, kv_len_arr):
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


class TorchCSRWrapper:
    """Records every call; runs MLA from the planned CSR metadata in float32 torch."""

    refuse: dict = {}          # backend -> refusal message (class-level, set by tests)

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
        self.calls = [("init", (float_workspace_buffer, use_cuda_graph, qo_indptr, kv_indptr,
                                kv_indices, kv_len_arr), {"backend": backend})]
        self.backend = backend
        self._backend = "fa2" if backend == "auto" else backend
        self.plan_args = None

    def _store(self, qo, kvp, kvi, kvl, num_heads, ckv, kpe, page_size, causal, sm_scale, qdt, kvdt):
        if self.backend in self.refuse:
            raise _BackendPlanUnsupportedError(self.refuse[self.backend])
        # FlashInfer 0.7's public plan() validates compact CSR (_validate_csr_metadata)
        pages = [(n + page_size - 1) // page_size for n in kvl.tolist()]
        counts = [b - a for a, b in zip(kvp.tolist()[:-1], kvp.tolist()[1:])]
        if pages != counts or kvp.tolist()[-1] > kvi.numel():
            raise ValueError("CSR metadata page counts in kv_indptr must equal ceil(kv_len_arr / page_size).")
        self.plan_args = dict(qo_indptr=qo, kv_indptr=kvp, kv_indices=kvi, kv_len=kvl,
                              num_heads=num_heads, head_dim_ckv=ckv, head_dim_kpe=kpe,
                              page_size=page_size, causal=causal, sm_scale=sm_scale,
                              q_dtype=qdt, kv_dtype=kvdt)

    def _attend(self, q_nope, q_pe, ckv_cache, kpe_cache, out, return_lse):
        a = self.plan_args
        assert a is not None, "run() before plan()"
        assert q_nope.shape[1] == a["num_heads"] and q_nope.shape[2] == a["head_dim_ckv"]
        assert ckv_cache.shape[1] == a["page_size"]
        qo, kvp, kvl = (a["qo_indptr"].tolist(), a["kv_indptr"].tolist(), a["kv_len"].tolist())
        kvi = a["kv_indices"].to("cpu").long()
        res = torch.empty(q_nope.shape, dtype=torch.float32)
        lse = torch.empty(q_nope.shape[:2], dtype=torch.float32)
        for b in range(len(kvl)):
            pages = kvi[kvp[b]:kvp[b + 1]]
            ckv = ckv_cache.cpu()[pages].reshape(-1, ckv_cache.shape[-1])[:kvl[b]].float()
            kpe = kpe_cache.cpu()[pages].reshape(-1, kpe_cache.shape[-1])[:kvl[b]].float()
            rows = slice(qo[b], qo[b + 1])
            qn, qp = q_nope.cpu()[rows].float(), q_pe.cpu()[rows].float()
            s = (torch.einsum("qhr,lr->qhl", qn, ckv) + torch.einsum("qhp,lp->qhl", qp, kpe)) * a["sm_scale"]
            nq = qo[b + 1] - qo[b]
            if a["causal"] and nq > 1:
                pos = torch.arange(kvl[b])
                last = kvl[b] - nq + torch.arange(nq)
                s = s.masked_fill(pos[None, None, :] > last[:, None, None], float("-inf"))
            lse[rows] = torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0))
            res[rows] = torch.einsum("qhl,lr->qhr", torch.softmax(s, -1), ckv)
        res = res.to(q_nope.dtype).to(q_nope.device)
        if out is None:
            out = res
        else:
            out.copy_(res)
        return (out, lse) if return_lse else out


class KeywordWrapper(TorchCSRWrapper):
    def plan(self, *args, metadata=None, num_heads=None, head_dim_ckv=None, head_dim_kpe=None,
             page_size=None, causal=None, sm_scale=None, q_data_type=None, kv_data_type=None,
             query_layout=None, kv_cache_layout=None, lse_mode="none", **kw):
        self.calls.append(("plan", args, dict(metadata=metadata, num_heads=num_heads,
                                              query_layout=query_layout,
                                              kv_cache_layout=kv_cache_layout, lse_mode=lse_mode, **kw)))
        assert not args, "keyword API must be called by keyword"
        m = metadata
        self._store(m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_len_arr, num_heads, head_dim_ckv,
                    head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type)

    def run(self, *args, query=None, kv_cache=None, out=None, lse=None, return_lse=False, **kw):
        self.calls.append(("run", args, dict(query=query, kv_cache=kv_cache, out=out, lse=lse,
                                             return_lse=return_lse, **kw)))
        assert not args
        return self._attend(query[0], query[1], kv_cache[0], kv_cache[1], out, return_lse)


class FlatWrapper(TorchCSRWrapper):
    """The 0.2.x line: positional plan(qo, kvp, kvi, kvl, H, ckv, kpe, page, causal, scale, qdt, kvdt)."""

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        self.calls.append(("plan", (qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads,
                                    head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale,
                                    q_data_type, kv_data_type), {}))
        self._store(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
                    head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False,
            profiler_buffer=None):
        self.calls.append(("run", (q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse), {}))
        return self._attend(q_nope, q_pe, ckv_cache, kpe_cache, out, return_lse)


FlatWrapper.__doc__ = (FlatWrapper.__doc__ or "") + (
    "\n backend : str\n    The implementation backend, could be ``auto``/``fa2``/``fa3`` or ``cutlass``.")


def keyword_module(backends=("auto", "fa2", "fa3", "cutlass", "trtllm-gen")):
    """A module-like flashinfer.mla with the keyword API; its wrapper's module has _BACKEND_TYPES."""
    wrapper_mod = types.ModuleType("fake_flashinfer_wrapper_mod")
    cls = type("KeywordWrapper", (KeywordWrapper,), {"__module__": wrapper_mod.__name__})
    wrapper_mod.KeywordWrapper = cls
    wrapper_mod._BACKEND_TYPES = {b: object for b in backends}
    import sys
    sys.modules[wrapper_mod.__name__] = wrapper_mod
    return types.SimpleNamespace(BatchMLAPagedAttentionWrapper=cls, MLAPlanMetadata=FakeMLAPlanMetadata)


def flat_module():
    return types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FlatWrapper)


def install(monkeypatch, module, version="0.0.fake"):
    """Make vllm_metax.ops.flashinfer_mla see `module` as the installed flashinfer.mla."""
    from vllm_metax.ops import flashinfer_mla as op
    api = op.detect_api(module)
    api = op.FlashInferAPI(api.form, version, "fake", api.wrapper_cls, api.plan_metadata_cls, api.backends)
    monkeypatch.setattr(op, "_cached_api", lambda: api)
    return api
