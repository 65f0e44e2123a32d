"""FlashInfer's BatchMLAPagedAttentionWrapper as a measurable family, through the plugin's op.

Candidates are `flashinfer/<backend>/p<page_size>` and run exactly the code the vLLM plugin runs:
build_paged_metadata (vllm_metax/ops/paged_metadata.py) -> MLADecodeKernel.plan -> .run
(vllm_metax/ops/flashinfer_mla.py).

Search space and "chunking" knobs (docs/tuning.md), read from flashinfer-python 0.7.2's
wrapper code. None of the backends exposes a knob through the wrapper that changes how work is
cut; the plugin's own schedule does:

* fa2 / fa3: the C++ MLAPlan picks the KV split itself (cluster size 1 or 2 from q_len*heads;
  kv_len_limit from the average work per cluster of SMs, rounded to 32/64/128/192/k*256); the
  query tile is fixed at 64*cluster rows. plan() accepts no split size. The plugin's fast
  re-plan computes the same schedule with numpy (`vllm_metax.ops.mla_schedule`), so the KV chunk
  limit is ours: the knob `kv_chunk` (`vllm_metax.core.choices.KV_CHUNKS`: MLAPlan's limit x
  0.25/0.5/2/4, or "none": never split) is measured like any candidate, correctness gate
  included. Without it the candidate is what the plugin plans untuned. Chunk variants are
  declared at the default page size only (the chunking is per step, the page size global; the
  search then measures the best point at the other page sizes); a variant the bucket's batch
  cannot take (the finer chunks overflow FlashInfer's partial-output buffer) or a FlashInfer
  without the fast re-plan (the 0.2.x API) is invalid("unsupported").
* cute-dsl-monolithic / cute-dsl-modular: split_kv from the implementation's own heuristic
  (`_get_split_kv_and_workspace_size`), not a plan argument.
* trtllm-gen / xqa: splits from the SM count inside the backend; SM100+/SM120 only.
* cutlass / cutile: dense page-table kernels with fixed tiling; SM100-class devices.
* auto / cute-dsl: policies/aliases that resolve to one of the above at plan time; they are not
  candidates.
* page size: any positive KV block size; fa2/fa3 compile one module per dtype/head-dim, not per
  page size, so every page size costs no extra JIT.

What this device may run, and the untuned default, are the plugin's rule
(`vllm_metax.core.decisions.flashinfer_backends`): fa3 and fa2 on Hopper (default fa3), fa2 on MetaX
and everywhere else, within the target profile's (`vllm_metax.core.profile`): under "metax" fa2
only, planned through FlashInfer's flat 0.2.x API (as MetaX's `flashinfer==0.2.6+metax` plans it:
FlashInfer's own plan(), so no fast re-plan and no `kv_chunk` candidates). The space is those values the installed FlashInfer accepts, and the default
candidate is what the plugin plans without a tuned config, so the tuner measures exactly what the
plugin may serve. A refusal is stored as invalid("unsupported") with FlashInfer's message.
"""

from __future__ import annotations

import time

import torch

from mla_tune.families.base import (Availability, Candidate, CandidateInvalid, Prepared,
                                   refuse_outside_profile, typed_choice)
from mla_tune.problem.defaults import DEFAULT_PAGE_SIZE
from mla_tune.problem.workload import Workload
from mla_tune.problem.instance import torch_dtype
from vllm_metax.core.choices import FLASHINFER, KV_CHUNKS, SPECS
from vllm_metax.core.profile import target_profile
from vllm_metax.ops import flashinfer_mla as op
from vllm_metax.ops.device_backends import device_flashinfer_backends
from vllm_metax.ops.fast_replan import ENABLED as FAST_REPLAN
from vllm_metax.ops.paged_metadata import build_paged_metadata

FAMILY = FLASHINFER
SPEC = SPECS[FAMILY]


def device_backends(profile=None):
    """The plugin's FlashInfer backend rule for the visible device under `profile` (None: the
    active one)."""
    return device_flashinfer_backends(profile)


class FlashInferFamily:
    family = FAMILY

    def __init__(self, api: str | None = None, workspace_bytes: int | None = None,
                 fast_replan: bool | None = None, profile=None):
        """`api` forces the flat or keyword FlashInfer API form (tests); default: the profile's
        (`profile`, None: the active one), else detected. `fast_replan` is MLADecodeKernel's (on,
        as the plugin runs it; off times FlashInfer's own plan())."""
        self.profile = target_profile(profile)
        self.api = api or self.profile.flashinfer_api
        self.workspace_bytes = workspace_bytes
        self.fast_replan = FAST_REPLAN if fast_replan is None else fast_replan

    # ------------------------------------------------------------------ protocol
    def available(self, device: str) -> Availability:
        if not str(device).startswith("cuda"):
            return Availability(False, "FlashInfer MLA needs a CUDA device")
        if not torch.cuda.is_available():
            return Availability(False, "torch sees no CUDA device")
        ok, why = op.flashinfer_available()
        return Availability(ok, why)

    def backends(self) -> tuple:
        """The backend values the plugin may plan on this device that the installed FlashInfer
        accepts, in the plugin's order."""
        try:
            accepted = set(op.concrete_backends())
        except op.FlashInferUnavailable:
            return ()
        return tuple(b for b in device_backends(self.profile).allowed if b in accepted)

    def space(self, workload: Workload, page_sizes: list[int]) -> list[Candidate]:
        backends = self.backends()
        out = [Candidate(self.family, b, p) for b in backends for p in page_sizes]
        page = DEFAULT_PAGE_SIZE if DEFAULT_PAGE_SIZE in page_sizes else (page_sizes or [None])[0]
        if page is not None and self.fast_replan and self._keyword_api():
            out += [Candidate(self.family, b, page, {"kv_chunk": c})
                    for b in backends if b in SPEC.chunked_backends for c in KV_CHUNKS]
        return out

    def _keyword_api(self) -> bool:
        try:
            return self.api != op.API_FLAT and op.flashinfer_api().form == op.API_KEYWORD
        except op.FlashInferUnavailable:
            return False

    def default_candidate(self, workload: Workload, page_size: int = DEFAULT_PAGE_SIZE) -> Candidate:
        """What the plugin plans without a tuned config (fa3 on Hopper, fa2 elsewhere and under
        the metax profile)."""
        return Candidate(self.family, device_backends(self.profile).default, page_size)

    def prepare(self, workload: Workload, candidate: Candidate, problem) -> Prepared:
        """Plan the candidate over `problem` (first plan JIT-compiles: `compile_s`)."""
        choice = typed_choice(candidate)
        refuse_outside_profile(candidate, self.profile)
        kv_chunk, factor = choice.kv_chunk, choice.kv_chunk_factor
        try:
            api = op.flashinfer_api()
        except op.FlashInferUnavailable as e:
            raise CandidateInvalid("unsupported", str(e)) from None
        if candidate.backend not in api.backends:
            raise CandidateInvalid("unsupported", f"flashinfer {api.version} does not accept backend "
                                   f"{candidate.backend!r} (accepts {', '.join(api.backends)})")
        device = problem.device
        try:
            kernel = op.MLADecodeKernel(self._workspace(device), candidate.backend, api=self.api,
                                        fast_replan=self.fast_replan)
        except ValueError as e:
            raise CandidateInvalid("unsupported", str(e)) from None
        q_dt, kv_dt = torch_dtype(workload.q_dtype), torch_dtype(workload.kv_dtype)
        causal = workload.q_len > 1
        R, P, H = workload.kv_lora_rank, workload.qk_rope_head_dim, workload.num_heads

        def plan():
            # exactly the plugin's per-step host work: block table -> CSR -> plan
            meta = build_paged_metadata(problem.block_table, problem.seq_lens_cpu,
                                        candidate.page_size, workload.q_len)
            kernel.plan(meta, H, R, P, candidate.page_size, causal, workload.softmax_scale, q_dt, kv_dt,
                        kv_chunk=factor)

        t0 = time.perf_counter()
        try:
            plan()
        except op.BackendRefused as e:
            raise CandidateInvalid("unsupported", e.reason) from None
        except (RuntimeError, OSError, ImportError) as e:
            if _looks_like_compile_error(e):
                raise CandidateInvalid("compile", f"{type(e).__name__}: {e}") from None
            raise
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        compile_s = time.perf_counter() - t0
        if factor is not None:
            # the chunked schedule comes from the fast re-plan (the second plan on, as served)
            plan()
            plan()
            if kernel.last_schedule != "chunked":
                raise CandidateInvalid("unsupported", _chunk_refusal(kernel, kv_chunk))
        out = torch.empty_like(problem.q_nope)
        args = (problem.q_nope, problem.q_pe, problem.ckv_cache, problem.kpe_cache)

        def run():
            return kernel.run(*args, out=out)

        prepared = Prepared(run=run, plan=plan, out=out, compile_s=compile_s, graphable=True)
        prepared.kernel = kernel          # for introspection (resolved backend) by bench/tests
        return prepared

    # ------------------------------------------------------------------ helpers
    def _workspace(self, device) -> torch.Tensor:
        # one workspace per candidate: interleaved candidates must not share scratch space
        return op.make_workspace(device, self.workspace_bytes or op.WORKSPACE_BYTES)


def _chunk_refusal(kernel, kv_chunk: str) -> str:
    if not kernel.fast_replan or kernel.last_schedule == "public":
        return (f"kv_chunk={kv_chunk} needs the fast re-plan (FlashInfer 0.7's fa2/fa3 with the "
                "internals vllm_metax.ops.fast_replan uses; not VLLM_METAX_FAST_REPLAN=0)")
    return (f"kv_chunk={kv_chunk} does not fit this batch (its schedule would exceed FlashInfer's "
            "work-item, merge or partial-output buffers): the plugin plans it untuned")


def _looks_like_compile_error(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return any(w in text for w in ("ninja", "nvcc", "compil", "build failed", "jit"))
