"""MLA prefill for the vllm_metax platform: vLLM's `MLAPrefillBackend` contract over FlashInfer's
ragged prefill (fa2 on MetaX and Ampere; fa3 on Hopper) and, on Hopper where a tuned prefill
bucket names it, vLLM's own FA3 varlen prefill (`vllm_fa3`: the kernel of vLLM's FLASH_ATTN
prefill backend, which vLLM offers only on its own CUDA platform), registered under vLLM's
FLASHINFER prefill name, which upstream reserves for Blackwell's cutlass kernel.

vLLM's MLA layer calls it for the new tokens of each prefill (causal) and, for prompts that
continue cached context, once per workspace-sized context chunk (non-causal); it merges the
chunks by their natural-log LSE, which this backend converts from FlashInfer's base 2.
Plans are made from host index pointers where vLLM gives them (no device sync, for the new tokens
and for every context chunk). Which backend each plan runs (the new tokens' plan and every context
chunk's, each separately) comes from the tuned config's prefill section for the model, looked up by
the plan's kind, total query tokens and mean KV tokens per request
(`vllm_metax.core.decisions.prefill_backend`); untuned, the device default. A value the device may
not run is never planned (one warning, the default instead); a backend value FlashInfer refuses here
falls back to fa2 for good, with one warning.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, ClassVar

import torch

from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.attention.backends.mla.prefill.base import MLADimensions, MLAPrefillBackend
from vllm.v1.attention.backends.utils import log2_lse_to_ln

from vllm_metax.backend import served_entry, traffic_recorder
from vllm_metax.core import decisions
from vllm_metax.ops import device_backends
from vllm_metax.core.log import get_logger, log_once
from vllm_metax.ops.fa3_prefill import BACKEND as VLLM_FA3, DTYPES as FA3_DTYPES, FA3PrefillKernel
from vllm_metax.ops.flashinfer_mla import BackendRefused, device_workspace
from vllm_metax.ops.flashinfer_prefill import LSE_VLLM, MLA_DIMS, MLAPrefillKernel, prefill_available

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata
    from vllm.platforms.interface import DeviceCapability

logger = get_logger(__name__)

NAME = "FLASHINFER"            # the vLLM prefill enum member this class is registered under
_WARNED: set = set()           # tuned entries already warned about (one warning per process)


def _workspace(device: torch.device) -> torch.Tensor:
    return device_workspace(device, "prefill")


def prefill_backend_value() -> str:
    """The FlashInfer backend value prefill plans with on this device untuned: the decode default
    (`vllm_metax.core.decisions`: fa3 on Hopper, fa2 elsewhere; MetaX's FlashInfer has fa2 only)."""
    return device_backends.device_prefill_backends().default


def prefill_entry(vllm_config, num_heads: int):
    """The tuned-config entry whose prefill section this model's prefill reads (the decode
    backend's entry: same device file, same model key), or None."""
    return served_entry(vllm_config, num_heads)


def _host_span(t) -> int | None:
    """last - first of a CSR index pointer that lives on the host; None for a device tensor (its
    values would need a sync)."""
    if t is None or (isinstance(t, torch.Tensor) and t.device.type != "cpu"):
        return None
    return int(t[-1]) - int(t[0])


def chunk_statistic(chunk) -> tuple[int, int] | None:
    """A context chunk's (query tokens, KV tokens per request) from its host fields (vLLM's
    ContextChunk: token_slice, num_context_tokens, request_slice), else from host index
    pointers; None when only device tensors say."""
    ts, kv = getattr(chunk, "token_slice", None), getattr(chunk, "num_context_tokens", None)
    rs = getattr(chunk, "request_slice", None)
    if isinstance(ts, slice) and kv is not None and isinstance(rs, slice):
        return decisions.prefill_statistic(int(ts.stop) - int(ts.start), int(kv),
                                           int(rs.stop) - int(rs.start))
    q, kv = _host_span(chunk.query_start_loc), _host_span(chunk.cu_seq_lens)
    if q is None or kv is None:
        return None
    return decisions.prefill_statistic(q, kv, chunk.cu_seq_lens.shape[0] - 1)


def _host_indptr(lens: torch.Tensor) -> torch.Tensor:
    """A CSR index pointer on the host from per-request lengths on the host."""
    out = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(lens, 0, out=out[1:])
    return out


def chunk_host_indptrs(chunk, query_lens_cpu) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A context chunk's query and KV index pointers on the host, equal to its device
    `query_start_loc` and `cu_seq_lens`: vLLM 0.33.0 builds those from the prefills' host query
    lengths (the chunk's `request_slice` of them) and the chunk's host `seq_lens`. Planned from
    these, FlashInfer copies nothing back from the device: a device copy would sync the step
    with the GPU, and under vLLM's async scheduling every prefill step that continues a prompt
    would lose its host/GPU overlap. None where vLLM did not give the host fields."""
    seq_lens, rs = getattr(chunk, "seq_lens", None), getattr(chunk, "request_slice", None)
    if (query_lens_cpu is None or not isinstance(seq_lens, torch.Tensor) or not isinstance(rs, slice)
            or seq_lens.device.type != "cpu" or query_lens_cpu.device.type != "cpu"):
        return None
    q_lens = query_lens_cpu[rs]
    if q_lens.shape[0] != seq_lens.shape[0]:
        return None
    return _host_indptr(q_lens), _host_indptr(seq_lens)


def _lse_for_vllm(kernel, lse: torch.Tensor) -> torch.Tensor:
    """A kernel's LSE as vLLM merges it ([heads, tokens], natural log): vLLM's FA3 writes it so;
    FlashInfer writes [tokens, heads] in base 2."""
    if kernel.LSE_FORM == LSE_VLLM:
        return lse
    return log2_lse_to_ln(lse.transpose(0, 1))


class FlashInferMLAPrefillBackend(MLAPrefillBackend):
    """Dense MLA prefill (new tokens and chunked context) on FlashInfer's ragged prefill."""

    # one module per (head_dim_qk, head_dim_vo): the dims `mla-tune prebuild` builds it for
    supported_mla_dimensions: ClassVar[list[MLADimensions]] = [
        MLADimensions(qk_nope_head_dim=MLA_DIMS[0], qk_rope_head_dim=MLA_DIMS[1],
                      v_head_dim=MLA_DIMS[2]),
    ]

    traffic = None                 # the plan recorder where VLLM_METAX_TRAFFIC asks

    @staticmethod
    def get_name() -> str:
        return NAME

    @classmethod
    def supports_compute_capability(cls, device_capability: "DeviceCapability | None") -> bool:
        return device_capability is not None and device_capability.major >= 8

    @classmethod
    def is_available(cls) -> bool:
        return prefill_available()[0]

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, vllm_config: "VllmConfig") -> None:
        super().__init__(num_heads=num_heads, scale=scale, kv_lora_rank=kv_lora_rank,
                         qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
                         v_head_dim=v_head_dim, vllm_config=vllm_config)
        self.backends = device_backends.device_prefill_backends()
        self.backend = self.backends.default     # the value the last new-token plan ran
        self.entry = prefill_entry(vllm_config, num_heads)
        self.traffic = traffic_recorder(vllm_config, num_heads)    # None unless asked
        self._main: MLAPrefillKernel | None = None
        self._chunks: list[MLAPrefillKernel] = []
        self._kernels: dict[tuple, MLAPrefillKernel] = {}
        self._warn_unservable()
        log_once(logger, logging.INFO, "vllm_metax MLA prefill: FlashInfer ragged prefill, %s",
                 self.describe())

    def describe(self) -> str:
        """Which backend plans which tuned prefill buckets (for the server log)."""
        if self.entry is None or not self.entry.prefill:
            return f"{self.backends.default} every plan (untuned)"
        served = collections.Counter(
            decisions.prefill_backend(self.entry, b.causal, b.query_tokens, b.kv_len, self.backends)
            for b in self.entry.prefill)
        return (", ".join(f"{k} in {n}" for k, n in served.most_common())
                + f" of {len(self.entry.prefill)} tuned prefill buckets")

    def _warn_unservable(self) -> None:
        bad = decisions.unservable_prefill(self.entry, self.backends)
        if bad and id(self.entry) not in _WARNED:
            _WARNED.add(id(self.entry))
            logger.warning("vllm_metax MLA prefill: the tuned config names prefill backend(s) %s, "
                           "which this device does not run (it runs %s); those buckets plan %r",
                           ", ".join(map(str, bad)), ", ".join(self.backends.allowed),
                           self.backends.default)

    def backend_for(self, causal: bool, statistic: tuple[int, int] | None) -> str:
        """The backend one plan runs: its tuned bucket's (`decisions.prefill_backend`), or the
        device default when the plan's size is not known on the host."""
        if statistic is None:
            return self.backends.default
        return decisions.prefill_backend(self.entry, causal, *statistic, self.backends)

    def supports_out(self) -> bool:
        return True                 # planned with head_dim_vo = v_head_dim: unpadded output

    def _kernel(self, index: int | None, backend: str, device: torch.device):
        """The plan slot's kernel for `backend` (index None: the new tokens; else a context
        chunk's index), made once per (slot, backend): plans that switch backends from one step
        to the next reuse their wrappers. The slot's kernel is what its run method runs."""
        key = (index, backend)
        kernel = self._kernels.get(key)
        if kernel is None:
            if backend == VLLM_FA3:
                kernel = self._kernels[key] = FA3PrefillKernel(device)
            else:
                # every plan slot shares one float workspace, as vLLM's FlashInfer prefill does
                # (runs are sequential)
                kernel = self._kernels[key] = MLAPrefillKernel(_workspace(device), backend)
        if index is None:
            self._main = kernel
        else:
            while len(self._chunks) <= index:
                self._chunks.append(kernel)
            self._chunks[index] = kernel
        return kernel

    def _plan(self, index, qo_indptr, kv_indptr, causal, q_dtype, out_dtype, device,
              statistic: tuple[int, int] | None = None, fa3_args: tuple | None = None) -> str:
        """Plan one slot; `fa3_args` (device qo and kv index pointers, longest query and KV span)
        is what vLLM's FA3 reads where the tuned bucket names it."""
        head_dim_qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.traffic is not None and statistic is not None:
            self.traffic.prefill(causal, *statistic)     # the key the prefill lookup is asked
        backend = self.backend_for(causal, statistic)
        if backend == VLLM_FA3 and (fa3_args is None or None in fa3_args
                                    or q_dtype not in FA3_DTYPES):
            # FA3 needs the spans vLLM's metadata carries, and runs bf16/fp16 only
            backend = self.backends.default
        while True:
            kernel = self._kernel(index, backend, device)
            try:
                if backend == VLLM_FA3:
                    dev_qo, dev_kv, max_q, max_kv = fa3_args
                    kernel.plan(dev_qo, dev_kv, self.num_heads, head_dim_qk, self.v_head_dim,
                                causal, self.scale, q_dtype, out_dtype, max_q=max_q, max_kv=max_kv)
                    return backend
                with gpu_sync_allowed():    # FlashInfer copies device index pointers to the host
                    kernel.plan(qo_indptr, kv_indptr, self.num_heads, head_dim_qk, self.v_head_dim,
                                causal, self.scale, q_dtype, out_dtype)
                return backend
            except BackendRefused as e:
                fallback = self.backends.fallback
                if backend == fallback:
                    raise
                logger.warning("vllm_metax MLA prefill: FlashInfer backend %r cannot plan here "
                               "(%s); using %r", backend, e.reason, fallback)
                # never again in this process's plans of this backend object
                allowed = tuple(b for b in self.backends.allowed if b != backend) or (fallback,)
                self.backends = decisions.FlashInferBackends(
                    allowed, fallback if self.backends.default == backend else self.backends.default,
                    fallback)
                backend = fallback

    def prepare_metadata(self, prefill_metadata: "MLACommonPrefillMetadata") -> None:
        super().prepare_metadata(prefill_metadata)
        qsl = prefill_metadata.query_start_loc
        device = qsl.device
        q_dtype = prefill_metadata.q_data_type or self.vllm_config.model_config.dtype
        out_dtype = prefill_metadata.output_dtype or q_dtype
        lens = prefill_metadata.query_lens_cpu
        statistic = None
        if lens is not None:        # host index pointers: no device sync for the new tokens
            qo_indptr = _host_indptr(lens)
            total = int(qo_indptr[-1])
            # causal new tokens: each request's KV is its own query tokens
            statistic = decisions.prefill_statistic(total, total, lens.shape[0])
        else:
            qo_indptr = qsl
        mq = getattr(prefill_metadata, "max_query_len", None)
        self.backend = self._plan(None, qo_indptr, qo_indptr, True, q_dtype, out_dtype, device,
                                  statistic, (qsl, qsl, mq, mq))
        chunked = prefill_metadata.chunked_context
        if chunked is not None:
            for chunk in chunked.chunks:
                cu_q, cu_kv = (chunk_host_indptrs(chunk, lens)
                               or (chunk.query_start_loc, chunk.cu_seq_lens))
                self._plan(chunk.index, cu_q, cu_kv, False, q_dtype,
                           out_dtype, device, chunk_statistic(chunk),
                           (chunk.query_start_loc, chunk.cu_seq_lens,
                            getattr(chunk, "max_query_len", None), getattr(chunk, "max_seq_len", None)))

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               return_softmax_lse: bool, out: torch.Tensor | None = None,
                               output_scale: torch.Tensor | None = None):
        if output_scale is not None:
            raise NotImplementedError("FlashInfer MLA prefill does not write quantized output")
        assert self._main is not None, "prefill was not planned"
        ret = self._main.run(q, k, v, out=out, return_lse=return_softmax_lse)
        if return_softmax_lse:
            o, lse = ret
            return o, _lse_for_vllm(self._main, lse)
        return ret

    def run_prefill_context_chunk(self, chunk, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor | None = None):
        kernel = self._chunks[chunk.index]
        o, lse = kernel.run(q, k, v, out=out, return_lse=True)
        return o, _lse_for_vllm(kernel, lse)
