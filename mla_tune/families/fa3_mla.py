"""vLLM's FA3 MLA decode (the kernel of FLASH_ATTN_MLA, vLLM's own default on Hopper) as a
measurable family, through the plugin's op (`vllm_metax.ops.fa3_mla.FA3MLADecode`: the call the
plugin makes in the buckets a tuned config gives it).

Knobs (`vllm_metax.core.choices`, family `fa3_mla`): `num_splits`, the bound on KV splits (0: FA3's own
heuristic; vLLM passes 0 eagerly and `flash_attn_max_num_splits_for_cuda_graph`, 32, under CUDA
graphs), and `schedule` ("aot": scheduler metadata once per step, reused by every layer, as vLLM
does; "none": each launch schedules). The page size is any multiple of 16 the sweep measures.

Timing: `run()` attends with the step's metadata already computed (every layer's cost); `plan()`
computes the metadata again (the per-step work beyond the layers: one small kernel).
"""

from __future__ import annotations

import time

import torch

from mla_tune.families.base import (Availability, Candidate, CandidateInvalid, Prepared,
                                   refuse_where_it_cannot_run, typed_choice)
from mla_tune.problem.instance import torch_dtype
from mla_tune.problem.workload import Workload
from vllm_metax.core.choices import FA3 as FAMILY, FA3_BACKEND as BACKEND, SPECS
from vllm_metax.ops import fa3_mla as op

SPEC = SPECS[FAMILY]

# the candidates per page: FA3's heuristic (vLLM's eager call), vLLM's CUDA-graph bound (32) and
# a few fixed bounds between; with the in-launch schedule only the heuristic
SPLITS = (0, 1, 2, 4, 8, 16, 32)
VLLM_GRAPH_SPLITS = 32


class FA3MLAFamily:
    family = FAMILY

    def available(self, device: str) -> Availability:
        if not str(device).startswith("cuda"):
            return Availability(False, "vLLM's FA3 MLA needs a CUDA device")
        ok, why = op.fa3_available(device)
        return Availability(ok, why or f"vLLM's FA3 MLA decode ({op.library_path().name})")

    def space(self, workload: Workload, page_sizes: list[int]) -> list[Candidate]:
        pages = [p for p in page_sizes if SPEC.page.allows(p)]
        out = []
        for p in pages:
            out += [Candidate(self.family, BACKEND, p, {"num_splits": s}) for s in SPLITS]
            out.append(Candidate(self.family, BACKEND, p, {"num_splits": 0, "schedule": "none"}))
        return out

    def default_candidate(self, workload: Workload, page_size: int = 64) -> Candidate:
        """What vLLM's FLASH_ATTN_MLA serves under CUDA graphs: ahead-of-time schedule, at most 32
        splits (the block size is the server's)."""
        if not SPEC.page.allows(page_size):
            raise CandidateInvalid("unsupported", f"vLLM's FA3 MLA needs a page that is {SPEC.page}, "
                                   f"not {page_size}")
        return Candidate(self.family, BACKEND, page_size, {"num_splits": VLLM_GRAPH_SPLITS})

    def prepare(self, workload: Workload, candidate: Candidate, problem) -> Prepared:
        choice = typed_choice(candidate)
        q_dt, kv_dt = torch_dtype(workload.q_dtype), torch_dtype(workload.kv_dtype)
        dev = problem.device
        refuse_where_it_cannot_run("vLLM's FA3 MLA", op.check_shapes(
            workload.kv_lora_rank, workload.qk_rope_head_dim, candidate.page_size, q_dt, kv_dt),
            dev, op.fa3_available)
        B, qlen = workload.batch_size, workload.q_len
        seq_lens = problem.seq_lens_cpu.to(dev)
        cu_q = torch.arange(0, (B + 1) * qlen, qlen, dtype=torch.int32, device=dev)
        max_k = int(problem.seq_lens_cpu.max())
        out = torch.empty_like(problem.q_nope)
        kernel = op.FA3MLADecode(workload.softmax_scale, workload.num_heads, candidate.page_size,
                                 choice.num_splits, choice.schedule, max_batch=B, device=dev)

        def plan():
            kernel.schedule(seq_lens, cu_q, qlen, max_k, q_dt)

        def run():
            kernel.run(problem.q_nope, problem.q_pe, problem.ckv_cache, problem.kpe_cache,
                       problem.block_table, seq_lens, cu_q, qlen, max_k, out)
            return out

        t0 = time.perf_counter()
        try:
            plan()
            run()
            torch.cuda.synchronize(dev)
        except (RuntimeError, ValueError) as e:       # FA3's TORCH_CHECKs: a shape it refuses
            raise CandidateInvalid("unsupported", f"FA3 refused: {str(e).splitlines()[0][:300]}") from None
        prepared = Prepared(run=run, plan=plan, out=out, compile_s=time.perf_counter() - t0,
                            graphable=True)
        prepared.kernel = kernel
        return prepared
