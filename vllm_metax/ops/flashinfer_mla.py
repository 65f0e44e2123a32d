"""FlashInfer MLA decode, vllm-free: one BatchMLAPagedAttentionWrapper for one backend value.

Both the tuner (mla_tune.families.flashinfer) and the vLLM plugin's attention backend call this
module, so what is tuned is what is served. Two FlashInfer API forms exist and are detected once
per process (`flashinfer_api()`), never per call:

* "keyword" (flashinfer-python >= 0.7): ``plan(metadata=MLAPlanMetadata.csr(...), num_heads=...,
  query_layout=..., kv_cache_layout=..., lse_mode=...)`` and ``run(query=(q_nope, q_pe),
  kv_cache=(ckv, kpe), out=...)``.
* "flat" (the 0.2.x line, MetaX's ``flashinfer==0.2.6+metax`` build): ``plan(qo_indptr,
  kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
  sm_scale, q_data_type, kv_data_type)`` and ``run(q_nope, q_pe, ckv_cache, kpe_cache, out, lse,
  return_lse)``. flashinfer 0.7.2 still accepts it (deprecated), so it can be tested on NVIDIA.

The CSR metadata comes from `vllm_metax.ops.paged_metadata.build_paged_metadata` (the only place
that builds kv_indptr / kv_indices); this module only hands it to FlashInfer.

LSE, when asked for, is in FlashInfer's base-2 convention in both forms (log2 of the softmax
denominator of the scaled logits); multiply by ln 2 for the natural log.

Importing this module is cheap: FlashInfer is imported on the first call that needs it.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from importlib import metadata
from typing import Optional

import torch

from vllm_metax.core.log import get_logger
from vllm_metax.ops import fast_replan as fr
from vllm_metax.ops.paged_metadata import PagedMetadata, build_paged_metadata
from vllm_metax.core.choices import FLASHINFER_BACKENDS
from vllm_metax.core.profile import active_profile

logger = get_logger(__name__)

API_KEYWORD = "keyword"
API_FLAT = "flat"
API_FORMS = (API_KEYWORD, API_FLAT)

# Every backend value any FlashInfer MLA wrapper has been seen to accept (the tuned-config schema
# holds the list); "auto" and "cute-dsl" are policies/aliases that resolve at plan time.
KNOWN_BACKENDS = FLASHINFER_BACKENDS
ALIAS_BACKENDS = ("auto", "cute-dsl")
# Backends whose 0.7 plan requires the packed [..., ckv+kpe] layout (adjacent views are zero-copy);
# fa2/fa3 take independent split tensors natively.
_PACKED_BACKENDS = frozenset({"cutlass", "trtllm-gen", "xqa", "cute-dsl", "cute-dsl-monolithic",
                              "cute-dsl-modular"})
# The 0.2.x line's wrapper validates nothing at construction; these are what its docs name.
_FLAT_FALLBACK_BACKENDS = ("auto", "fa2", "fa3")

WORKSPACE_BYTES = 128 << 20      # FlashInfer's recommended float workspace for MLA

def _profile_api() -> str | None:
    """The FlashInfer API form the active target profile plans through (None: as installed)."""
    return active_profile().flashinfer_api


class FlashInferUnavailable(RuntimeError):
    """FlashInfer (or its MLA wrapper) cannot be imported here; the message says why."""


class BackendRefused(RuntimeError):
    """FlashInfer or the device refused to plan this backend (not a bug: data for the tuner).

    `backend` is the requested value, `reason` FlashInfer's own message.
    """

    def __init__(self, backend: str, reason: str):
        super().__init__(f"FlashInfer MLA backend {backend!r} refused: {reason}")
        self.backend = backend
        self.reason = reason


@dataclass(frozen=True)
class FlashInferAPI:
    """What the installed FlashInfer offers for MLA decode (detected once, cached)."""

    form: str                       # API_KEYWORD | API_FLAT
    version: str
    package: str                    # "flashinfer-python" | "flashinfer" (MetaX) | "unknown"
    wrapper_cls: type
    plan_metadata_cls: Optional[type]   # MLAPlanMetadata (keyword form only)
    backends: tuple                 # backend values the wrapper constructor accepts


def detect_api(mla_module) -> FlashInferAPI:
    """Classify a `flashinfer.mla`-like module; pure, so tests can hand it fakes."""
    wrapper = getattr(mla_module, "BatchMLAPagedAttentionWrapper", None)
    if wrapper is None:
        raise FlashInferUnavailable("flashinfer.mla has no BatchMLAPagedAttentionWrapper")
    meta_cls = getattr(mla_module, "MLAPlanMetadata", None)
    form = API_KEYWORD if meta_cls is not None and hasattr(meta_cls, "csr") else API_FLAT
    version = str(getattr(mla_module, "__flashinfer_version__", "") or "unknown")
    return FlashInferAPI(form, version, "unknown", wrapper, meta_cls if form == API_KEYWORD else None,
                         _accepted_backends(wrapper, form))


def _accepted_backends(wrapper_cls: type, form: str) -> tuple:
    """The backend values the wrapper's constructor accepts, without a GPU.

    0.7 validates `backend` in __init__ against a table (read it when exposed, else try each
    known value on a CPU workspace); the 0.2.x constructor validates nothing, so its docstring is
    read for the names it documents.
    """
    table = getattr(inspect.getmodule(wrapper_cls), "_BACKEND_TYPES", None)
    if isinstance(table, dict) and table:
        known = [b for b in KNOWN_BACKENDS if b in table]
        return tuple(known + sorted(b for b in table if b not in KNOWN_BACKENDS))
    if form == API_KEYWORD:
        ok = []
        ws = torch.empty(16, dtype=torch.uint8)
        for b in KNOWN_BACKENDS:
            try:
                wrapper_cls(ws, backend=b)
            except ValueError:
                continue
            except Exception:   # construction failed for another reason: do not rule it out
                pass
            ok.append(b)
        return tuple(ok)
    doc = " ".join(filter(None, (wrapper_cls.__doc__, getattr(wrapper_cls.__init__, "__doc__", None))))
    named = tuple(b for b in KNOWN_BACKENDS if f"``{b}``" in doc or f'"{b}"' in doc)
    return tuple(dict.fromkeys(_FLAT_FALLBACK_BACKENDS + named))


@functools.lru_cache(maxsize=1)
def _cached_api() -> FlashInferAPI:
    try:
        # lazy: FlashInfer is optional, and a broken install must be an answer, not an import error
        import flashinfer.mla as mla
    except Exception as e:  # a broken install raises more than ImportError (seen: AttributeError)
        raise FlashInferUnavailable(f"cannot import flashinfer.mla: {type(e).__name__}: {e}") from None
    api = detect_api(mla)
    version, package = "unknown", "unknown"
    try:
        import flashinfer
        version = str(getattr(flashinfer, "__version__", "unknown"))
    except Exception:
        pass
    for dist in ("flashinfer-python", "flashinfer"):
        try:
            metadata.version(dist)
            package = dist
            break
        except metadata.PackageNotFoundError:
            continue
    return FlashInferAPI(api.form, version, package, api.wrapper_cls, api.plan_metadata_cls, api.backends)


def flashinfer_api() -> FlashInferAPI:
    """The installed FlashInfer's MLA API (cached per process); raises FlashInferUnavailable."""
    return _cached_api()


def flashinfer_available() -> tuple[bool, str]:
    """(True, "flashinfer 0.7.2.post1, keyword API") or (False, why not)."""
    try:
        api = flashinfer_api()
    except FlashInferUnavailable as e:
        return False, str(e)
    return True, f"flashinfer {api.version} ({api.package}), {api.form} API"


def accepted_backends() -> tuple:
    """Backend values the installed FlashInfer's MLA wrapper accepts (aliases included)."""
    return flashinfer_api().backends


def concrete_backends(backends: tuple | None = None) -> tuple:
    """`backends` (default: the accepted ones) without the policy/alias values auto, cute-dsl."""
    return tuple(b for b in (backends if backends is not None else accepted_backends())
                 if b not in ALIAS_BACKENDS)


def is_refusal(exc: BaseException) -> bool:
    """Whether a plan-time exception is FlashInfer declining a backend/shape (vs. a bug).

    0.7 raises its typed `_BackendPlanUnsupportedError` (a ValueError); the 0.2.x line raises
    plain errors whose text says the device/dims are unsupported.
    """
    if isinstance(exc, BackendRefused):
        return True
    for cls in type(exc).__mro__:
        if cls.__name__ in ("_BackendPlanUnsupportedError", "BackendPlanUnsupportedError"):
            return True
    text = str(exc).lower()
    return isinstance(exc, (ValueError, NotImplementedError, RuntimeError)) and any(
        w in text for w in ("not supported", "unsupported", "requires sm", "requires an sm",
                            "only supports", "no supported planned"))


def make_workspace(device: torch.device | str, nbytes: int = WORKSPACE_BYTES) -> torch.Tensor:
    """A float workspace buffer for one wrapper (FlashInfer recommends 128 MiB for MLA)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


_DEVICE_WORKSPACES: dict = {}


def device_workspace(device: torch.device | str, purpose: str) -> torch.Tensor:
    """One float workspace per device and purpose ("decode", "prefill"), shared by every wrapper
    of that purpose: the layers of a step run one after another on one stream."""
    key = (str(device), purpose)
    if key not in _DEVICE_WORKSPACES:
        _DEVICE_WORKSPACES[key] = make_workspace(device)
    return _DEVICE_WORKSPACES[key]


@dataclass
class GraphBuffers:
    """Persistent device metadata buffers a CUDA-graph wrapper plans into (fixed batch size).

    Pass `kv_indices` as `out_kv_indices` to build_paged_metadata so the indices are gathered
    straight into it (FlashInfer then copies it onto itself, a no-op).
    """

    qo_indptr: torch.Tensor      # [batch+1] int32
    kv_indptr: torch.Tensor      # [batch+1] int32
    kv_indices: torch.Tensor     # [max_pages] int32
    kv_len: torch.Tensor         # [batch] int32

    @classmethod
    def allocate(cls, batch_size: int, max_pages: int, device) -> "GraphBuffers":
        z = functools.partial(torch.zeros, dtype=torch.int32, device=device)
        return cls(z(batch_size + 1), z(batch_size + 1), z(max(max_pages, 1)), z(batch_size))


class MLADecodeKernel:
    """One FlashInfer MLA wrapper for one backend value: plan() per step, run() per layer.

    `workspace` is the float workspace (see make_workspace); `backend` one of accepted_backends();
    `use_cuda_graph` with `graph_buffers` (GraphBuffers for one batch size) makes plan() copy the
    metadata into fixed device buffers so a captured run() stays valid; `api` forces API_FLAT or
    API_KEYWORD (tests; 0.7 accepts both) instead of the active profile's form (metax: flat,
    `vllm_metax.core.profile`), else the detected one.

    `fast_replan` (default: on unless VLLM_METAX_FAST_REPLAN=0) lets a plan() whose arguments
    other than the metadata equal the previous plan's skip FlashInfer's Python validation on the
    keyword API's fa2/fa3 (`vllm_metax.ops.fast_replan`); the result is the same plan, for a
    fraction of the host time. It is also what applies a tuned `kv_chunk` (plan()).

    Construction raises ValueError for a backend value FlashInfer does not accept; plan() raises
    BackendRefused when FlashInfer/the device declines the backend for these dims (e.g. fa3 off
    SM90); other exceptions are bugs or JIT failures and propagate unchanged.
    """

    def __init__(self, workspace: torch.Tensor, backend: str = "auto", use_cuda_graph: bool = False,
                 graph_buffers: GraphBuffers | None = None, api: str | None = None,
                 flashinfer: FlashInferAPI | None = None, fast_replan: bool | None = None):
        self._api_info = flashinfer or flashinfer_api()
        if api is not None and api not in API_FORMS:
            raise ValueError(f"api must be one of {API_FORMS}, got {api!r}")
        if api == API_KEYWORD and self._api_info.form != API_KEYWORD:
            raise ValueError(f"flashinfer {self._api_info.version} has no keyword MLA API")
        # the target profile's API form where it names one (metax: the flat 0.2.x form), else
        # the installed one
        self.api = api or _profile_api() or self._api_info.form
        self.backend = backend
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph and graph_buffers is None:
            raise ValueError("use_cuda_graph=True needs graph_buffers (GraphBuffers.allocate)")
        self.graph_buffers = graph_buffers
        gb = graph_buffers
        self.wrapper = self._api_info.wrapper_cls(
            workspace, use_cuda_graph,
            gb.qo_indptr if gb else None, gb.kv_indptr if gb else None,
            gb.kv_indices if gb else None, gb.kv_len if gb else None,
            backend=backend)
        self._planned_lse = False
        self._planned = False
        self._layout = None
        self.fast_replan = fr.ENABLED if fast_replan is None else fast_replan
        self._signature = None          # the arguments of the last public plan, besides metadata
        self.fast_replans = 0           # how many plans took the fast path (introspection/tests)
        # who made the last plan's schedule: "public" (FlashInfer's plan()), or the fast
        # re-plan's "mlaplan" / "numpy" / "chunked" (a tuned kv_chunk applied)
        self.last_schedule: str | None = None

    # ------------------------------------------------------------------ per decode step
    def plan(self, meta: PagedMetadata, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
             page_size: int, causal: bool, sm_scale: float, q_dtype: torch.dtype,
             kv_dtype: torch.dtype, *, return_lse: bool = False, layout: str | None = None,
             kv_chunk: float | None = None) -> None:
        """Plan one batch from CSR metadata (host indptr/len, device kv_indices).

        `meta` may be compact or strided (see vllm_metax.ops.paged_metadata); strided metadata
        is compacted here when the public plan() has to run. `return_lse` declares that run()
        will ask for the LSE (the keyword API fixes it at plan time). `layout` ("split" |
        "packed"; keyword API only) is the q/KV representation run() receives: default "split"
        (independent q_nope/q_pe and ckv/kpe tensors, what fa2/fa3 take natively), "packed" for
        backends that need it (cutlass, trtllm-gen, xqa, cute-dsl: then run()'s split tensors
        must be adjacent views of one [..., ckv+kpe] tensor).

        `kv_chunk` (a tuned choice, `vllm_metax.core.choices.FlashInferChoice`) scales the KV chunk
        limit of the schedule (`mla_schedule.chunk_limit`; infinity: never split). Only the fast
        re-plan's numpy schedule can apply it, so it takes effect from the second plan with the
        same arguments on; a batch whose chunked schedule would not fit FlashInfer's buffers is
        planned untuned. `last_schedule` says what ran.
        """
        if kv_chunk is not None and self.backend not in fr.BACKENDS:
            # a knob this backend would ignore is refused, never dropped (the readers keep it out)
            raise ValueError(f"kv_chunk is taken by FlashInfer backend {' or '.join(fr.BACKENDS)} "
                             f"only, not {self.backend!r}")
        signature = (num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_dtype,
                     kv_dtype, return_lse, layout)
        if signature == self._signature and self._replan_fast(meta, num_heads, head_dim_ckv, causal,
                                                              kv_chunk):
            self.fast_replans += 1
            return
        self._signature = None
        if not meta.compact:
            gb = self.graph_buffers
            meta = meta.compacted(gb.kv_indices if gb is not None else None)
        try:
            if self.api == API_KEYWORD:
                if layout is None:
                    layout = "packed" if self.backend in _PACKED_BACKENDS else "split"
                self.wrapper.plan(
                    metadata=self._api_info.plan_metadata_cls.csr(
                        meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_len),
                    num_heads=num_heads, head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe,
                    page_size=page_size, causal=causal, sm_scale=sm_scale, q_data_type=q_dtype,
                    kv_data_type=kv_dtype, query_layout=layout, kv_cache_layout=layout,
                    lse_mode="base2" if return_lse else "none")
            else:
                self.wrapper.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_len,
                                  num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
                                  sm_scale, q_dtype, kv_dtype)
        except Exception as e:
            if is_refusal(e):
                raise BackendRefused(self.backend, str(e)) from e
            raise
        self._planned_lse = return_lse
        self._planned = True
        self.last_schedule = "public"
        self._layout = layout
        self._signature = signature if self._fast_capable() else None

    def _fast_capable(self) -> bool:
        """Whether the wrapper just planned is one the fast re-plan understands (the keyword
        API's fa2/fa3 with the internals `vllm_metax.ops.fast_replan` uses)."""
        return self.fast_replan and self.api == API_KEYWORD and fr.capable(self.wrapper)

    def _replan_fast(self, meta: PagedMetadata, num_heads: int, head_dim_ckv: int,
                     causal: bool = False, kv_chunk: float | None = None) -> bool:
        """Re-plan through `vllm_metax.ops.fast_replan` (called only when the other plan
        arguments equal the last public plan's). False: the public plan() decides (the batch
        is outside `fast_replan.usable`, a graph buffer is too small, or the internals are not
        as expected: then the fast path is switched off for this kernel)."""
        if not self.fast_replan:
            return False
        try:
            made_by = fr.replan(self.wrapper, meta, num_heads, head_dim_ckv, causal, kv_chunk)
        except Exception:  # internals not as expected: the public path decides from now on
            self.fast_replan = False
            self._signature = None
            return False
        if made_by is None:
            return False
        self.last_schedule = made_by
        return True

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False):
        """Attention for the planned batch: out [T, H, ckv] (and lse [T, H], base 2, if asked).

        q_nope [T, H, ckv], q_pe [T, H, kpe]; ckv_cache [pages, page_size, ckv], kpe_cache
        [pages, page_size, kpe] (views of vLLM's packed [pages, page_size, ckv+kpe] cache work).
        Graph-capturable when `out` (and `lse`) are given.
        """
        if self.api == API_KEYWORD:
            if (return_lse or lse is not None) and not self._planned_lse:
                raise ValueError("run(return_lse=True) needs plan(..., return_lse=True) first")
            return self.wrapper.run(query=(q_nope, q_pe), kv_cache=(ckv_cache, kpe_cache),
                                    out=out, lse=lse, return_lse=return_lse)
        return self.wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse)

    # ------------------------------------------------------------------ introspection
    @property
    def planned(self) -> bool:
        return self._planned

    @property
    def resolved_backend(self) -> str | None:
        """The concrete backend FlashInfer planned (what "auto" resolved to), when it says."""
        if not self._planned:
            return None
        name = getattr(self.wrapper, "_planned_backend_name", None) or getattr(self.wrapper, "_backend", None)
        return name if isinstance(name, str) else None


def probe_backend(backend: str, device: torch.device | str = "cuda", num_heads: int = 16,
                  head_dim_ckv: int = 512, head_dim_kpe: int = 64, page_size: int = 64,
                  dtype: torch.dtype = torch.bfloat16, api: str | None = None) -> str | None:
    """Plan and run `backend` once on a tiny batch: None if it runs, else FlashInfer's refusal.

    Cached per argument set (the first call of a backend may JIT-compile it, ~20 s for fa2/fa3).
    Errors that are not refusals (compile failures, bugs) propagate.
    """
    return _probe(backend, str(torch.device(device)), num_heads, head_dim_ckv, head_dim_kpe,
                  page_size, dtype, api)


@functools.lru_cache(maxsize=None)
def _probe(backend, device, num_heads, head_dim_ckv, head_dim_kpe, page_size, dtype, api):
    lens = torch.tensor([page_size + 3, 1], dtype=torch.int32)
    pages = int(((lens + page_size - 1) // page_size).sum())
    block_table = torch.arange(pages, dtype=torch.int32, device=device).reshape(1, -1).repeat(2, 1)
    meta = build_paged_metadata(block_table, lens, page_size)
    try:
        kernel = MLADecodeKernel(make_workspace(device), backend, api=api)
    except ValueError as e:
        return str(e)
    try:
        kernel.plan(meta, num_heads, head_dim_ckv, head_dim_kpe, page_size, False,
                    (head_dim_ckv + head_dim_kpe) ** -0.5, dtype, dtype)
        kv = torch.randn(pages, page_size, head_dim_ckv + head_dim_kpe, device=device).to(dtype)
        q = torch.randn(2, num_heads, head_dim_ckv + head_dim_kpe, device=device).to(dtype)
        kernel.run(q[..., :head_dim_ckv], q[..., head_dim_ckv:], kv[..., :head_dim_ckv],
                   kv[..., head_dim_ckv:])
        torch.cuda.synchronize(device)
    except BackendRefused as e:
        return e.reason
    return None


def backend_support(device: torch.device | str = "cuda", **dims) -> dict:
    """backend value -> None (runs here) or why not, for every accepted value.

    A refusal gives FlashInfer's message; any other failure (an import or JIT error inside
    FlashInfer) gives "error: <type>: <message>", so one broken backend does not hide the rest.
    """
    out = {}
    for b in accepted_backends():
        try:
            out[b] = probe_backend(b, device, **dims)
        except Exception as e:  # noqa: BLE001 - a survey, not a kernel call
            out[b] = f"error: {type(e).__name__}: {e}"
    return out


__all__ = [
    "API_FLAT", "API_KEYWORD", "API_FORMS", "ALIAS_BACKENDS", "KNOWN_BACKENDS", "WORKSPACE_BYTES",
    "BackendRefused", "FlashInferAPI", "FlashInferUnavailable", "GraphBuffers", "MLADecodeKernel",
    "accepted_backends", "backend_support", "concrete_backends", "detect_api",
    "flashinfer_api", "flashinfer_available", "is_refusal", "make_workspace", "probe_backend",
]
