"""What the tuner measures and the plugin serves, decided in one place (vllm-free, stdlib only).

Both sides import this module, so they cannot drift apart:

* which FlashInfer MLA backend values a device may run, its untuned default and the fallback
  after a refusal (`flashinfer_backends`): the tuner's search space and baseline, the plugin's
  plan-time choices;
* the tuned-config model key (`model_key`): one `ModelDims`, with one dtype spelling;
* the lookup statistic (`bucket_context`): a batch's per-request KV lengths -> the bucket context
  the tuner measured (the mean; a uniform bucket of context c has every length c);
* what each kernel family's stored parameters mean (`FlashInferChoice` with its KV chunking,
  `TritonChoice`, `SplitChoice`; defined in `vllm_metax.core.choices`), "keep vLLM's
  rule" included, read by the plugin and written by `mla-tune emit`;
* which kernel FLASHINFER_MLA's decode runs in a tuned bucket instead of FlashInfer, first that
  serves: the split kernel (`split_serves`, q_len 1 only), FlashMLA (`flashmla_serves`), vLLM's FA3
  (`fa3_serves`); `side_kernel` applies that order;
* which kernel serves a decode step, with which knobs (`decode_kernel`): the attention backend's
  decode (FLASHINFER_MLA's side kernels or FlashInfer, TRITON_MLA's split count within its
  context window and its launch, FLASHMLA), what the plugin runs and `mla-tune show --lookup`,
  doctor and the bench scripts say;
* the MLA prefill backend (`prefill_statistic`, `prefill_backend`): the lookup statistic of one
  prefill plan (total query tokens, mean KV tokens per request) and the FlashInfer ragged-prefill
  backend that plan runs, from the same per-device allowed set as decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# the typed choices, their knobs and the params <-> choice parsing: vllm_metax.core.choices (callers
# import them from there)
from vllm_metax.core.choices import (
    FA3, FLASHINFER, FLASHMLA, SPECS, SPLIT, TRITON, FA3Choice, FlashInferChoice, FlashMLAChoice,
    SplitChoice, TritonChoice, family_choice,
)
from vllm_metax.core.profile import target_profile, why_unservable
from vllm_metax.core.tuned_config import FLASHINFER_PREFILL_BACKENDS, VLLM_FA3_PREFILL, ModelDims
# FLASHINFER_MLA's decode runs a bucket with the split kernel only where the sweep measured it at
# least this much faster than the bucket's FlashInfer choice (the choice rule's ratio: a tie
# or noise keeps FlashInfer)
SPLIT_MIN_GAIN = 1.05
AUTO = "auto"               # FlashInfer's own policy value: never planned by the plugin
FALLBACK_BACKEND = "fa2"    # what a refused backend falls back to: FlashInfer's generic SM80+ MLA


# ---------------------------------------------------------------- FlashInfer backend values

@dataclass(frozen=True)
class FlashInferBackends:
    """The FlashInfer MLA backend values a device may plan (best first) and its untuned default."""

    allowed: tuple
    default: str
    fallback: str = FALLBACK_BACKEND

    def serve(self, choice: "FlashInferChoice | None") -> str:
        """The value a decode step plans for a bucket's choice: the tuned value when this device
        may run it, else the default (`auto`, the baseline of configs written before the tuner
        measured the device default, is the default here)."""
        if choice is not None and choice.backend in self.allowed:
            return choice.backend
        return self.default

    def limited_to(self, values: tuple | None) -> "FlashInferBackends":
        """These backends within `values` (a profile's; None: all of them), the default the first
        allowed one where the device default is not among them."""
        if values is None:
            return self
        allowed = tuple(b for b in self.allowed if b in values) or (self.fallback,)
        return FlashInferBackends(allowed, self.default if self.default in allowed else allowed[0],
                                  self.fallback)


def flashinfer_backends(is_metax: bool, capability: tuple | None) -> FlashInferBackends:
    """Hopper (SM90): fa3 (faster at every measured shape) and fa2; MetaX, whose FlashInfer build
    has fa2 only, and every other CUDA GPU: fa2. `auto` is never a choice: on MetaX it could
    pick fa3 from an SM number that means nothing there, elsewhere it is the default under
    another name. The Blackwell-only values (cutlass, trtllm-gen, xqa, cute-dsl) have never run
    through the plugin's decode path, so neither side offers them."""
    if not is_metax and capability is not None and capability[0] == 9:
        return FlashInferBackends(("fa3", "fa2"), "fa3")
    return FlashInferBackends(("fa2",), "fa2")


# ---------------------------------------------------------------- the model key

def dtype_name(dtype, model_dtype=None) -> str:
    """The tuned-config spelling of a dtype: torch.bfloat16 or "bfloat16" -> "bfloat16";
    "auto" or None (vLLM's cache_dtype default) -> the model's dtype."""
    if dtype is None or dtype == "auto":
        dtype = model_dtype
    return str(dtype).removeprefix("torch.")


def model_key(num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, q_dtype,
              kv_dtype=None) -> ModelDims:
    """The tuned-config key of a model entry: heads per rank (what the kernel sees), ranks and
    dtypes (`kv_dtype` "auto"/None means `q_dtype`)."""
    q = dtype_name(q_dtype)
    return ModelDims(int(num_heads), int(kv_lora_rank), int(qk_rope_head_dim), q,
                     dtype_name(kv_dtype, q))


# ---------------------------------------------------------------- the lookup statistic

def bucket_context(seq_lens: Sequence[int]) -> int:
    """A decode batch's per-request KV lengths -> the context a tuned bucket is looked up by: the
    mean length (a uniform bucket of context c has every length c; a ragged bucket's lengths have
    mean about c). Works on lists, tuples, numpy arrays and torch CPU tensors."""
    n = len(seq_lens)
    if n == 0:
        return 1
    total = int(sum(seq_lens)) if not hasattr(seq_lens, "sum") else int(seq_lens.sum())
    return max(1, total // n)


# ---------------------------------------------------------------- the MLA prefill backend

def prefill_backends(is_metax: bool, capability: tuple | None,
                     vllm_fa3: bool = False) -> FlashInferBackends:
    """The MLA prefill backend values a device may plan and its untuned default: FlashInfer's
    ragged prefill by the decode rule (`flashinfer_backends`: fa3/fa2 on Hopper, default fa3; fa2
    only on MetaX, whose FlashInfer build has no fa3, and on every other GPU), limited to fa2/fa3,
    and on Hopper, where vLLM's FA3 library loads (`vllm_fa3`), vLLM's own FA3 varlen prefill
    (`VLLM_FA3_PREFILL`, what vLLM's FLASH_ATTN prefill backend runs there). The default stays
    FlashInfer's: vLLM's FA3 serves only the buckets a tuned config gives it."""
    fb = flashinfer_backends(is_metax, capability)
    allowed = tuple(b for b in fb.allowed if b in FLASHINFER_PREFILL_BACKENDS)
    if vllm_fa3 and not is_metax and capability is not None and capability[0] == 9:
        allowed += (VLLM_FA3_PREFILL,)
    return FlashInferBackends(allowed, fb.default, fb.fallback)


def prefill_statistic(query_tokens: int, kv_tokens: int, requests: int) -> tuple[int, int]:
    """One prefill plan -> the (query_tokens, kv_len) a tuned prefill bucket is looked up by: the
    plan's total query tokens and its mean KV tokens per request. Both come from the host index
    pointers at plan time (the new tokens: kv = q per request, causal; a context chunk: the
    chunk's context tokens over its requests). The total query tokens say how many query tiles
    (x heads) the kernel spreads over the GPU; the KV tokens per request how long each one runs:
    a 256-token prefill split over 4 requests (kv 64 each) is a different bucket from one
    256-token request, as it measured (bench/results/prefill_choice_h200.md)."""
    q = max(1, int(query_tokens))
    return q, max(1, int(kv_tokens) // max(1, int(requests)))


def prefill_backend(entry, causal: bool, query_tokens: int, kv_len: int,
                    backends: FlashInferBackends) -> str:
    """The ragged-prefill backend one prefill plan runs: the nearest tuned prefill bucket's value
    (`tuned_config.ModelEntry.prefill_lookup`, same plan kind) when this device may run it, else
    the device default (untuned, no prefill section, or a value the device does not run)."""
    found = entry.prefill_lookup(causal, query_tokens, kv_len) if entry is not None else None
    if found is not None and found.params.get("backend") in backends.allowed:
        return found.params["backend"]
    return backends.default


def unservable_prefill(entry, backends: FlashInferBackends) -> list[str]:
    """The prefill backend values an entry names that this device does not run (sorted)."""
    if entry is None:
        return []
    return sorted({p.params.get("backend") for p in entry.prefill} - set(backends.allowed))


# ---------------------------------------------------------------- per-family choices

def split_serves(bucket, profile=None) -> "SplitChoice | None":
    """The split kernel's choice where FLASHINFER_MLA's decode should run it in this bucket: the
    bucket names split as its best family, and split measured at least SPLIT_MIN_GAIN times
    faster than the bucket's FlashInfer choice (both times from the same sweep). None: run
    FlashInfer (no split choice, no FlashInfer time to compare, too small a gain, or a pipe
    `profile` (default: the active one) cannot run)."""
    return _side_serves(bucket, SPLIT, profile)


def fa3_serves(bucket, profile=None) -> "FA3Choice | None":
    """vLLM's FA3 MLA kernel's choice where FLASHINFER_MLA's decode should run it in this bucket.
    FA3 is vLLM's own default on Hopper, so the rule is the other way round from the split
    kernel's: where the sweep measured FA3 in the bucket, it serves unless the bucket's FlashInfer
    choice measured at least SPLIT_MIN_GAIN times faster (the split kernel and FlashMLA, where
    they serve, come first: `side_kernel`). None: no FA3 choice or time, FlashInfer clearly
    faster, or a target `profile` (default: the active one) without vLLM's FA3 (metax)."""
    if bucket is None:
        return None
    sc, fc = bucket.families.get(FA3), bucket.families.get(FLASHINFER)
    choice = family_choice(FA3, sc.params) if sc is not None else None
    if choice is None or not sc.time_us or why_unservable(FA3, sc.params, target_profile(profile)):
        return None
    if fc is not None and fc.time_us and sc.time_us >= SPLIT_MIN_GAIN * fc.time_us:
        return None
    return choice


def flashmla_serves(bucket, profile=None, page_size: int | None = None) -> "FlashMLAChoice | None":
    """FlashMLA's choice where FLASHINFER_MLA's decode should run it in this bucket, by the split
    kernel's rule: the bucket names flashmla as its best family, measured at least SPLIT_MIN_GAIN
    times faster than the bucket's FlashInfer choice, under a `profile` (default: the active one)
    that runs it. `page_size`: the entry's KV block size, None where the caller checks the
    cache's own (FlashMLA runs at its spec's page, 64, only: `flashmla_runs_at`)."""
    prof = target_profile(profile)
    if not flashmla_runs_at(page_size):
        return None
    return _side_serves(bucket, FLASHMLA, prof)


def flashmla_runs_at(page_size: int | None) -> bool:
    """FlashMLA runs at this KV block size (its spec's page rule; None: unchecked)."""
    return page_size is None or SPECS[FLASHMLA].page.allows(page_size)


SIDE_KERNELS = (SPLIT, FLASHMLA, FA3)     # FLASHINFER_MLA's decode asks them in this order


def side_kernel(bucket, profile=None, page_size: int | None = None, skip=(),
                q_len: int | None = None) -> tuple | None:
    """(family, choice) of the kernel FLASHINFER_MLA's decode runs in this bucket instead of
    FlashInfer, the first of SIDE_KERNELS that serves and is not in `skip`: the split kernel
    (q_len 1: the bucket's, and the step's `q_len` where given), FlashMLA, vLLM's FA3; None:
    FlashInfer. The plugin keeps the order per step and falls to the next where one cannot run."""
    if bucket is None:
        return None
    serving = {SPLIT: split_serves, FLASHMLA: flashmla_serves, FA3: fa3_serves}
    for family in SIDE_KERNELS:
        serves = serving[family]
        if family in skip or (family == SPLIT and (bucket.q_len != 1 or q_len not in (None, 1))):
            continue
        choice = serves(bucket, profile, page_size) if family == FLASHMLA else serves(bucket, profile)
        if choice is not None:
            return family, choice
    return None


# ---------------------------------------------------------------- which kernel serves a decode step

FLASHINFER_MLA, TRITON_MLA, FLASHMLA_BACKEND_NAME = "FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA"


@dataclass(frozen=True)
class DecodeStep:
    """One decode step as a tuned config is looked up by: requests, `bucket_context` of their KV
    lengths, query tokens per request."""

    batch_size: int
    context_len: int
    q_len: int = 1


@dataclass(frozen=True)
class DecodeKernel:
    """What serves one decode step: the vLLM attention backend, the kernel family its decode runs
    and that family's typed choice as run (a TritonChoice with `vllm_rule`: vLLM's split rule for
    the batch; a FlashInferChoice: the backend value planned and its KV chunking), and the tuned
    bucket the choice came from (None: untuned)."""

    attention_backend: str
    family: str
    choice: object
    bucket: object = None


def decode_kernel(entry, step: DecodeStep, backends: FlashInferBackends | None = None, *,
                  attention_backend: str | None = None, profile=None, skip=(),
                  lse: bool = False) -> DecodeKernel:
    """The kernel, and its knobs, that serves `step` under a tuned `entry` (None: untuned): the
    one rule the plugin's backends, `mla-tune show --lookup`, doctor and the bench scripts follow.

    `attention_backend`: the vLLM backend that runs (default: the entry's first, else the
    profile's untuned first). FLASHINFER_MLA runs the nearest bucket's side kernel
    (`side_kernel`; none where the step asks for the decode `lse`, or in `skip`: kernels the
    server turned off), else FlashInfer with the bucket's backend value where `backends` (the
    device's; None: as tuned) may run it, its KV chunking only then. TRITON_MLA runs the nearest
    bucket's split count within its context window (`triton_choice`) and its launch
    (`triton_launch`), else vLLM's rule. FLASHMLA runs FlashMLA."""
    prof = target_profile(profile)
    if attention_backend is None:
        order = entry.backend_order if entry is not None and entry.backend_order else prof.mla_order
        attention_backend = order[0]
    if attention_backend == TRITON_MLA:
        key = (step.batch_size, step.context_len, step.q_len)
        tuned = triton_choice(entry, *key)
        variant = triton_launch(entry, *key, prof.triton_default)
        found = entry.lookup(*key) if entry is not None else None
        if tuned is None or tuned.vllm_rule:
            return DecodeKernel(attention_backend, TRITON, TritonChoice(None, True, variant),
                                found.bucket if found is not None else None)
        return DecodeKernel(attention_backend, TRITON, TritonChoice(tuned.num_kv_splits, False, variant),
                            found.bucket)
    if attention_backend == FLASHMLA_BACKEND_NAME:
        found = entry.lookup(step.batch_size, step.context_len, step.q_len) if entry is not None else None
        return DecodeKernel(attention_backend, FLASHMLA, FlashMLAChoice(),
                            found.bucket if found is not None else None)
    found = entry.lookup(step.batch_size, step.context_len, step.q_len) if entry is not None else None
    bucket = found.bucket if found is not None else None
    return flashinfer_mla_kernel(bucket, step.q_len, backends, page_size=entry.page_size if entry else None,
                                 profile=prof, skip=skip, lse=lse)


def without_lse(lse: bool) -> set:
    """The side kernels a step that asks for the decode LSE cannot run (`KernelSpec.decode_lse`)."""
    return {f for f in SIDE_KERNELS if not SPECS[f].decode_lse} if lse else set()


def flashinfer_mla_kernel(bucket, q_len: int, backends: FlashInferBackends | None = None, *,
                          page_size: int | None = None, profile=None, skip=(),
                          lse: bool = False) -> DecodeKernel:
    """`decode_kernel` of FLASHINFER_MLA once the bucket is found (what a step of `q_len` query
    tokens per request runs in `bucket`, None: untuned); `page_size`: the entry's."""
    side = side_kernel(bucket, profile, page_size, set(skip) | without_lse(lse), q_len)
    if side is not None:
        return DecodeKernel(FLASHINFER_MLA, side[0], side[1], bucket)
    typed = bucket_choice(bucket, FLASHINFER)
    if backends is None:
        choice = typed if typed is not None else FlashInferChoice(AUTO)
    else:
        value = backends.serve(typed)
        chunk = typed.kv_chunk if typed is not None and typed.backend == value else None
        choice = FlashInferChoice(value, chunk)
    return DecodeKernel(FLASHINFER_MLA, FLASHINFER, choice, bucket)


def _side_serves(bucket, family: str, profile=None):
    if bucket is None or bucket.best_family != family:
        return None
    sc, fc = bucket.families.get(family), bucket.families.get(FLASHINFER)
    choice = family_choice(family, sc.params) if sc is not None else None
    if choice is None or fc is None or not sc.time_us or not fc.time_us:
        return None
    if why_unservable(family, sc.params, target_profile(profile)):
        return None
    return choice if fc.time_us >= SPLIT_MIN_GAIN * sc.time_us else None


# TRITON_MLA: a bucket tuned for context c serves steps of context [c/2, 2c]; beyond it the server
# keeps vLLM's num_kv_splits rule (splits tuned for a very different length would mis-chunk)
TRITON_CONTEXT_RATIO = 2.0


def triton_choice(entry, batch_size: int, context_len: int, q_len: int = 1) -> "TritonChoice | None":
    """The Triton choice TRITON_MLA serves a step with: the nearest tuned bucket's, where the
    step's context is within TRITON_CONTEXT_RATIO of the bucket's; None: no entry, no bucket, no
    Triton choice in it, or too far in context (vLLM's rule and the profile's launch)."""
    context = max(int(context_len), 1)
    found = entry.lookup(batch_size, context, q_len) if entry is not None else None
    if found is None:
        return None
    ratio = context / found.bucket.context_len
    if not 1 / TRITON_CONTEXT_RATIO <= ratio <= TRITON_CONTEXT_RATIO:
        return None
    return bucket_choice(found.bucket, TRITON)


def triton_launch(entry, batch_size: int, context_len: int, q_len: int, default: str,
                  variants: set | None = None) -> str:
    """The launch variant TRITON_MLA runs a step with: the entry's where it names one launch only
    (no lookup), else `triton_choice`'s, else `default` (the profile's `triton_default`).
    `variants`: the entry's Triton launches, where the caller keeps them (`triton_variants`)."""
    variants = triton_variants(entry) if variants is None else variants
    if len(variants) <= 1:              # the entry was tuned with one launch throughout, or none
        return next(iter(variants), default)
    choice = triton_choice(entry, batch_size, context_len, q_len)
    return choice.variant if choice is not None else default


def triton_variants(entry) -> set:
    """The Triton launch variants an entry's buckets name."""
    return {c.variant for b in (entry.buckets if entry is not None else ())
            if (c := bucket_choice(b, TRITON)) is not None}


def bucket_choice(bucket, family: str) -> FlashInferChoice | TritonChoice | None:
    """The typed choice of `family` in a tuned_config.Bucket (None if it has none)."""
    fc = bucket.families.get(family) if bucket is not None else None
    return family_choice(family, fc.params) if fc is not None else None


__all__ = ["AUTO", "DecodeKernel", "DecodeStep", "SIDE_KERNELS", "decode_kernel",
           "flashinfer_mla_kernel", "flashmla_runs_at", "FALLBACK_BACKEND", "FlashInferBackends",
           "fa3_serves", "flashmla_serves", "side_kernel", "SPLIT_MIN_GAIN",
           "TRITON_CONTEXT_RATIO", "triton_choice", "triton_launch", "triton_variants",
           "split_serves", "bucket_choice", "bucket_context", "dtype_name", "flashinfer_backends",
           "model_key", "prefill_backend", "prefill_backends", "prefill_statistic",
           "unservable_prefill"]
