"""The split-KV Triton decode kernel (`vllm_metax.ops.split_decode`) as a measurable family: the
kernel FLASHINFER_MLA's decode serves for the buckets where it beats FlashInfer
(`vllm_metax.core.decisions.split_serves`).

Why it exists: FlashInfer's MLA kernels merge a request's KV chunks with one (request, head) per
merge item, so at batch 1-2 with 16 heads they can neither split a long context finely nor merge
the splits fast (their best KV chunking there is x2, fewer splits). This kernel reduces each split
into a partial and merges them in a second kernel spread over (head, 64 columns, request)
programs. Measured on the H200 at 16 heads (bench/results/small_decode_kernel_h200.txt, run `merge`):
1.15-1.65x faster than fa3 at batch 1-2, slower from batch 4 and at 128 heads.

Knobs (`vllm_metax.ops.split_decode.served` fixes the rest): `num_splits`, the splits per
request, every power of two from 4 whose splits a request of the bucket's longest length actually
uses (tile-aligned chunks) and whose launch fits `MAX_PROGRAMS`; `partial`, the partials'
dtype: bfloat16 for every split count (half the merge traffic; measured faster at every shape),
float32 at the default count; `pipe` (`split_decode.PIPES`), how a split's tiles are cut and
pipelined. The default: the served pipe "t64" (a candidate without `pipe`, as every trial stored
before the knob) at one wave of 132 programs (splits x head blocks x requests), as a server would
pick without measuring. q_len 1 and page 64 only (the spec's `sweep_pages`).

The other pipes are measured where the split count can be best, not at every count: in the
H200's default sweep the t64 kernel's best count was the one-wave default in 96 of 104 buckets
(2x it in 4, 4x-8x in 4; results.db, 2026-12-04). So "t32x4" (32-token tiles, 4 stages) is
offered at its own one-wave count and the useful counts beside it (one step down, one up; from
1 split a request, so a batch that fills the GPU by itself is not split), and the "-pdl" pipes
(one launch latency less, which only small work feels) at the one-wave count of buckets of at
most SMALL_WORK_TOKENS KV tokens.
"""

from __future__ import annotations

import os
import time

import torch

from mla_tune.families.base import (Availability, Candidate, CandidateInvalid, Prepared,
                                   refuse_outside_profile, typed_choice)
from mla_tune.problem.workload import Workload
from vllm_metax.core.choices import SPECS, SPLIT as FAMILY
from vllm_metax.core.choices import SPLIT_BACKEND as BACKEND
from vllm_metax.core.profile import target_profile
from vllm_metax.core.split_facts import PIPES, SERVED_PIPE   # its candidates carry no `pipe` knob

(PAGE,) = SPECS[FAMILY].sweep_pages      # the one page it is measured (and served) at: the spec's

WAVE = 132                 # programs of one wave on the H200 the default is written for
SPLIT_COUNTS = tuple(2 ** i for i in range(2, 9))     # 4..256
# the other pipes may also run a request in one or two splits: a batch that fills the GPU on its
# own (B x head blocks >= one wave) then has no merge (one split) or a short one, and the
# pipelined tile loop keeps its copies in flight along the whole request
PIPE_SPLIT_COUNTS = (1, 2) + SPLIT_COUNTS
# the "-pdl" pipes are offered where a bucket's KV tokens (requests x longest length) are at most
# this: where a launch latency (a few us) is a large part of the call
SMALL_WORK_TOKENS = 16384


def _op():
    from vllm_metax.ops import split_decode    # lazy: it imports Triton, which may be absent (`available` says so)
    return split_decode


def useful_splits(num_heads: int, batch_size: int, max_len: int, pipe: str = SERVED_PIPE) -> list[int]:
    """SPLIT_COUNTS (PIPE_SPLIT_COUNTS for a pipe other than the served one) that give a request
    of `max_len` more splits in use than the count before (chunks aligned to the pipe's tile),
    and whose launch fits the served workspace."""
    op = _op()
    block_n = op.pipe_of(pipe).block_n
    out, seen = [], set()
    for s in SPLIT_COUNTS if pipe == SERVED_PIPE else PIPE_SPLIT_COUNTS:
        used = op.splits_for(max_len, block_n, s)
        if used in seen or not op.fits(num_heads, batch_size, s, pipe):
            continue
        seen.add(used)
        out.append(s)
    return out


def default_splits(num_heads: int, batch_size: int, max_len: int, pipe: str = SERVED_PIPE) -> int | None:
    """One wave: the largest useful count with splits x head blocks x requests <= WAVE (the
    smallest useful one where none is that small); None when no count is useful."""
    useful = useful_splits(num_heads, batch_size, max_len, pipe)
    if not useful:
        return None
    hb = -(-num_heads // _op().pipe_of(pipe).head_block(num_heads))
    fit = [s for s in useful if s * hb * batch_size <= WAVE]
    return fit[-1] if fit else useful[0]


def pipe_splits(num_heads: int, batch_size: int, max_len: int, pipe: str) -> list[int]:
    """The split counts a pipe other than the served one is measured at: its one-wave count and
    the useful counts beside it ("-pdl" pipes: the one-wave count, small work only)."""
    useful = useful_splits(num_heads, batch_size, max_len, pipe)
    wave = default_splits(num_heads, batch_size, max_len, pipe)
    if wave is None:
        return []
    if pipe.endswith("-pdl"):
        return [wave] if batch_size * max_len <= SMALL_WORK_TOKENS else []
    i = useful.index(wave)
    return useful[max(0, i - 1):i + 2]


class SplitFamily:
    family = FAMILY

    def __init__(self, profile=None):
        """`profile`: the target profile (None: the active one); its pipes only, and no TMA
        kernel where its target has no tensor-memory accelerator."""
        self.profile = target_profile(profile)

    def available(self, device: str) -> Availability:
        if not str(device).startswith("cuda"):
            return Availability(False, "the split kernel is timed on a CUDA device (Triton)")
        try:
            import triton  # noqa: F401 - lazy: this is the question (Triton may be absent)
        except ImportError as e:
            return Availability(False, f"triton is not importable: {e}")
        return Availability(True, "split-KV Triton decode (vllm_metax.ops.split_decode)")

    @staticmethod
    def _servable(workload: Workload) -> bool:
        return workload.q_len == 1

    def space(self, workload: Workload, page_sizes: list[int]) -> list[Candidate]:
        if not self._servable(workload) or PAGE not in page_sizes:
            return []
        H, B, max_len = workload.num_heads, workload.batch_size, max(workload.seq_lens)
        default = default_splits(H, B, max_len)
        out = [Candidate(self.family, BACKEND, PAGE, {"num_splits": s, "partial": "bfloat16"})
               for s in useful_splits(H, B, max_len)]
        if default is not None:
            out.append(Candidate(self.family, BACKEND, PAGE,
                                 {"num_splits": default, "partial": "float32"}))
        for pipe in PIPES:
            if pipe != SERVED_PIPE and pipe in self.profile.split_pipes:
                out += [Candidate(self.family, BACKEND, PAGE,
                                  {"num_splits": s, "partial": "bfloat16", "pipe": pipe})
                        for s in pipe_splits(H, B, max_len, pipe)]
        return out

    def default_candidate(self, workload: Workload, page_size: int = PAGE) -> Candidate:
        s = default_splits(workload.num_heads, workload.batch_size, max(workload.seq_lens))
        if s is None or not self._servable(workload) or page_size != PAGE:
            raise CandidateInvalid("unsupported", f"the split kernel has no candidate here (q_len 1 "
                                   f"and page {PAGE} only, a launch within its workspace)")
        return Candidate(self.family, BACKEND, page_size, {"num_splits": s, "partial": "bfloat16"})

    def prepare(self, workload: Workload, candidate: Candidate, problem) -> Prepared:
        op = _op()
        choice = typed_choice(candidate)
        if not self._servable(workload):
            raise CandidateInvalid("unsupported", "the split kernel decodes q_len 1 only")
        refuse_outside_profile(candidate, self.profile)
        dev = problem.device
        if dev.type != "cuda" and not _interpreted():
            raise CandidateInvalid("unsupported", "the split kernel needs a CUDA device (or Triton's interpreter)")
        s, partial, pipe = choice.num_splits, choice.partial, choice.pipe
        H = workload.num_heads
        try:
            if not op.fits(H, workload.batch_size, s, pipe):
                raise ValueError(f"num_splits={s} x {workload.batch_size} requests exceeds the served "
                                 f"workspace ({op.served_rows(H, pipe)} rows)")
            kernel = op.served(s, partial, H, candidate.page_size, workload.batch_size, dev,
                               kv_lora_rank=workload.kv_lora_rank, rope_dim=workload.qk_rope_head_dim,
                               pipe=pipe, profile=self.profile)
        except ValueError as e:
            raise CandidateInvalid("unsupported", str(e)) from None
        seq_lens = problem.seq_lens_cpu.to(dev)
        out = torch.empty_like(problem.q_nope)
        args = (problem.q_nope, problem.q_pe, problem.ckv_cache, problem.kpe_cache, problem.block_table,
                seq_lens, workload.softmax_scale, out)

        def run():
            return kernel.run(*args)

        t0 = time.perf_counter()
        try:
            run()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001 - Triton's compile errors have no common base
            reason = "compile" if "triton" in type(e).__module__ or "Compil" in type(e).__name__ else "runtime"
            raise CandidateInvalid(reason, f"split kernel: {type(e).__name__}: {str(e)[:300]}") from None
        prepared = Prepared(run=run, plan=None, out=out, compile_s=time.perf_counter() - t0,
                            graphable=True)
        prepared.kernel = kernel
        return prepared


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
