"""FlashMLA's dense decode kernel (vLLM's FLASHMLA backend) as a measurable family, through the
plugin's op (`vllm_metax.ops.flashmla.FlashMLADecode`: the call the plugin's FLASHMLA backend
makes, with vLLM's FlashMLA library on Hopper and MetaX's `flash_mla` package on a MetaX GPU).
The choose step maps it to the FLASHMLA attention backend (page 64 only), which the plugin serves.

What a caller of FlashMLA's dense decode can choose, and what of it is a knob: nothing but the
backend itself. The page size is fixed at 64; the split schedule (how many KV splits per request,
which SM part takes which) is computed by FlashMLA's own scheduler kernel from the sequence
lengths and the SM count, with no parameter. So the family has one candidate per bucket,
`flashmla/flashmla/p64`, and what the tuner learns from it is the backend choice: FLASHMLA
against FLASHINFER_MLA and TRITON_MLA, per bucket and over the mix.

Timing: `run()` attends with the step's schedule already computed, which is what every layer
after a step's first costs (the schedule kernel runs once per step, on the first layer); `plan()`
forgets the schedule and computes it again with one eager call (the per-step GPU work beyond the
layers), so plan_us is that call's host + device time, not host work only.
"""

from __future__ import annotations

import time

import torch

from mla_tune.families.base import Availability, Candidate, CandidateInvalid, Prepared, refuse_where_it_cannot_run
from mla_tune.families.triton_mla import packed_query
from mla_tune.problem.instance import torch_dtype
from mla_tune.problem.workload import Workload
from vllm_metax.core.choices import FLASHMLA as FAMILY, FLASHMLA_BACKEND as BACKEND, SPECS
from vllm_metax.core.profile import target_profile
from vllm_metax.ops import flashmla as op

SPEC = SPECS[FAMILY]


class FlashMLAFamily:
    family = FAMILY

    def __init__(self, profile=None):
        """`profile`: the target profile (None: the active one), whose FlashMLA page size (64 on
        both targets) is the family's one page."""
        self.profile = target_profile(profile)

    def available(self, device: str) -> Availability:
        if not str(device).startswith("cuda"):
            return Availability(False, "FlashMLA needs a CUDA device")
        library, why = op.flashmla_library(device)
        if library is None:
            return Availability(False, why)
        where = (op.library_path().name if library == op.VLLM_LIBRARY and op.library_path()
                 else "the flash_mla package")
        return Availability(True, f"FlashMLA dense decode ({where})")

    def space(self, workload: Workload, page_sizes: list[int]) -> list[Candidate]:
        page = SPEC.page.only
        return [Candidate(self.family, BACKEND, page)] if page in page_sizes else []

    def default_candidate(self, workload: Workload, page_size: int = SPEC.page.only) -> Candidate:
        return Candidate(self.family, BACKEND, page_size)

    def prepare(self, workload: Workload, candidate: Candidate, problem) -> Prepared:
        if candidate.backend != BACKEND or candidate.params:
            raise CandidateInvalid("unsupported", f"{candidate.key}: FlashMLA has one candidate, "
                                   f"{SPEC.form}")
        q_dt, kv_dt = torch_dtype(workload.q_dtype), torch_dtype(workload.kv_dtype)
        dev = problem.device
        refuse_where_it_cannot_run("FlashMLA", op.check_shapes(
            workload.num_heads, workload.kv_lora_rank, workload.qk_rope_head_dim, candidate.page_size,
            q_dt, kv_dt), dev, op.flashmla_available)
        B, T = workload.batch_size, workload.batch_size * workload.q_len
        H, R = workload.num_heads, workload.kv_lora_rank
        q = packed_query(problem.q_nope, problem.q_pe).reshape(B, workload.q_len, H, -1)
        seq_lens = problem.seq_lens_cpu.to(dev)
        out = torch.empty(B, workload.q_len, H, R, dtype=q_dt, device=dev)
        out_rows = out.view(T, H, R)         # [B*q_len, H, R]: the layout the reference has
        # vLLM's FlashMLA backend passes causal=True (a no-op at q_len 1)
        kernel = op.FlashMLADecode(workload.softmax_scale, causal=True)

        if workload.q_len == 1:
            def run():
                kernel.run(q, problem.kv_cache, problem.block_table, seq_lens, out)
                return out_rows
        else:
            # at q_len > 1 FlashMLA wants its own output layout (it refuses a [B, q_len, H, 512]
            # out): its output, copied (vLLM's backend also takes FlashMLA's own tensor)
            def run():
                o, _ = kernel.run(q, problem.kv_cache, problem.block_table, seq_lens, None)
                out.copy_(o)
                return out_rows

        def plan():
            kernel.new_step()
            run()

        t0 = time.perf_counter()
        try:
            plan()
            torch.cuda.synchronize(dev)
        except RuntimeError as e:           # FlashMLA's TORCH_CHECKs: a shape it refuses
            raise CandidateInvalid("unsupported", f"FlashMLA refused: {str(e).splitlines()[0][:300]}") from None
        compile_s = time.perf_counter() - t0
        prepared = Prepared(run=run, plan=plan, out=out_rows, compile_s=compile_s,
                            graphable=True)
        prepared.kernel = kernel
        return prepared
