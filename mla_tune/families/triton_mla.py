"""vLLM's Triton MLA decode kernel (`decode_attention_fwd`, what TRITON_MLA runs) as a kernel family.

The kernel is imported from the installed vllm on first use, never copied. What a caller of
`decode_attention_fwd(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits,
num_kv_splits, sm_scale, page_size, logit_cap, k_scale, v_scale, is_mla)` can choose, and what of
it is a tuning knob:

* `num_kv_splits`: the KV chunking. Stage 1 launches a (batch, ceil(heads/16), num_kv_splits)
  grid, each program reducing cdiv(seq_len, num_kv_splits) tokens of one request into
  `attn_logits[b, h, split, :kv_lora_rank]` plus its LSE in the last slot (fp32,
  [B, H, num_kv_splits, kv_lora_rank + 1]); stage 2 merges the splits. A constexpr: every new value
  is a new JIT compile (0.6-1.3 s). vLLM's rule: next_power_of_2(max_seq_len // 512), capped at
  2 x SM count. Tuned here over powers of two.
* `page_size`: a constexpr too (the kernel supports any page size >= 1), but vLLM's TRITON_MLA
  accepts KV block sizes that are multiples of 16 only, so those are the candidates.
* `is_mla=False` computes the same result on a slower path (576-wide K padded to a 1024 tile, V
  loaded a second time); TRITON_MLA always passes True. `logit_cap`, `k_scale`/`v_scale` change the
  math, not the speed. BLOCK_N (32), BLOCK_H (16), num_warps (4) and num_stages (2) are fixed
  inside vLLM: no caller of `decode_attention_fwd` can set them.
* `variant` (`vllm_metax.core.choices.TRITON_VARIANTS`): how the kernels are launched. "vllm" (no
  knob) is vLLM's `decode_attention_fwd`; "metax" launches vLLM's own kernels with the MetaX
  vendor's settings (BLOCK_N 16, one stage, the general head-tile rule:
  `vllm_metax.core.triton_facts`; the launcher is `vllm_metax.ops.triton_launch`, what
  TRITON_MLA serves). The target profile (`vllm_metax.core.profile`) says which launches a sweep
  measures (metax: both) and which one is the untuned default (metax: the vendor's).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib.util
import math
import os
import time
from functools import lru_cache
from pathlib import Path

import torch

from mla_tune.families.base import Availability, Candidate, CandidateInvalid, Prepared
from mla_tune.problem.workload import Workload
from vllm_metax.core import device as core_device
from vllm_metax.core.choices import DEFAULT_TRITON_VARIANT as VLLM_VARIANT, SPECS, TRITON, TRITON_VARIANTS
from vllm_metax.core.profile import target_profile

# vLLM (its Triton MLA kernel and rule) is imported in the functions that use it: mla_tune imports
# vLLM only where a feature needs it (tests/test_layering.py), and its absence is an answer
# (`available`), not an import error.

BACKEND = "triton"
KERNEL_BLOCK_N = 32          # tokens per stage-1 iteration (fixed in vLLM): the finest split worth having
MAX_SPLITS = 256
MAX_WAVES = 64               # a restriction, not a constraint: past 64 CTAs per SM more splits only
                             # add stage-2 merge work (vLLM's own choice always stays in the space)
RULE_PARAM = "rule"          # params["rule"] = "vllm" marks the candidate vLLM's own rule picks
VARIANT_PARAM = "variant"    # params["variant"]: the launch (absent: vLLM's own, VLLM_VARIANT)
PAGES = SPECS[TRITON].page    # the KV block sizes TRITON_MLA runs at (the spec's)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def vllm_compiled_ops_missing() -> bool:
    """True where vllm's Python files are installed without its compiled CUDA ops (the module
    vllm.platforms.cuda imports), checked without importing vllm."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return not any(any(Path(d).glob("_C_stable_libtorch*")) for d in spec.submodule_search_locations)


@lru_cache(maxsize=1)
def _kernel():
    """vLLM's decode_attention_fwd, or raise ImportError saying why it cannot run in this process."""
    try:
        import triton  # noqa: F401
    except Exception as e:
        raise ImportError(f"triton is not importable: {e}") from None
    try:
        from vllm.triton_utils import HAS_TRITON
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
    except Exception as e:
        hint = ""
        if vllm_compiled_ops_missing():
            hint = (" (vLLM's compiled ops are missing here, so its built-in CUDA platform cannot "
                    "load: set VLLM_METAX_FORCE=1 to make the project's platform plugin the active one)")
        raise ImportError(f"vllm's Triton MLA kernel is not importable: {type(e).__name__}: {e}{hint}") from None
    if not HAS_TRITON:
        # vllm swapped in its Triton placeholder: it found no single active GPU driver
        raise ImportError("vllm disabled Triton in this process (no active GPU driver); on a CPU, "
                          "set TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES='' before vllm is imported")
    return decode_attention_fwd


RULE_NAME = "_compute_num_kv_splits"


@lru_cache(maxsize=1)
def _vllm_rule():
    """vLLM's own num_kv_splits rule, `_compute_num_kv_splits(max_seq_len, sm_count)`: compiled
    from the installed backend's source (`rule_from_source`), else imported from it."""
    _kernel()
    return rule_from_source() or imported_rule()


def imported_rule():
    from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits
    return _compute_num_kv_splits


def rule_from_source():
    """The rule compiled from vLLM's installed `v1/attention/backends/mla/triton_mla.py`, with
    the module-level constants it reads, without importing that module: the import pulls in
    vllm.config and the MLA layers (10.6 s of the H200 default sweep's 13.7 s of planning, in the
    process that only needs this one function). None where the source is not in the shape
    this reads (a function of triton and its own module's constants only): import it then."""
    import vllm.v1.attention as attention      # lazy: mla_tune imports vLLM only where a feature needs it
    from vllm.triton_utils import triton
    path = Path(attention.__file__).parent / "backends" / "mla" / "triton_mla.py"
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    func = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == RULE_NAME), None)
    if func is None or func.decorator_list:
        return None
    consts = {}
    for n in tree.body:
        if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                and isinstance(n.value, ast.Constant)):
            consts[n.targets[0].id] = n
    args = {a.arg for a in func.args.args}
    local = {t.id for t in ast.walk(func) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
    used = {t.id for t in ast.walk(func) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Load)}
    free = used - args - local - set(dir(builtins)) - {"triton"}
    if not free <= set(consts):
        return None
    body = [consts[name] for name in sorted(free)] + [func]
    ns: dict = {"triton": triton}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return ns[RULE_NAME]


def _sm_count() -> int | None:
    return core_device.detect_device().sm_count


def vllm_num_kv_splits(max_seq_len: int, sm_count: int | None = None) -> int:
    """What TRITON_MLA picks for a batch whose longest sequence is max_seq_len (SM cap off if unknown)."""
    return int(_vllm_rule()(max_seq_len, sm_count if sm_count else 1 << 30))


def split_choices(workload: Workload, sm_count: int | None) -> list[int]:
    """Powers of two from 1 down to one 32-token tile per split, at most MAX_WAVES CTAs per SM."""
    longest = max(workload.seq_lens)
    top = min(MAX_SPLITS, 1 << max(0, math.ceil(math.log2(max(1, -(-longest // KERNEL_BLOCK_N))))))
    ctas_per_split = workload.batch_size * workload.q_len * -(-workload.num_heads // 16)
    out, n = [], 1
    while n <= top:
        if n == 1 or not sm_count or ctas_per_split * n <= MAX_WAVES * sm_count:
            out.append(n)
        n *= 2
    return out


def _check_page(page_size: int) -> None:
    if not PAGES.allows(page_size):
        raise CandidateInvalid("unsupported", f"TRITON_MLA takes KV block sizes that are {PAGES}, "
                                              f"not {page_size}")


class TritonMLAFamily:
    """vLLM's TRITON_MLA decode kernel; knobs: page size (multiple of 16) x num_kv_splits, and the
    launch variants of the target profile."""

    family = "triton"

    def __init__(self, profile=None):
        self.profile = target_profile(profile)

    def available(self, device: str) -> Availability:
        try:
            _kernel()
        except ImportError as e:
            return Availability(False, str(e))
        if device == "cpu" and not _interpreting():
            return Availability(False, "Triton kernels need a GPU; on the CPU they run only under "
                                       "TRITON_INTERPRET=1 (slowly, float16 only)")
        if device != "cpu" and not torch.cuda.is_available():
            return Availability(False, "torch sees no CUDA device")
        import vllm
        return Availability(True, f"vllm {vllm.__version__} decode_attention_fwd")

    def _candidate(self, page_size: int, splits: int, default: int,
                   variant: str = VLLM_VARIANT) -> Candidate:
        params = {"num_kv_splits": splits}
        if splits == default:
            params[RULE_PARAM] = "vllm"
        if variant != VLLM_VARIANT:
            params[VARIANT_PARAM] = variant
        return Candidate(self.family, BACKEND, page_size, params)

    def space(self, workload: Workload, page_sizes: list[int]) -> list[Candidate]:
        sm = _sm_count()
        default = vllm_num_kv_splits(max(workload.seq_lens), sm)
        splits = sorted(set(split_choices(workload, sm)) | {default})
        return [self._candidate(p, n, default, v) for v in self.profile.triton_variants
                for p in page_sizes if PAGES.allows(p) for n in splits]

    def default_candidate(self, workload: Workload, page_size: int) -> Candidate:
        """num_kv_splits by vLLM's own rule for this batch (params carry rule=vllm), launched as
        TRITON_MLA launches it untuned under the profile (metax: the vendor's settings)."""
        n = vllm_num_kv_splits(max(workload.seq_lens), _sm_count())
        return self._candidate(page_size, n, n, self.profile.triton_default)

    def prepare(self, workload: Workload, candidate: Candidate, problem) -> Prepared:
        _check_page(candidate.page_size)
        try:
            decode_attention_fwd = launcher(candidate.params.get(VARIANT_PARAM, VLLM_VARIANT))
        except ImportError as e:
            raise CandidateInvalid("unsupported", str(e)) from None
        splits = candidate.params.get("num_kv_splits")
        if not isinstance(splits, int) or splits < 1:
            raise CandidateInvalid("unsupported", f"num_kv_splits must be a positive int, got {splits!r}")
        dev = problem.device
        if dev.type == "cpu" and not _interpreting():
            raise CandidateInvalid("unsupported", "Triton on the CPU needs TRITON_INTERPRET=1")
        if dev.type == "cpu" and workload.q_dtype == "bfloat16":
            # Triton's interpreter evaluates tl.dot on bfloat16 operands wrongly (numpy has no bf16)
            raise CandidateInvalid("unsupported", "the Triton interpreter miscomputes bfloat16 dots; "
                                                  "use float16 on the CPU")
        R = workload.kv_lora_rank
        q = packed_query(problem.q_nope, problem.q_pe)               # [B*q_len, H, R+P]
        kv = problem.kv_cache.unsqueeze(2)                            # [pages, page, 1, R+P] as vLLM
        kv_c = kv[..., :R]                                            # V is the latent part of K
        block_table, seq_lens = _decode_rows(problem.block_table, problem.seq_lens_cpu.to(dev),
                                             workload.q_len)
        rows, heads = q.shape[0], q.shape[1]
        o = torch.empty(rows, heads, R, dtype=q.dtype, device=dev)
        lse = torch.empty(rows, heads, dtype=q.dtype, device=dev)
        attn_logits = torch.empty(rows, heads, splits, R + 1, dtype=torch.float32, device=dev)
        # preallocated scales: decode_attention_fwd would otherwise build them on every call,
        # a host->device copy that CUDA graph capture refuses
        one = torch.ones((), dtype=torch.float32, device=dev)
        page, scale = candidate.page_size, workload.softmax_scale

        def run():
            decode_attention_fwd(q, kv, kv_c, o, lse, block_table, seq_lens, attn_logits,
                                 splits, scale, page, k_scale=one, v_scale=one, is_mla=True)
            return o

        t0 = time.perf_counter()
        try:
            run()                      # first use of a (heads, splits, page) config JITs here
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        except CandidateInvalid:
            raise
        except Exception as e:
            raise CandidateInvalid("compile", f"{type(e).__name__}: {e}") from None
        return Prepared(run=run, plan=None, out=o, compile_s=time.perf_counter() - t0, graphable=True)


def launcher(variant: str):
    """`decode_attention_fwd` as `variant` launches it: vLLM's own, or vLLM's kernels with a
    vendor's settings (`vllm_metax.ops.triton_launch`); ImportError saying why not here."""
    kernel = _kernel()
    if variant == VLLM_VARIANT:
        return kernel
    if variant not in TRITON_VARIANTS:
        raise ImportError(f"unknown Triton launch variant {variant!r} (known: "
                          f"{', '.join(TRITON_VARIANTS)})")
    try:
        from vllm_metax.ops import triton_launch
    except Exception as e:
        raise ImportError(f"the {variant} Triton launch is not importable: {type(e).__name__}: {e}") from None
    return functools.partial(triton_launch.decode_attention_fwd, variant=variant)


def packed_query(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[T, H, R+P] as the kernel takes it: a view when nope and pe are halves of one tensor."""
    R = q_nope.shape[-1]
    if (q_nope.stride() == q_pe.stride() and q_nope.stride(-1) == 1
            and q_pe.data_ptr() == q_nope.data_ptr() + R * q_nope.element_size()
            and q_nope.stride(-2) >= R + q_pe.shape[-1]):
        return torch.as_strided(q_nope, (*q_nope.shape[:-1], R + q_pe.shape[-1]), q_nope.stride())
    return torch.cat([q_nope, q_pe], dim=-1)


def _decode_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, q_len: int):
    """One kernel row per query token, as TritonMLAImpl.forward_mqa does for q_len > 1: row t of a
    request sees its prefix plus block tokens 0..t (the kernel has no causal flag)."""
    if q_len == 1:
        return block_table, seq_lens
    offsets = torch.arange(1 - q_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
    return (block_table.repeat_interleave(q_len, dim=0),
            (seq_lens.unsqueeze(1) + offsets).flatten().clamp(min=0))
