"""MLA prefill as a measurable family, through the plugin's ops: FlashInfer's ragged prefill and,
on Hopper, vLLM's FA3 varlen prefill.

Candidates are `flashinfer_prefill/<backend>/p1` (the KV is ragged: contiguous rows per request,
no pages; the page part of the key is 1; the family keeps its first name, under which results.db
stores its trials) and run exactly what the vLLM plugin's prefill backend runs:
`vllm_metax.ops.flashinfer_prefill.MLAPrefillKernel.plan` from the index pointers the plugin
has (the new tokens' from the host, a context chunk's from the device) -> `.run` (with the LSE for
a context chunk, which vLLM merges); for `vllm_fa3`, `vllm_metax.ops.fa3_prefill.FA3PrefillKernel`
(vLLM's own FLASH_ATTN prefill kernel on Hopper, from device index pointers).

The one knob is the backend: what this device may plan for prefill
(`vllm_metax.core.decisions.prefill_backends`: fa3 and fa2 on Hopper, default fa3, plus vllm_fa3
where vLLM's FA3 library loads; fa2 on MetaX and everywhere else), limited to what the installed
ops accept. The default candidate is what the
plugin plans untuned. The chunked-prefill workspace size is not a knob: it changed nothing beyond
the A/A spread on the H200 (bench/results/prefill_choice_h200.md). A refusal is
invalid("unsupported") with FlashInfer's message.
"""

from __future__ import annotations

import time

import torch

from mla_tune.families.base import Availability, Candidate, CandidateInvalid, Prepared
from mla_tune.problem.instance import torch_dtype
from mla_tune.problem.prefill import QK_NOPE, QK_ROPE, V_DIM, PrefillProblem, PrefillWorkload
from vllm_metax.ops.device_backends import device_prefill_backends
from vllm_metax.ops.fa3_prefill import BACKEND as VLLM_FA3, FA3PrefillKernel
from vllm_metax.ops.flashinfer_mla import WORKSPACE_BYTES, BackendRefused, make_workspace
from vllm_metax.ops.flashinfer_prefill import PREFILL_BACKENDS, MLAPrefillKernel, prefill_available

FAMILY = "flashinfer_prefill"
PAGE = 1                      # ragged KV: no pages


def device_backends():
    """The plugin's prefill backend rule for the visible device."""
    return device_prefill_backends()


class FlashInferPrefillFamily:
    family = FAMILY

    def __init__(self, workspace_bytes: int | None = None, wrapper_cls: type | None = None,
                 fa3_fwd=None):
        """`wrapper_cls` stands in for FlashInfer's ragged wrapper and `fa3_fwd` for vLLM's FA3
        forward op (tests on the CPU)."""
        self.workspace_bytes = workspace_bytes
        self.wrapper_cls = wrapper_cls
        self.fa3_fwd = fa3_fwd

    def available(self, device: str) -> Availability:
        if self.wrapper_cls is not None:
            return Availability(True, "stand-in ragged wrapper")
        if not str(device).startswith("cuda"):
            return Availability(False, "FlashInfer prefill needs a CUDA device")
        if not torch.cuda.is_available():
            return Availability(False, "torch sees no CUDA device")
        ok, why = prefill_available()
        return Availability(ok, why)

    def backends(self) -> tuple:
        """The prefill backend values the plugin may plan here that an op runs, its order."""
        return tuple(b for b in device_backends().allowed if b in PREFILL_BACKENDS or b == VLLM_FA3)

    def space(self, workload: PrefillWorkload) -> list[Candidate]:
        return [Candidate(self.family, b, PAGE) for b in self.backends()]

    def default_candidate(self, workload: PrefillWorkload) -> Candidate:
        """What the plugin plans without a tuned prefill bucket (fa3 on Hopper, fa2 elsewhere)."""
        return Candidate(self.family, device_backends().default, PAGE)

    def prepare(self, workload: PrefillWorkload, candidate: Candidate,
                problem: PrefillProblem) -> Prepared:
        """Plan the candidate over `problem` (the first plan and run JIT-compile: `compile_s`)."""
        if candidate.params:
            raise CandidateInvalid("unsupported", f"FlashInfer prefill has no knob "
                                   f"{sorted(candidate.params)}; its one choice is the backend")
        fa3 = candidate.backend == VLLM_FA3
        if candidate.backend not in PREFILL_BACKENDS and not fa3:
            raise CandidateInvalid("unsupported", f"prefill backend must be one of "
                                   f"{', '.join(PREFILL_BACKENDS + (VLLM_FA3,))}, got "
                                   f"{candidate.backend!r}")
        device = problem.device
        try:
            if fa3:
                kernel = FA3PrefillKernel(device, fwd=self.fa3_fwd)
            else:
                # one workspace per candidate: interleaved candidates must not share scratch space
                ws = (torch.empty(16, dtype=torch.uint8) if self.wrapper_cls is not None
                      else make_workspace(device, self.workspace_bytes or WORKSPACE_BYTES))
                kernel = MLAPrefillKernel(ws, candidate.backend, wrapper_cls=self.wrapper_cls)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot be made here is a refusal
            raise CandidateInvalid("unsupported", f"{type(e).__name__}: {e}") from None
        dt = torch_dtype(workload.q_dtype)
        w = workload
        # vLLM's FA3 reads device index pointers and takes the longest spans from the host, as the
        # plugin's backend passes them (vLLM's query_start_loc / cu_seq_lens and max lengths)
        extra = (dict(max_q=w.query_tokens // w.requests, max_kv=w.kv_len, device=device)
                 if fa3 else {})

        def plan():
            kernel.plan(problem.qo_indptr, problem.kv_indptr, w.num_heads, QK_NOPE + QK_ROPE, V_DIM,
                        w.causal, w.softmax_scale, dt, dt, **extra)

        out = torch.empty(w.query_tokens, w.num_heads, V_DIM, dtype=dt, device=device)
        lse = not w.causal            # a context chunk's LSE is what vLLM merges chunks by

        def run():
            return kernel.run(problem.q, problem.k, problem.v, out=out, return_lse=lse)

        t0 = time.perf_counter()
        try:
            plan()
            run()
        except BackendRefused as e:
            raise CandidateInvalid("unsupported", e.reason) from None
        except (RuntimeError, OSError, ImportError) as e:
            text = f"{type(e).__name__} {e}".lower()
            if any(s in text for s in ("ninja", "nvcc", "compil", "build failed", "jit")):
                raise CandidateInvalid("compile", f"{type(e).__name__}: {e}") from None
            raise
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        prepared = Prepared(run=run, plan=plan, out=out, compile_s=time.perf_counter() - t0,
                            graphable=True)
        prepared.kernel = kernel
        return prepared


__all__ = ["FAMILY", "FlashInferPrefillFamily"]
