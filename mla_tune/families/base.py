"""The family protocol: what a kernel family must tell the tuner and do for it.

A family (torch reference, FlashInfer, vLLM's Triton MLA, ...) says whether it can run here, which
candidates it offers for a workload (its search space, constraints already applied), which one is
its untuned default, and prepares a candidate into something runnable. Failures are data: a family
raises CandidateInvalid with one of the store's invalidity reasons, never crashes the sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

from mla_tune.problem.workload import Workload
from mla_tune.validate import InputError, ascii_int, check_page_size
from vllm_metax.core.choices import ChoiceError, candidate_choice
from vllm_metax.core.profile import why_unservable


@dataclass(frozen=True)
class Candidate:
    """One point of the search space: a family's kernel with a page size and its knobs."""

    family: str                     # the sweep family ("flashinfer", "triton", "reference")
    backend: str                    # its backend value: FlashInfer's fa2/fa3/..., "triton", "torch"
    page_size: int                  # the KV page (vLLM block) size
    params: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def key(self) -> str:
        knobs = ",".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.family}/{self.backend}/p{self.page_size}" + (f"/{knobs}" if knobs else "")

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Candidate) and self.key == other.key

    @classmethod
    def parse(cls, text: str) -> "Candidate":
        """Inverse of `key`: 'flashinfer/fa3/p64' or 'triton/triton/p16/num_kv_splits=8'.
        The page size must be one the plugin can serve (vllm_metax.core.tuned_config.PAGE_SIZES)."""
        parts = text.strip().split("/")
        if (len(parts) < 3 or not parts[0] or not parts[1] or not parts[2].startswith("p")
                or ascii_int(parts[2][1:], 11) is None or parts[2][1:] != parts[2][1:].strip()):
            raise ValueError(f"bad candidate {text[:80]!r}; expected family/backend/p<page_size>[/k=v,...]")
        try:
            page = check_page_size(int(parts[2][1:]), f"candidate {text[:80]!r}: page size")
        except InputError as e:
            raise ValueError(str(e)) from None
        params = {}
        if len(parts) > 3:
            for kv in "/".join(parts[3:]).split(","):
                k, _, v = kv.partition("=")
                if not _ or not k or not v:
                    raise ValueError(f"bad knob {kv[:40]!r} in {text[:80]!r}; expected key=value")
                if k in params:
                    raise ValueError(f"knob {k!r} given twice in {text[:80]!r}")
                n = ascii_int(v.removeprefix("-"))
                params[k] = v if n is None or v != v.strip() else (-n if v.startswith("-") else n)
        return cls(parts[0], parts[1], page, params)


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""


class CandidateInvalid(Exception):
    """A candidate that cannot be measured; `reason` is one of store.INVALID_REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def refuse_outside_profile(candidate: Candidate, profile) -> None:
    """CandidateInvalid("unsupported") for a candidate `profile`'s target cannot run
    (`vllm_metax.core.profile.why_unservable`): measured data that no config of it may name."""
    why = why_unservable(candidate.family, {"backend": candidate.backend, **candidate.params}, profile)
    if why:
        raise CandidateInvalid("unsupported", f"{candidate.key}: {why} (profile {profile.name})")


def refuse_where_it_cannot_run(kernel: str, why_shapes: str | None, device, available) -> None:
    """CandidateInvalid("unsupported") where a CUDA kernel cannot run this candidate: its shapes
    (`why_shapes`, the op's check), a device that is not CUDA, or `available(device)` saying no."""
    if why_shapes:
        raise CandidateInvalid("unsupported", why_shapes)
    if device.type != "cuda":
        raise CandidateInvalid("unsupported", f"{kernel} needs a CUDA device")
    ok, why = available(device)
    if not ok:
        raise CandidateInvalid("unsupported", why)


def typed_choice(candidate: Candidate):
    """The candidate's typed choice by the plugin's one rule (`vllm_metax.core.choices`); a knob
    the family does not take is CandidateInvalid("unsupported"), the measurement's refusal."""
    try:
        return candidate_choice(candidate.family, candidate.backend, candidate.params, candidate.key)
    except ChoiceError as e:
        raise CandidateInvalid("unsupported", str(e)) from None


@dataclass
class Prepared:
    """A planned candidate over one problem instance.

    `run()` launches the kernel and returns the output tensor (written in place into `out`);
    `plan()` redoes the per-step host work (what a server runs every decode step), for timing;
    `compile_s` is first-use JIT/compile time, measured outside every timing sample.
    """

    run: Callable[[], object]
    plan: Callable[[], None] | None
    out: object
    compile_s: float = 0.0
    graphable: bool = True


@runtime_checkable
class Family(Protocol):
    family: str

    def available(self, device: str) -> Availability: ...

    def space(self, workload: Workload, page_sizes: list[int]) -> list[Candidate]: ...

    def default_candidate(self, workload: Workload, page_size: int) -> Candidate: ...

    def prepare(self, workload: Workload, candidate: Candidate, problem) -> Prepared: ...
