"""FLASHINFER_MLA for the vllm_metax platform: vLLM's MLA backend trio (Backend, MetadataBuilder,
Impl) over FlashInfer's wrapper-based MLA kernels (fa2 on MetaX and Ampere, fa2/fa3 on Hopper).

vLLM's own FLASHINFER_MLA runs TRT-LLM-gen kernels on compute capability 10.x only; the platform
registers this class under the same enum member instead.

Per decode step, `_build_decode` turns the block table and sequence lengths into FlashInfer's CSR
page metadata through `vllm_metax.ops.paged_metadata.build_paged_metadata` and plans one
`vllm_metax.ops.flashinfer_mla.MLADecodeKernel` (the op the tuner measures). After a step's first
plan the op re-plans through FlashInfer's compiled MLAPlan only, and the metadata is strided: the
block table itself is the page list, so nothing is launched on the device to build it. Which FlashInfer
backend value plans the step, or which kernel runs it instead (the split-KV kernel, FlashMLA through
`vllm_metax.backend.flashmla_buckets`, vLLM's FA3 MLA kernel: the first that serves the bucket,
`decisions.side_kernel`), comes from this device's tuned config (per batch/context bucket,
`vllm_metax.backend.plan_choice`), loaded once per process; every layer of the step then runs it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.config.compilation import CUDAGraphMode
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionLayer,
    MultipleOf,
)

from vllm_metax.backend import served_entry, served_modules, traffic_recorder
from vllm_metax.backend.builder import UniformDecodeBuilder
from vllm_metax.backend.flashmla_buckets import FlashMLABuckets
from vllm_metax.backend.impl_features import FeatureCheckedImpl
from vllm_metax.backend.plan_choice import PlanChoice
from vllm_metax.core import choices, decisions
from vllm_metax.core.log import get_logger, log_once
from vllm_metax.ops.flashinfer_mla import (
    BackendRefused,
    GraphBuffers,
    MLADecodeKernel,
    device_workspace,
    flashinfer_available,
)
from vllm_metax.ops import fa3_mla, split_decode
from vllm_metax.ops import device_backends
from vllm_metax.ops.paged_metadata import PagedMetadata, build_paged_metadata

logger = get_logger(__name__)

# A CUDA-graph step copies strided page indices (the whole block table) into the graph's buffer:
# up to 2M pages (8 MB, a few microseconds of copy) that beats the compacting gather's launches.
_GRAPH_STRIDED_MAX_PAGES = 1 << 21


def shared_workspace(device: torch.device) -> torch.Tensor:
    """The decode float workspace of this device, shared by every decode wrapper."""
    return device_workspace(device, "decode")


# ---------------------------------------------------------------------------- vLLM classes

@dataclass
class FlashInferMLADecodeMetadata(MLACommonDecodeMetadata):
    """What one decode step planned; every layer of the step runs `kernel` with it."""

    kernel: MLADecodeKernel | None = None
    backend: str = ""              # the FlashInfer backend value planned
    paged: PagedMetadata | None = None
    num_rows: int = 0              # decode query rows: num_decodes * q_len
    q_len: int = 1
    sm_scale: float = 0.0
    page_size: int = 0
    return_lse: bool = False
    cuda_graph: bool = False


@dataclass
class FlashInferMLAMetadata(MLACommonMetadata[FlashInferMLADecodeMetadata]):
    pass


class FlashInferMLAMetadataBuilder(UniformDecodeBuilder, MLACommonMetadataBuilder[FlashInferMLAMetadata]):
    # Full CUDA graphs for uniform decode batches (UniformDecodeBuilder): one wrapper per captured
    # (batch, q_len) with persistent metadata buffers; fa2/fa3 re-plan into them before each replay.
    EXACT_HOST_LENGTHS: ClassVar[bool] = True      # FlashInfer plans the step from them

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, FlashInferMLAMetadata)
        layer = self.compilation_config.static_forward_context[layer_names[0]]
        self.sm_scale = float(layer.scale)          # the model's scale, YaRN mscale included
        self.head_dim_ckv = self.mla_dims.kv_lora_rank
        self.head_dim_kpe = self.mla_dims.qk_rope_head_dim
        self.q_dtype = self.model_config.dtype
        self.kv_dtype = kv_cache_spec.dtype
        # Only decode context parallelism consumes the decode LSE, and FlashInfer fixes the LSE
        # mode at plan time.
        self.plan_lse = self.dcp_world_size > 1
        mode = self.compilation_config.cudagraph_mode
        self.full_cudagraph = mode is not None and mode.decode_mode() == CUDAGraphMode.FULL
        max_graph = self.compilation_config.max_cudagraph_capture_size
        self.max_graph_tokens = max_graph if max_graph is not None else 0
        # graph buffers hold every page a request of max_model_len can use: a captured graph
        # keeps its buffers, so they are sized once for the longest request, not the first step's
        page = kv_cache_spec.block_size
        self.max_pages_per_req = -(-self.model_config.max_model_len // page)

        entry = served_entry(vllm_config, self.num_heads)
        self.choice = PlanChoice(entry, device_backends.device_flashinfer_backends())
        self.traffic = traffic_recorder(vllm_config, self.num_heads)    # None unless asked
        log_once(logger, logging.INFO, "vllm_metax MLA: FLASHINFER_MLA decode kernels: %s",
                 self.choice.describe())
        if entry is not None:
            served_modules.say_unbuilt(self.choice)
        self._kernels: dict[str, MLADecodeKernel] = {}
        self._graph_kernels: dict[tuple, MLADecodeKernel] = {}
        self._graph_buffers: dict[tuple, GraphBuffers] = {}
        self._split_kernels: dict[tuple, split_decode.SplitDecode] = {}
        self._split_workspaces: dict[tuple, tuple] = {}
        # every split kernel the config can serve is made and checked now, before vLLM captures a
        # graph: a capture must find the same choice its replays will make
        for choice in self.choice.split_choices():
            self._split_kernel(choice)
        # vLLM's FA3 MLA kernel where the config serves it: its scheduler metadata buffer holds
        # the largest batch a step or a captured graph can have (vLLM's builder sizes it the same)
        self._fa3_kernels: dict[tuple, fa3_mla.FA3MLADecode | None] = {}
        self._fa3_max_batch = max(vllm_config.scheduler_config.max_num_seqs, self.max_graph_tokens)
        for choice in self.choice.fa3_choices():
            for graph in (False, True) if self.full_cudagraph else (False,):
                self._fa3_kernel(choice, graph)
        self._flashmla = FlashMLABuckets(self.choice, self.device, self.sm_scale, self.num_heads,
                                         self.head_dim_ckv, self.head_dim_kpe, page, self.q_dtype,
                                         self.kv_dtype, self.full_cudagraph)

    def _use_graph(self, num_decodes: int, num_decode_tokens: int) -> bool:
        common = self._common
        pure_decode = common is None or common.num_reqs == num_decodes
        return (self.full_cudagraph and pure_decode and num_decode_tokens <= self.max_graph_tokens)

    def _kernel(self, backend: str, graph: bool, num_decodes: int, q_len: int,
                max_pages_per_req: int) -> MLADecodeKernel:
        if not graph:
            if backend not in self._kernels:
                self._kernels[backend] = MLADecodeKernel(shared_workspace(self.device), backend)
            return self._kernels[backend]
        key = (num_decodes, q_len, backend)
        if key not in self._graph_kernels:
            bkey = (num_decodes, q_len)
            if bkey not in self._graph_buffers:
                self._graph_buffers[bkey] = GraphBuffers.allocate(
                    num_decodes, num_decodes * max(max_pages_per_req, self.max_pages_per_req),
                    self.device)
            self._graph_kernels[key] = MLADecodeKernel(
                shared_workspace(self.device), backend, use_cuda_graph=True,
                graph_buffers=self._graph_buffers[bkey])
        return self._graph_kernels[key]

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor,
                      max_seq_len: int, query_start_loc_cpu: torch.Tensor,
                      query_start_loc_device: torch.Tensor, num_decode_tokens: int,
                      max_query_len: int,
                      dcp_tot_seq_lens_device: torch.Tensor | None) -> FlashInferMLADecodeMetadata:
        num_decodes = int(query_start_loc_cpu.shape[0]) - 1      # a Python int, never a tensor
        q_len, rest = divmod(int(num_decode_tokens), num_decodes)
        if rest or q_len < 1:
            raise ValueError(f"FLASHINFER_MLA plans uniform decode batches; got {num_decode_tokens} "
                             f"tokens over {num_decodes} requests")
        # numpy, not torch, on the host: this runs every step and torch's per-op cost dominates.
        # CUDA-graph padding rows have length 0: give them q_len tokens of their (null) block.
        # np.maximum makes a fresh array: vLLM reuses its host length buffer next step.
        seq_lens = np.maximum(self._host_seq_lens(seq_lens_device, num_decodes).numpy(), q_len,
                              dtype=np.int32)
        graph = self._use_graph(num_decodes, num_decode_tokens)
        context = decisions.bucket_context(seq_lens)
        if self.traffic is not None:
            self.traffic.decode(num_decodes, context, q_len)     # the key the lookup is asked
        # which kernel decodes the step (`PlanChoice.kernel`, by `decisions.flashinfer_mla_kernel`):
        # a side kernel that cannot run here is turned off and the next in the order is asked
        skip: set = set()
        while True:
            served = self.choice.kernel(num_decodes, context, q_len, graph, lse=self.plan_lse,
                                        page_size=self.page_size, skip=skip)
            if served.family == choices.FLASHINFER:
                break
            step = self._side_step(served, num_decodes, q_len, graph, block_table_tensor,
                                   seq_lens_device, query_start_loc_device, seq_lens)
            if step is not None:
                return FlashInferMLADecodeMetadata(
                    block_table=block_table_tensor, seq_lens=seq_lens_device,
                    dcp_tot_seq_lens=dcp_tot_seq_lens_device, kernel=step, backend=served.family,
                    paged=None, num_rows=num_decodes * q_len, q_len=q_len, sm_scale=self.sm_scale,
                    page_size=self.page_size, return_lse=False, cuda_graph=graph)
            skip.add(served.family)
        backend, kv_chunk = served.choice.backend, served.choice.kv_chunk_factor
        block_table = block_table_tensor[:num_decodes]
        # The block table itself is the page list (strided metadata, nothing launched) wherever
        # the fast re-plan takes it; into a graph's buffer it is copied whole, so there only
        # while that copy is small.
        strided = not graph or num_decodes * block_table.shape[1] <= _GRAPH_STRIDED_MAX_PAGES
        while True:
            kernel = self._kernel(backend, graph, num_decodes, q_len, block_table.shape[1])
            gb = kernel.graph_buffers
            meta = build_paged_metadata(block_table, seq_lens, self.page_size, q_len,
                                        out_kv_indices=gb.kv_indices if gb is not None and not strided
                                        else None, compact=not strided)
            try:
                kernel.plan(meta, self.num_heads, self.head_dim_ckv, self.head_dim_kpe,
                            self.page_size, q_len > 1, self.sm_scale, self.q_dtype, self.kv_dtype,
                            return_lse=self.plan_lse, kv_chunk=kv_chunk)
                break
            except BackendRefused as e:
                if backend == self.choice.backends.fallback:
                    raise
                backend, kv_chunk = self.choice.refuse(backend, e.reason), None
        return FlashInferMLADecodeMetadata(
            block_table=block_table_tensor, seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device, kernel=kernel, backend=backend,
            paged=meta, num_rows=num_decodes * q_len, q_len=q_len, sm_scale=self.sm_scale,
            page_size=self.page_size, return_lse=self.plan_lse, cuda_graph=graph)


    # ------------------------------------------------------------ the split kernel

    def _side_step(self, served: decisions.DecodeKernel, num_decodes: int, q_len: int, graph: bool,
                   block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor,
                   query_start_loc_device: torch.Tensor, seq_lens: np.ndarray):
        """The step of the side kernel `served` names, on this step's tensors; None where its op
        cannot run here (it is then turned off for the process, with one warning)."""
        block_table, lens = block_table_tensor[:num_decodes], seq_lens_device[:num_decodes]
        if served.family == choices.SPLIT:
            kernel = self._split_kernel(served.choice)
            return None if kernel is None else split_decode.SplitStep(kernel, block_table, lens, self.sm_scale)
        if served.family == choices.FLASHMLA:
            return self._flashmla.step(graph, block_table, lens, q_len)
        kernel = self._fa3_kernel(served.choice, graph)
        if kernel is None:
            return None
        return fa3_mla.FA3Step(kernel, block_table, lens, query_start_loc_device[:num_decodes + 1], q_len,
                               int(seq_lens.max()), self.q_dtype)

    def _side_op(self, family: str, cache: dict, key, knobs: str, make):
        """The op of side kernel `family` for one set of knobs (`key` in `cache`, `knobs` for
        people), made once by `make()` -> (op, why not), never inside a CUDA-graph capture: a graph
        captured with FlashInfer must not be replayed with another kernel's metadata. A why (or an
        exception) turns the kernel off for the process, with one warning: the next kernel that
        serves its steps decodes them."""
        if key in cache:
            return cache[key]
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self.choice.turn_off(family, "first needed inside a CUDA-graph capture")
            return None
        try:
            kernel, why = make()
        except Exception as e:  # noqa: BLE001 - a config this device cannot run must not crash vLLM
            kernel, why = None, f"{type(e).__name__}: {e}"
        if why:
            self.choice.turn_off(family, f"{knobs}: {why}")
            kernel = None
        cache[key] = kernel
        return kernel

    def _split_kernel(self, choice: choices.SplitChoice) -> split_decode.SplitDecode | None:
        """The served kernel of these knobs, made once and checked once against a torch
        reference on this device (`_side_op`: a compile error or a wrong result turns the split
        kernel off)."""
        def make():
            # one workspace per partials' dtype and row count: every split count and pipe of
            # this layer's heads shares it (a step runs one kernel)
            rows = split_decode.served_rows(self.num_heads, choice.pipe)
            ws = self._split_workspaces.get((choice.partial, rows))
            if ws is None:
                ws = split_decode.served_workspace(self.num_heads, self.head_dim_ckv, choice.partial, self.device,
                                                   choice.pipe)
                self._split_workspaces[(choice.partial, rows)] = ws
            kernel = split_decode.served(choice.num_splits, choice.partial, self.num_heads, self.page_size,
                                         rows, self.device, workspace=ws, kv_lora_rank=self.head_dim_ckv,
                                         rope_dim=self.head_dim_kpe, pipe=choice.pipe)
            return kernel, split_decode.self_check(kernel, self.q_dtype, self.device)
        return self._side_op(choices.SPLIT, self._split_kernels, (choice.num_splits, choice.partial, choice.pipe),
                             f"num_splits={choice.num_splits}, partial={choice.partial}, pipe={choice.pipe}",
                             make)

    # ------------------------------------------------------------ vLLM's FA3 MLA kernel

    def _fa3_kernel(self, choice: choices.FA3Choice, graph: bool) -> fa3_mla.FA3MLADecode | None:
        """The op of these knobs, made once (`_side_op`). Under CUDA graphs FA3's own split
        heuristic (num_splits 0) would size its buffers at capture: there the bound is vLLM's, 32
        (`flash_attn_max_num_splits_for_cuda_graph`), as vLLM's FLASH_ATTN_MLA does."""
        splits = choice.num_splits or (fa3_mla.GRAPH_SPLITS if graph else 0)

        def make():
            ok, why = fa3_mla.fa3_available(self.device)
            why = why if not ok else fa3_mla.check_shapes(self.head_dim_ckv, self.head_dim_kpe,
                                                          self.page_size, self.q_dtype, self.kv_dtype)
            if why is not None:
                return None, why
            return fa3_mla.FA3MLADecode(self.sm_scale, self.num_heads, self.page_size, splits,
                                        choice.schedule, max_batch=self._fa3_max_batch,
                                        device=self.device), None
        # one op (and metadata buffer) per knob set
        return self._side_op(choices.FA3, self._fa3_kernels, (splits, choice.schedule),
                             f"num_splits={choice.num_splits}, schedule={choice.schedule}", make)


def _model_features(vllm_config) -> list[str]:
    """Reasons the model itself rules this backend out (what vLLM's MLA selector does not pass)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return []
    reasons = []
    hf = model_config.hf_text_config
    try:
        if model_config.get_sliding_window():
            reasons.append("sliding window not supported")
    except Exception:
        pass
    if getattr(hf, "attn_logit_softcapping", None):
        reasons.append("logits soft-cap not supported")
    if getattr(hf, "alibi", False) or getattr(hf, "use_alibi", False) \
            or getattr(hf, "position_embedding_type", None) == "alibi":
        reasons.append("alibi not supported")
    kv_lora = getattr(hf, "kv_lora_rank", None)
    rope = getattr(hf, "qk_rope_head_dim", None)
    if kv_lora is not None and rope is not None and (kv_lora % 128 or rope % 64 or rope == 0):
        reasons.append(f"FlashInfer MLA needs kv_lora_rank % 128 == 0 and qk_rope_head_dim % 64 == 0 "
                       f"(got {kv_lora}, {rope})")
    return reasons


class FlashInferMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    # FlashInfer's fa2/fa3 MLA read fp16/bf16 caches; its fp8 path needs per-tensor scales at run
    # time that this backend does not pass.
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER_MLA"

    @staticmethod
    def get_impl_cls() -> type["FlashInferMLAImpl"]:
        return FlashInferMLAImpl

    @staticmethod
    def get_builder_cls() -> type[FlashInferMLAMetadataBuilder]:
        return FlashInferMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]        # the wrapper takes any page size

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576, 320, 192]        # kv_lora_rank + rope: 512+64, 256+64, 128+64

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability >= DeviceCapability(8, 0)

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # each decode step is planned from the host query_start_loc and sequence lengths: a batch
        # whose device copy was trimmed (adaptive verification) would run a stale plan
        return False

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink,
                             use_sparse, use_mm_prefix, device_capability) -> str | None:
        reasons = _model_features(get_current_vllm_config_or_none())
        ok, why = flashinfer_available()
        if not ok:
            reasons.append(why)
        return "; ".join(reasons) if reasons else None


class FlashInferMLAImpl(FeatureCheckedImpl, MLACommonImpl[FlashInferMLAMetadata]):
    lse_base_on_e: bool = False        # FlashInfer's MLA LSE is base 2 (both API forms)
    backend_name = "FLASHINFER_MLA"                  # what FeatureCheckedImpl refuses names
    kv_cache_dtypes = FlashInferMLABackend.supported_kv_cache_dtypes

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: FlashInferMLAMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor | None]:
        decode = self.planned_decode(attn_metadata)
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:                                   # one [T, H, ckv+kpe] tensor (fp8 / DCP paths)
            q_nope, q_pe = q[..., : self.kv_lora_rank], q[..., self.kv_lora_rank:]
        if q_nope.shape[0] != decode.num_rows:
            raise ValueError(f"planned {decode.num_rows} decode rows, got {q_nope.shape[0]}")
        self.check_planned(decode.sm_scale, decode.page_size, kv_c_and_k_pe_cache)
        ckv = kv_c_and_k_pe_cache[..., : self.kv_lora_rank]
        kpe = kv_c_and_k_pe_cache[..., self.kv_lora_rank:]
        out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
        if self.need_to_return_lse_for_decode:
            if not decode.return_lse:
                raise ValueError("the decode LSE was asked for but the step was planned without it")
            out, lse = decode.kernel.run(q_nope, q_pe, ckv, kpe, out=out, return_lse=True)
            return out, lse
        return decode.kernel.run(q_nope, q_pe, ckv, kpe, out=out), None
