"""Each kernel family's spec (`SPECS`: backend values, knobs, page rule, which backends take
kv_chunk, whether it returns the decode LSE), its knobs' legal values and the params <-> typed
choice parsing: the one definition (vllm-free, stdlib only) that the tuner (`mla_tune.families.check_candidate`, the
families' `prepare`), `mla-tune bench`, the tuned-config reader (`tuned_config.check_params`) and
the plugin (`family_choice`) all use.

A family's stored parameters are `{"backend": <value>, **knobs}`: a tuned config's bucket params,
a measured candidate's plan parameters, and a candidate string `family/<backend>/p<page>/k=v,...`
(its knobs). The split kernel's facts come from `vllm_metax.core.split_facts`, not restated here.

* `check_params(family, params, where)`: strict; the typed choice, or ChoiceError (one line naming
  the bad value and the legal ones).
* `candidate_choice(family, backend, knobs, where)`: strict, for a candidate's backend and knobs.
* `family_choice(family, params)`: lenient, for the plugin reading what it serves: None when the
  params say nothing usable, an unknown kv_chunk means MLAPlan's own limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vllm_metax.core.split_facts import MAX_PROGRAMS, PARTIAL_DTYPES, PIPES, SERVED_PIPE
from vllm_metax.core.triton_facts import LAUNCHES as TRITON_LAUNCHES

FLASHINFER = "flashinfer"
TRITON = "triton"
FLASHMLA = "flashmla"        # FlashMLA (vLLM's FLASHMLA backend): one candidate, no knobs
SPLIT = "split"              # the split-KV Triton decode (vllm_metax.ops.split_decode)
FA3 = "fa3_mla"              # vLLM's FA3 MLA decode (FLASH_ATTN_MLA's kernel; vllm_metax.ops.fa3_mla)

# Every backend value any FlashInfer MLA wrapper has been seen to accept; "auto" and "cute-dsl"
# are policies/aliases that resolve to one concrete backend at plan time.
FLASHINFER_BACKENDS = ("auto", "fa2", "fa3", "cutlass", "cutile", "trtllm-gen", "xqa", "cute-dsl",
                       "cute-dsl-monolithic", "cute-dsl-modular")
# FlashInfer fa2/fa3 KV chunking (params.kv_chunk): the KV chunk limit of FlashInfer's MLAPlan
# scaled by this factor ("none": never split a request's KV); absent = MLAPlan's own limit.
KV_CHUNKS = ("x0.25", "x0.5", "x2", "x4", "none")
TRITON_BACKEND = "triton"   # the Triton family's one backend value (params["backend"])
MAX_KV_SPLITS = 256         # vLLM's Triton MLA decode: num_kv_splits in 1..256
VLLM_RULE = "vllm"          # TritonChoice params["rule"]: the split count is vLLM's own rule
# TritonChoice params["variant"]: how the kernel is launched. "vllm": vLLM's own launch; the others
# are vendors' launch settings for the same kernels (vllm_metax.core.triton_facts); absent = "vllm"
TRITON_VARIANTS = ("vllm",) + tuple(TRITON_LAUNCHES)
DEFAULT_TRITON_VARIANT = "vllm"
FLASHMLA_BACKEND = "flashmla"   # the flashmla family's one backend value (FlashMLA has no knobs)
# The split family (vllm_metax/ops/split_decode.py, served by FLASHINFER_MLA's decode for the
# buckets it wins): its backend value, and the kernel's split counts, partial dtypes and pipes.
SPLIT_BACKEND = "triton"
MAX_SPLITS = MAX_PROGRAMS       # one request's splits in one launch
SPLIT_PARTIALS = PARTIAL_DTYPES
SPLIT_PIPES = tuple(PIPES)      # params.pipe; absent = the served pipe (every config before the knob)
DEFAULT_SPLIT_PIPE = SERVED_PIPE
# vLLM's FA3 MLA decode: num_splits 0 = FA3's own heuristic, else at most that many KV splits
# (vLLM serves 0 eagerly and flash_attn_max_num_splits_for_cuda_graph, 32, under CUDA graphs);
# schedule "aot": scheduler metadata once per step (vLLM's way), "none": inside each launch.
FA3_BACKEND = "fa3"
MAX_FA3_SPLITS = 256
FA3_SCHEDULES = ("aot", "none")
DEFAULT_FA3_SCHEDULE = "aot"

CHUNKED_FLASHINFER = ("fa2", "fa3")   # the FlashInfer backends whose schedule the plugin computes


@dataclass(frozen=True)
class PageRule:
    """The KV block sizes a kernel runs at: a multiple of `multiple`, or exactly `only`."""

    multiple: int = 1
    only: int | None = None

    def allows(self, page_size: int) -> bool:
        return page_size == self.only if self.only is not None else page_size % self.multiple == 0

    def __str__(self) -> str:
        if self.only is not None:
            return str(self.only)
        return "any" if self.multiple == 1 else f"a multiple of {self.multiple}"


@dataclass(frozen=True)
class KernelSpec:
    """One kernel family's facts, the one place the tuner, the config reader and the plugin read
    them from (vLLM keeps a kernel's facts on its backend class the same way).

    `backends`: the values params["backend"] takes; `parse`: its params as its typed choice
    (strict: every knob's legal values); `required` / `optional`: its knobs (their
    legal values are checked by `check_params`); `page`: the KV block sizes the kernel runs at;
    `sweep_pages`: the pages a sweep measures it at (None: every page the sweep asks for that
    `page` allows); `chunked_backends`: the backends that take `kv_chunk` (the plugin computes
    their schedule; a kv_chunk with another backend is refused, never ignored); `decode_lse`: it
    can return the decode LSE FLASHINFER_MLA plans for decode context parallelism;
    `attention_backend`: the vLLM attention backend that runs it on its own (None: FLASHINFER_MLA
    runs it per bucket); `default_sweep`: a default NVIDIA sweep measures it; `tuner`: its
    measuring class in mla_tune ("module:Class", imported by the tuner only)."""

    family: str
    title: str                         # for people (reports, plots)
    abbr: str                          # in report cells
    backends: tuple
    required: tuple
    optional: tuple
    page: PageRule
    form: str                          # how a candidate of it is written, for refusals
    parse: Callable                    # (params, where) -> its typed choice, or ChoiceError
    tuner: str
    sweep_pages: tuple | None = None
    chunked_backends: tuple = ()
    decode_lse: bool = False
    attention_backend: str | None = None
    default_sweep: bool = True

    @property
    def knobs(self) -> tuple:
        return self.required + self.optional


class ChoiceError(ValueError):
    """Parameters a family does not take; the message is one line naming the bad value and the
    legal ones."""


# ---------------------------------------------------------------- the typed choices

def kv_chunk_factor(kv_chunk: str | None) -> float | None:
    """A stored kv_chunk ("x0.5", "none", ...; `KV_CHUNKS`) as the factor the schedule scales
    MLAPlan's KV chunk limit by (`mla_schedule.chunk_limit`); None: MLAPlan's own limit (absent,
    or a value this version does not know)."""
    if kv_chunk == "none":
        return float("inf")
    if kv_chunk in KV_CHUNKS:
        return float(kv_chunk[1:])
    return None


@dataclass(frozen=True)
class FlashInferChoice:
    """A FlashInfer bucket's choice: the backend value to plan and its KV chunking (`kv_chunk`,
    one of `KV_CHUNKS`; None: MLAPlan's own chunk limit)."""

    backend: str
    kv_chunk: str | None = None

    @property
    def kv_chunk_factor(self) -> float | None:
        return kv_chunk_factor(self.kv_chunk)

    def to_params(self) -> dict:
        p = {"backend": self.backend}
        if self.kv_chunk is not None:
            p["kv_chunk"] = self.kv_chunk
        return p


@dataclass(frozen=True)
class TritonChoice:
    """A Triton bucket's choice: a tuned num_kv_splits, or vLLM's own rule (`vllm_rule`; then
    `num_kv_splits` is what the rule gave at the bucket's length, kept for people), and the launch
    variant (`TRITON_VARIANTS`: vLLM's own launch, or a vendor's settings for the same kernels)."""

    num_kv_splits: int | None
    vllm_rule: bool = False
    variant: str = DEFAULT_TRITON_VARIANT

    @property
    def served_splits(self) -> int | None:
        """The split count to run; None: vLLM's rule for the batch at hand."""
        return None if self.vllm_rule else self.num_kv_splits

    def to_params(self) -> dict:
        p = {"backend": TRITON_BACKEND, "num_kv_splits": self.num_kv_splits}
        if self.vllm_rule:
            p["rule"] = VLLM_RULE
        if self.variant != DEFAULT_TRITON_VARIANT:
            p["variant"] = self.variant
        return p


@dataclass(frozen=True)
class SplitChoice:
    """A split bucket's choice: the split count per request, the partials' dtype and the pipe
    (`vllm_metax.ops.split_decode.served` builds the kernel from these)."""

    num_splits: int
    partial: str
    pipe: str = DEFAULT_SPLIT_PIPE

    def to_params(self) -> dict:
        p = {"backend": SPLIT_BACKEND, "num_splits": self.num_splits, "partial": self.partial}
        if self.pipe != DEFAULT_SPLIT_PIPE:
            p["pipe"] = self.pipe
        return p


@dataclass(frozen=True)
class FlashMLAChoice:
    """FlashMLA's one choice: no knobs."""

    backend: str = FLASHMLA_BACKEND

    def to_params(self) -> dict:
        return {"backend": self.backend}


@dataclass(frozen=True)
class FA3Choice:
    """vLLM's FA3 MLA decode: the split bound (0: FA3's own heuristic) and where the scheduler
    metadata is computed ("aot": once per step, "none": in each launch)."""

    num_splits: int
    schedule: str = DEFAULT_FA3_SCHEDULE

    def to_params(self) -> dict:
        p = {"backend": FA3_BACKEND, "num_splits": self.num_splits}
        if self.schedule != DEFAULT_FA3_SCHEDULE:
            p["schedule"] = self.schedule
        return p


# ---------------------------------------------------------------- strict parsing

def _int_in(params: dict, key: str, lo: int, hi: int, where: str) -> int:
    v = params.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ChoiceError(f"{where}: params.{key} must be an integer in {lo}..{hi}, got {_shown(v)}")
    if not lo <= v <= hi:
        raise ChoiceError(f"{where}: params.{key} must be in {lo}..{hi}, got {_shown(v)}")
    return v


def _shown(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10 ** 12:
        return f"a {len(str(abs(v)))}-digit number"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_of(params: dict, key: str, legal: tuple, where: str, default=None):
    v = params.get(key, default)
    if not isinstance(v, str) or v not in legal:
        if len(legal) == 1:
            raise ChoiceError(f"{where}: params.{key} must be {legal[0]!r}, got {_shown(v)}")
        raise ChoiceError(f"{where}: params.{key} must be one of {', '.join(legal)}, got {_shown(v)}")
    return v


def check_params(family: str, params, where: str):
    """A family's stored parameters ({"backend": ..., **knobs}) as its typed choice; ChoiceError
    for an unknown family, an unknown parameter or a value out of its domain (`KernelSpec.parse`)."""
    if family not in SPECS:
        raise ChoiceError(f"{where}: unknown kernel family {family!r} (known: {', '.join(SPECS)})")
    if not isinstance(params, dict):
        raise ChoiceError(f"{where}: params should be an object, got {type(params).__name__}")
    spec = SPECS[family]
    known = {"backend", *spec.knobs}
    unknown = sorted(set(params) - known, key=str)
    if unknown:
        raise ChoiceError(f"{where}: unknown parameter {', '.join(map(repr, unknown))} for "
                          f"family {family!r} (known: {', '.join(sorted(known))})")
    return spec.parse(params, where)


def _flashinfer(params: dict, where: str) -> FlashInferChoice:
    b = _one_of(params, "backend", FLASHINFER_BACKENDS, where)
    chunk = _one_of(params, "kv_chunk", KV_CHUNKS, where) if "kv_chunk" in params else None
    if chunk is not None and b not in CHUNKED_FLASHINFER:
        raise ChoiceError(f"{where}: params.kv_chunk is taken by backend {' or '.join(CHUNKED_FLASHINFER)} "
                          f"only (the plugin computes their schedule), not {_shown(b)}")
    return FlashInferChoice(b, chunk)


def _split(params: dict, where: str) -> SplitChoice:
    _one_of(params, "backend", (SPLIT_BACKEND,), where)
    n = _int_in(params, "num_splits", 1, MAX_SPLITS, where)
    partial = _one_of(params, "partial", SPLIT_PARTIALS, where)
    pipe = _one_of(params, "pipe", SPLIT_PIPES, where) if "pipe" in params else DEFAULT_SPLIT_PIPE
    return SplitChoice(n, partial, pipe)


def _flashmla(params: dict, where: str) -> FlashMLAChoice:
    return FlashMLAChoice(_one_of(params, "backend", (FLASHMLA_BACKEND,), where))


def _fa3(params: dict, where: str) -> FA3Choice:
    _one_of(params, "backend", (FA3_BACKEND,), where)
    n = _int_in(params, "num_splits", 0, MAX_FA3_SPLITS, where)
    sched = _one_of(params, "schedule", FA3_SCHEDULES, where) if "schedule" in params else DEFAULT_FA3_SCHEDULE
    return FA3Choice(n, sched)


def _triton(params: dict, where: str) -> TritonChoice:
    _one_of(params, "backend", (TRITON_BACKEND,), where, TRITON_BACKEND)   # hand-written: optional
    n = _int_in(params, "num_kv_splits", 1, MAX_KV_SPLITS, where)
    rule = _one_of(params, "rule", (VLLM_RULE,), where) if "rule" in params else None
    variant = (_one_of(params, "variant", TRITON_VARIANTS, where) if "variant" in params
               else DEFAULT_TRITON_VARIANT)
    return TritonChoice(n, rule == VLLM_RULE, variant)


# ---------------------------------------------------------------- each kernel family's spec

SPECS = {s.family: s for s in (
    KernelSpec(FLASHINFER, "FlashInfer", "fi", FLASHINFER_BACKENDS, (), ("kv_chunk",), PageRule(),
               f"flashinfer/<backend>/p<page>[/kv_chunk=<{'|'.join(KV_CHUNKS)}>, "
               f"with {' or '.join(CHUNKED_FLASHINFER)} only]", _flashinfer,
               "mla_tune.families.flashinfer:FlashInferFamily",
               chunked_backends=CHUNKED_FLASHINFER, decode_lse=True, attention_backend="FLASHINFER_MLA"),
    # vLLM's TritonMLABackend.get_supported_kernel_block_sizes() == [MultipleOf(16)]
    KernelSpec(TRITON, "Triton MLA", "tr", (TRITON_BACKEND,), ("num_kv_splits",), ("rule", "variant"),
               PageRule(16),
               f"{TRITON}/{TRITON_BACKEND}/p<page, a multiple of 16>/num_kv_splits=N[,rule={VLLM_RULE}]"
               f"[,variant=<{'|'.join(TRITON_VARIANTS)}>]", _triton,
               "mla_tune.families.triton_mla:TritonMLAFamily", attention_backend="TRITON_MLA"),
    # FlashMLA's only KV block size is 64 (vLLM's FlashMLABackend, MetaX's flash_mla alike)
    KernelSpec(FLASHMLA, "FlashMLA", "fm", (FLASHMLA_BACKEND,), (), (), PageRule(only=64),
               f"{FLASHMLA}/{FLASHMLA_BACKEND}/p64, no knobs", _flashmla,
               "mla_tune.families.flashmla:FlashMLAFamily", attention_backend="FLASHMLA",
               # 1.31x slower than FlashInfer's best on the H200: measured where asked for
               default_sweep=False),
    # the split kernel runs any page; its pipes' tiles were tuned and checked at 64, and a sweep
    # measures it there only
    KernelSpec(SPLIT, "split-KV Triton decode (served by FLASHINFER_MLA)", "sp", (SPLIT_BACKEND,),
               ("num_splits", "partial"), ("pipe",), PageRule(),
               f"{SPLIT}/{SPLIT_BACKEND}/p64/num_splits=N,partial=<dtype>[,pipe=<pipe>]", _split,
               "mla_tune.families.split:SplitFamily", sweep_pages=(64,)),
    # vLLM's FLASH_ATTN_MLA: kernel block sizes MultipleOf(16)
    KernelSpec(FA3, "vLLM FA3 (served by FLASHINFER_MLA)", "fa3", (FA3_BACKEND,), ("num_splits",),
               ("schedule",), PageRule(16),
               f"{FA3}/{FA3_BACKEND}/p<page, a multiple of 16>/num_splits=N (0: FA3's heuristic)"
               f"[,schedule=<{'|'.join(FA3_SCHEDULES)}>]", _fa3,
               "mla_tune.families.fa3_mla:FA3MLAFamily"),
)}
# family -> (required knobs, optional knobs); a family's params are {"backend", *knobs}
KNOBS = {f: (s.required, s.optional) for f, s in SPECS.items()}
# how a candidate of each family is written, for the refusals of a malformed one
CANDIDATE_FORMS = {f: s.form for f, s in SPECS.items()}


def candidate_choice(family: str, backend: str, knobs: dict, where: str):
    """A candidate's backend and knobs (`family/<backend>/p<page>/k=v,...`) as its family's typed
    choice; ChoiceError for a knob the family does not have, a missing one or a bad value."""
    if family not in KNOBS:
        raise ChoiceError(f"{where}: unknown kernel family {family!r} (known: {', '.join(KNOBS)})")
    required, optional = KNOBS[family]
    names = set(knobs)
    form = f" (the {family} family: {CANDIDATE_FORMS[family]})"
    if "backend" in names or not set(required) <= names or not names <= {*required, *optional}:
        bad = sorted(names - {*required, *optional}, key=str)
        what = (f"knob {', '.join(map(repr, bad))} is not one of the family's"
                if bad else f"missing knob {', '.join(r for r in required if r not in names)}")
        raise ChoiceError(f"{where}: {what}{form}")
    try:
        return check_params(family, {"backend": backend, **knobs}, where)
    except ChoiceError as e:
        raise ChoiceError(f"{e}{form}") from None


# ---------------------------------------------------------------- lenient reading

def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def family_choice(family: str, params) -> FlashInferChoice | TritonChoice | SplitChoice | FA3Choice | FlashMLAChoice | None:
    """A stored `params` dict (a tuned config's, or a measured candidate's plan parameters) as
    its family's typed choice; None when it says nothing usable. Lenient where the plugin can
    still serve: any FlashInfer backend string (the device rule decides), an unknown kv_chunk
    (MLAPlan's own limit), vLLM's rule with no count."""
    if not isinstance(params, dict):
        return None
    if family == FLASHINFER:
        b = params.get("backend")
        if not isinstance(b, str) or not b:
            return None
        chunk = params.get("kv_chunk")
        takes = chunk in KV_CHUNKS and b in SPECS[FLASHINFER].chunked_backends
        return FlashInferChoice(b, chunk if takes else None)
    if family == TRITON:
        n = params.get("num_kv_splits")
        variant = params.get("variant", DEFAULT_TRITON_VARIANT)
        if variant not in TRITON_VARIANTS:
            return None            # a launch this version does not know: vLLM's rule and launch
        if params.get("rule") == VLLM_RULE:
            return TritonChoice(n if _positive_int(n) else None, True, variant)
        return TritonChoice(n, False, variant) if _positive_int(n) else None
    if family in SPECS and len(SPECS[family].backends) == 1:     # a family of one backend value
        try:
            return check_params(family, {"backend": SPECS[family].backends[0], **params}, family)
        except ChoiceError:
            return None
    return None
