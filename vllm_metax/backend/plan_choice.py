"""Which kernel plans each decode step of FLASHINFER_MLA (vllm-free): the FlashInfer backend value
and KV chunking of the nearest tuned bucket, or the split-KV Triton kernel, FlashMLA or vLLM's FA3
MLA kernel where the tuned config serves them (`PlanChoice.kernel`, by
`decisions.flashinfer_mla_kernel`: the builder asks once a step, and again without a kernel that
cannot run here); a captured CUDA graph fixes its choice per batch size. `bench/plan_cost.py`
times it."""

from __future__ import annotations

import collections

from vllm_metax.core import choices, decisions
from vllm_metax.core.log import get_logger
from vllm_metax.core.tuned_config import ModelEntry
from vllm_metax.ops import split_decode

logger = get_logger(__name__)

# the side kernels for people (the server log's summary)
SIDE_NAMES = {choices.SPLIT: "split-KV Triton", choices.FLASHMLA: "FlashMLA", choices.FA3: "vLLM FA3"}
# what the server log says when a side kernel cannot run here: what it was, what runs instead
_TURNED_OFF = {
    choices.SPLIT: ("split-KV decode kernel", "FlashInfer decodes every step"),
    choices.FA3: ("vLLM FA3 MLA decode", "FlashInfer decodes those steps"),
    choices.FLASHMLA: ("FlashMLA decode buckets",
                       "those steps run FlashInfer (or vLLM's FA3 where it serves the bucket)"),
}


class PlanChoice:
    """Which FlashInfer backend value plans a decode step: the tuned bucket's choice when it may
    run here, else the device default (`decisions.FlashInferBackends.serve`). Lookups cost a few
    microseconds, no I/O."""

    def __init__(self, entry: ModelEntry | None, backends: decisions.FlashInferBackends):
        self.entry = entry
        self.backends = backends
        self._graph: dict = {}
        # side kernel -> bucket id -> its knobs, where it serves that bucket (decided once, per
        # file): the split kernel at q_len 1, vLLM's FA3 and FlashMLA at any q_len (the builder
        # checks FlashMLA's KV block size, 64, and that a FlashMLA library runs here)
        buckets = [] if entry is None else entry.buckets
        self._served: dict[str, dict] = {
            choices.SPLIT: {id(b): c for b in buckets
                            if b.q_len == 1 and (c := decisions.split_serves(b)) is not None},
            choices.FA3: {id(b): c for b in buckets if (c := decisions.fa3_serves(b)) is not None},
            choices.FLASHMLA: {id(b): c for b in buckets
                               if (c := decisions.flashmla_serves(b)) is not None}}
        self._graph_side: dict[str, dict] = {f: {} for f in self._served}   # (batch, q_len) -> vote
        self._off: set = set()                # side kernels that cannot run in this process
        self._found: tuple = (None, None)     # the last step's (lookup key, bucket): one lookup a step
        # (bucket id, q_len 1?, page, kernels skipped, lse) -> decisions.flashinfer_mla_kernel's
        # answer: asked once per bucket and case, cleared when the device refuses a backend
        self._kernels: dict = {}
        self._warn_unservable()

    @property
    def default(self) -> str:
        return self.backends.default

    @property
    def allowed(self) -> tuple:
        return self.backends.allowed

    def _warn_unservable(self) -> None:
        if self.entry is None:
            return
        named = {c.backend for b in self.entry.buckets
                 if (c := decisions.bucket_choice(b, choices.FLASHINFER)) is not None}
        unservable = sorted(named - set(self.allowed) - {decisions.AUTO})
        if unservable:
            logger.warning("vllm_metax MLA: the tuned config names FlashInfer backend(s) %s, which "
                           "this device does not run (it runs %s); those buckets plan %r",
                           ", ".join(unservable), ", ".join(self.allowed), self.default)

    def describe(self) -> str:
        """Which kernel decodes which tuned buckets (for the server log)."""
        if self.entry is None:
            return f"FlashInfer {self.default} every step (untuned)"
        served = collections.Counter(self._served_name(b) for b in self.entry.buckets)
        split_batches = sorted({b.batch_size for b in self.entry.buckets
                                if id(b) in self._served[choices.SPLIT]})
        where = f" (split at batch {', '.join(map(str, split_batches))})" if split_batches else ""
        return (", ".join(f"{k} in {n}" for k, n in served.most_common())
                + f" of {len(self.entry.buckets)} tuned buckets{where}; the nearest bucket decides each step")

    def _served_name(self, b) -> str:
        """The kernel a step of bucket `b` runs, for people (`decisions.flashinfer_mla_kernel`; a
        kernel turned off is skipped)."""
        served = decisions.flashinfer_mla_kernel(b, b.q_len, self.backends, skip=self.turned_off())
        return (f"FlashInfer {served.choice.backend}" if served.family == choices.FLASHINFER
                else SIDE_NAMES[served.family])

    def turned_off(self) -> frozenset:
        """The side kernels that cannot run here (turned off for this process)."""
        return frozenset(self._off)

    @property
    def split_enabled(self) -> bool:
        return choices.SPLIT not in self._off

    @property
    def fa3_enabled(self) -> bool:
        return choices.FA3 not in self._off

    @property
    def flashmla_enabled(self) -> bool:
        return choices.FLASHMLA not in self._off

    def _choices(self, family: str) -> list:
        """Every choice of side kernel `family` the entry may serve (distinct knobs, in bucket order)."""
        return [] if family in self._off else list(dict.fromkeys(self._served[family].values()))

    def turn_off(self, family: str, reason: str) -> None:
        """Side kernel `family` cannot run here: the next kernel that serves its steps runs them
        from now on (said once, where it serves a bucket)."""
        if family not in self._off and self._served[family]:
            what, instead = _TURNED_OFF[family]
            logger.warning("vllm_metax MLA: the tuned config's %s cannot run here (%s); %s",
                           what, reason, instead)
        self._off.add(family)
        self._graph_side[family].clear()

    def kernel(self, batch_size: int, context_len: int, q_len: int = 1, graph: bool = False, *,
               lse: bool = False, page_size: int | None = None, skip=()) -> decisions.DecodeKernel:
        """The kernel that decodes this step and its knobs: `decisions.flashinfer_mla_kernel` of
        the nearest tuned bucket (eagerly), or in a captured graph its batch size's vote per side
        kernel in the same order (`split_for`, `flashmla_for`, `fa3_for`), else FlashInfer
        (`step`). `lse`: the step returns the decode LSE (no side kernel does); `page_size`: the
        KV cache's (FlashMLA runs at 64 only; None: not checked); `skip`: side kernels that could
        not run for this step. The split kernel serves only a launch its workspace holds."""
        skip = self.turned_off() | frozenset(skip)
        found = self._lookup(batch_size, context_len, q_len)
        bucket = found.bucket if found is not None else None
        if graph:
            asks = {choices.SPLIT: self.split_for, choices.FLASHMLA: self.flashmla_for,
                    choices.FA3: self.fa3_for}
            skip |= decisions.without_lse(lse)
            side = next(((f, c) for f in decisions.SIDE_KERNELS if f not in skip
                         and (f != choices.FLASHMLA or decisions.flashmla_runs_at(page_size))
                         and (c := asks[f](batch_size, context_len, q_len, graph=True)) is not None),
                        None)
            if side is not None:
                return decisions.DecodeKernel(decisions.FLASHINFER_MLA, *side, bucket)
            return decisions.DecodeKernel(decisions.FLASHINFER_MLA, choices.FLASHINFER,
                                          self._flashinfer(bucket, batch_size, q_len, graph), bucket)
        key = (id(bucket), q_len == 1, page_size, skip, lse)
        served = self._kernels.get(key)
        if served is None:
            served = self._kernels[key] = decisions.flashinfer_mla_kernel(
                bucket, q_len, self.backends, page_size=page_size, skip=skip, lse=lse)
        if served.family == choices.SPLIT and not split_decode.fits(
                self.entry.dims.num_heads, batch_size, served.choice.num_splits, served.choice.pipe):
            return self.kernel(batch_size, context_len, q_len, graph, lse=lse, page_size=page_size,
                               skip=skip | {choices.SPLIT})
        return served

    def _flashinfer(self, bucket, batch_size: int, q_len: int, graph: bool) -> choices.FlashInferChoice:
        """The FlashInfer backend value and KV chunking a step of `bucket` plans: the bucket's
        value where this device runs it (in a captured graph: its batch size's, `for_graph`), its
        chunking only where that value is the one tuned."""
        typed = decisions.bucket_choice(bucket, choices.FLASHINFER)
        backend = self.for_graph(batch_size, q_len) if graph else self.backends.serve(typed)
        return choices.FlashInferChoice(
            backend, typed.kv_chunk if typed is not None and typed.backend == backend else None)

    def for_bucket(self, bucket) -> str:
        return self.backends.serve(decisions.bucket_choice(bucket, choices.FLASHINFER))

    def for_step(self, batch_size: int, context_len: int, q_len: int = 1) -> str:
        """`context_len` is `decisions.bucket_context` of the batch's sequence lengths."""
        return self.step(batch_size, context_len, q_len)[0]

    def step(self, batch_size: int, context_len: int, q_len: int = 1,
             graph: bool = False) -> tuple[str, float | None]:
        """(backend value, KV chunk factor) for one decode step: the nearest tuned bucket's.
        A captured graph keeps its batch size's backend (`for_graph`); the chunking is only data
        the step's plan writes, so it follows the bucket in graphs too. The chunk factor is the
        bucket's only where the served backend is the one it was tuned for."""
        found = self._lookup(batch_size, context_len, q_len)
        served = self._flashinfer(found.bucket if found is not None else None, batch_size, q_len, graph)
        return served.backend, served.kv_chunk_factor

    def for_graph(self, batch_size: int, q_len: int = 1) -> str:
        """A captured graph fixes its kernel for every context: the choice most buckets of the
        nearest tuned batch size make."""
        key = (batch_size, q_len)
        if key not in self._graph:
            self._graph[key] = self._graph_choice(batch_size, q_len)
        return self._graph[key]

    def _graph_choice(self, batch_size: int, q_len: int) -> str:
        if self.entry is None or not self.entry.buckets:
            return self.default
        found = self.entry.lookup(batch_size, 1, q_len)
        b, q = found.bucket.batch_size, found.bucket.q_len
        votes = collections.Counter(
            self.for_bucket(x) for x in self.entry.buckets if x.batch_size == b and x.q_len == q)
        return votes.most_common(1)[0][0] if votes else self.default

    def split_for(self, batch_size: int, context_len: int, q_len: int = 1,
                  graph: bool = False) -> choices.SplitChoice | None:
        """The split kernel's knobs where this step should run it instead of FlashInfer
        (`decisions.split_serves` of the nearest tuned bucket, for a launch its workspace holds),
        else None. A captured graph fixes
        its kernel for every context: split there only where it serves most buckets of the
        nearest tuned batch size, with the knobs most of those name (ties: the longest context's)."""
        if q_len != 1:
            return None
        choice = self._side_for(choices.SPLIT, batch_size, context_len, q_len, graph)
        if choice is None or not split_decode.fits(self.entry.dims.num_heads, batch_size, choice.num_splits,
                                                   choice.pipe):
            return None
        return choice

    def fa3_for(self, batch_size: int, context_len: int, q_len: int = 1,
                graph: bool = False) -> choices.FA3Choice | None:
        """vLLM's FA3 kernel's knobs where this step should run it instead of FlashInfer
        (`decisions.fa3_serves` of the nearest tuned bucket), else None. A captured graph fixes
        its kernel for every context: FA3 there only where it serves most buckets of the nearest
        tuned batch size (and q_len), with the knobs most of those name."""
        return self._side_for(choices.FA3, batch_size, context_len, q_len, graph)

    def flashmla_for(self, batch_size: int, context_len: int, q_len: int = 1,
                     graph: bool = False) -> choices.FlashMLAChoice | None:
        """FlashMLA's choice where this step should run it instead of FlashInfer
        (`decisions.flashmla_serves` of the nearest tuned bucket), else None. A captured graph
        fixes its kernel for every context: FlashMLA there only where it serves most buckets of
        the nearest tuned batch size (and q_len)."""
        return self._side_for(choices.FLASHMLA, batch_size, context_len, q_len, graph)

    def serves_flashmla(self) -> bool:
        """FlashMLA serves some bucket of the entry (and has not been turned off)."""
        return self.flashmla_enabled and bool(self._served[choices.FLASHMLA])

    def _side_for(self, family: str, batch_size: int, context_len: int, q_len: int, graph: bool):
        """Side kernel `family`'s choice for one step: the nearest bucket's, or in a captured graph
        its batch size's vote (`_graph_vote`, remembered per batch size); None where it is off."""
        served_in, graph_cache = self._served[family], self._graph_side[family]
        if not served_in or family in self._off:
            return None
        if graph:
            key = (batch_size, q_len)
            if key not in graph_cache:
                graph_cache[key] = self._graph_vote(served_in, batch_size, q_len)
            return graph_cache[key]
        found = self._lookup(batch_size, context_len, q_len)
        return served_in.get(id(found.bucket)) if found is not None else None

    def fa3_choices(self) -> list:
        """Every FA3 choice the entry may serve (distinct knobs, in bucket order)."""
        return self._choices(choices.FA3)

    def _lookup(self, batch_size: int, context_len: int, q_len: int):
        """`entry.lookup`, remembered for the last key: a step asks for the split kernel and then
        for the FlashInfer plan with the same key."""
        key = (batch_size, context_len, q_len)
        if self._found[0] != key:
            self._found = (key, None if self.entry is None else self.entry.lookup(*key))
        return self._found[1]

    def _graph_vote(self, served_in: dict, batch_size: int, q_len: int):
        """A captured graph's side-kernel knobs: those of `served_in` (bucket id -> choice) where
        it serves most buckets of the nearest tuned batch size, the knobs most of those name
        (ties: the longest context's); None where it serves half or fewer."""
        found = self.entry.lookup(batch_size, 1, q_len)
        if found is None:
            return None
        at_b = [x for x in self.entry.buckets
                if x.batch_size == found.bucket.batch_size and x.q_len == found.bucket.q_len]
        served = [(x.context_len, c) for x in at_b if (c := served_in.get(id(x))) is not None]
        if 2 * len(served) <= len(at_b):
            return None
        votes = collections.Counter(c for _, c in served)
        top = max(votes.values())
        return max((t for t in served if votes[t[1]] == top), key=lambda t: t[0])[1]

    def split_choices(self) -> list:
        """Every split choice the entry may serve (distinct knobs, in bucket order)."""
        return self._choices(choices.SPLIT)

    def refuse(self, backend: str, reason: str) -> str:
        """FlashInfer refused `backend` here: never choose it again; returns the fallback."""
        fallback = self.backends.fallback
        logger.warning("vllm_metax MLA: FlashInfer backend %r cannot plan here (%s); using %r",
                       backend, reason, fallback)
        allowed = tuple(b for b in self.allowed if b != backend) or (fallback,)
        default = fallback if self.default == backend else self.default
        self.backends = decisions.FlashInferBackends(allowed, default, fallback)
        self._graph.clear()
        self._kernels.clear()
        return fallback
