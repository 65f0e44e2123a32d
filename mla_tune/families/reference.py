"""The torch reference as a measurable family: what `mla-tune sweep` measures on a machine without
CUDA. It is the correctness oracle, not a serving kernel; its numbers say nothing about GPU kernels."""

from __future__ import annotations

from mla_tune.families.base import Availability, Candidate, Prepared
from mla_tune.problem.workload import Workload
from mla_tune.problem.reference import mla_decode_reference


class ReferenceFamily:
    family = "reference"

    def available(self, device: str) -> Availability:
        return Availability(True, "torch reference (runs anywhere)")

    def space(self, workload: Workload, page_sizes: list[int]) -> list[Candidate]:
        return [Candidate(self.family, "torch", p) for p in page_sizes]

    def default_candidate(self, workload: Workload, page_size: int) -> Candidate:
        return Candidate(self.family, "torch", page_size)

    def prepare(self, workload: Workload, candidate: Candidate, problem) -> Prepared:
        holder = {}

        def run():
            holder["out"] = mla_decode_reference(
                problem.q_nope, problem.q_pe, problem.ckv_cache, problem.kpe_cache,
                problem.block_table, problem.seq_lens_cpu, workload.softmax_scale, workload.q_len)
            return holder["out"]

        return Prepared(run=run, plan=None, out=None, compile_s=0.0, graphable=False)
