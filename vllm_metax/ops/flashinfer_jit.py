"""The FlashInfer JIT modules the plugin's kernels load, named as FlashInfer's cache names them
(vllm-free; FlashInfer is imported on first use).

flashinfer-python compiles a module (nvcc, ~20 s on a GPU host's CPU) the first time a wrapper
plans a (backend, dtypes, head dims) it has not built, and keeps it in its JIT cache:
`$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<target archs>/cached_ops/<name>/`
(`FLASHINFER_WORKSPACE_BASE` defaults to the home folder; the archs are the visible GPUs', or
`FLASHINFER_CUDA_ARCH_LIST`). A `JitModule` is one such entry, with the arguments FlashInfer's
wrapper derives from the plugin's plans:

* decode (`MLADecodeKernel`, `BatchMLAPagedAttentionWrapper`): q/kv dtypes, output dtype = q's,
  int32 index pointers (`paged_metadata`), kv_lora_rank and rope dims, no profiler;
* prefill (`MLAPrefillKernel`, the ragged prefill wrapper): q dtype for q, kv and output, int32
  index pointers, head_dim_qk = nope + rope, head_dim_vo = v, no position encoding, sliding
  window, soft-cap or fp16 QK reduction. For fa2 the wrapper loads the equal-stride module (its
  ragged kernels); its paged-only module is built only for paged runs, which the plugin never makes.

`mla-tune prebuild` builds these ahead of the server; the plugin says at start which of its
modules are not built yet. The MetaX FlashInfer build (0.2.x) names its modules otherwise: there
`jit_functions()` says they are unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DECODE, PREFILL = "decode", "prefill"
JIT_BACKENDS = ("fa2", "fa3")       # the backends FlashInfer compiles per shape (the others ship cubins)
INDEX_DTYPE = "int32"               # the plugin's index pointers, decode and prefill


class JitUnknown(RuntimeError):
    """This FlashInfer does not name or build its modules the way `JitModule` expects."""


def _torch_dtype(name: str):
    import torch    # lazy: naming modules and their cache folders (doctor, prebuild's plan) needs no torch
    return getattr(torch, name)


def jit_functions():
    """FlashInfer's module generators and names (flashinfer.jit.attention.modules); raises
    JitUnknown when this FlashInfer has none (MetaX's 0.2.x build, a broken install)."""
    try:
        # lazy: FlashInfer is optional; a broken install is JitUnknown, not an import error
        from flashinfer.jit.attention import modules
        from flashinfer.jit import env
    except Exception as e:  # a broken install raises more than ImportError
        raise JitUnknown(f"cannot import FlashInfer's JIT modules: {type(e).__name__}: {e}") from None
    needed = ("gen_batch_mla_module", "get_batch_mla_uri", "gen_batch_prefill_module",
              "get_batch_prefill_uri")
    missing = [n for n in needed if not hasattr(modules, n)]
    if missing or not hasattr(env, "FLASHINFER_JIT_DIR"):
        raise JitUnknown("this FlashInfer has no " + ", ".join(missing or ["FLASHINFER_JIT_DIR"])
                         + ": its modules build at first use")
    return modules, env


@dataclass(frozen=True, order=True)
class JitModule:
    """One FlashInfer JIT module: `dims` is (kv_lora_rank, rope) for decode, (head_dim_qk,
    head_dim_vo) for prefill; `dtype` the query's (and output's), `kv_dtype` the cache's."""

    kind: str
    backend: str
    dtype: str
    kv_dtype: str
    dims: tuple

    def __post_init__(self):
        if self.kind not in (DECODE, PREFILL) or self.backend not in JIT_BACKENDS:
            raise ValueError(f"no FlashInfer JIT module for {self.kind} {self.backend}")

    def describe(self) -> str:
        a, b = self.dims
        what = (f"MLA decode ckv {a} kpe {b}" if self.kind == DECODE
                else f"ragged prefill qk {a} vo {b}")
        return f"{what}, {self.backend}, {self.dtype}/{self.kv_dtype}"

    def _args(self) -> tuple:
        """The generator's arguments after the backend, as FlashInfer's wrapper passes them."""
        q, kv, idx = _torch_dtype(self.dtype), _torch_dtype(self.kv_dtype), _torch_dtype(INDEX_DTYPE)
        a, b = self.dims
        if self.kind == DECODE:
            return (q, kv, q, idx, a, b, False)
        return (q, kv, q, idx, a, b, 0, False, False, False)

    def _prefill_mode(self, modules) -> tuple | None:
        """(stride mode, surface) of the prefill module FlashInfer's wrapper loads, where this
        FlashInfer has the variants (0.7: fa2 loads its equal-stride primary); None: the public one."""
        if self.backend == "fa2" and hasattr(modules, "_gen_batch_prefill_primary_module") \
                and hasattr(modules, "_get_batch_prefill_module_uri"):
            return ("equal", "full")
        return None

    @property
    def name(self) -> str:
        """FlashInfer's name of the module: its cache folder and library file, its lock."""
        modules, _ = jit_functions()
        if self.kind == DECODE:
            return modules.get_batch_mla_uri(self.backend, *self._args())
        base = modules.get_batch_prefill_uri(self.backend, *self._args())
        mode = self._prefill_mode(modules)
        return base if mode is None else modules._get_batch_prefill_module_uri(base, self.backend, *mode)

    def spec(self):
        """FlashInfer's JitSpec of the module, from the generator its wrapper calls (this writes
        the module's generated sources into the cache, as a first plan would)."""
        modules, _ = jit_functions()
        if self.kind == DECODE:
            return modules.gen_batch_mla_module(self.backend, *self._args())
        if self._prefill_mode(modules) is not None:
            return modules._gen_batch_prefill_primary_module(self.backend, *self._args())
        return modules.gen_batch_prefill_module(self.backend, *self._args())

    def library(self) -> Path:
        """Where the server will look for it: an installed AOT package's copy, else the JIT cache's."""
        _, env = jit_functions()
        name = self.name
        aot = getattr(env, "get_aot_artifacts", None)
        found = aot(name) if aot is not None else ()
        if found:
            return Path(found[0].path)
        return Path(env.FLASHINFER_JIT_DIR) / name / f"{name}.so"

    def built(self) -> bool:
        return self.library().exists()


def decode_module(backend: str, q_dtype: str, kv_dtype: str, kv_lora_rank: int,
                  rope_dim: int) -> JitModule:
    """The module `MLADecodeKernel` loads for a plan of these dims (q, kv dtype names)."""
    return JitModule(DECODE, backend, q_dtype, kv_dtype, (int(kv_lora_rank), int(rope_dim)))


def prefill_module(backend: str, dtype: str, head_dim_qk: int, head_dim_vo: int) -> JitModule:
    """The module `MLAPrefillKernel` loads for a plan of these dims (its q, kv and output dtype)."""
    return JitModule(PREFILL, backend, dtype, dtype, (int(head_dim_qk), int(head_dim_vo)))


def jit_dir() -> Path:
    """FlashInfer's JIT cache folder for the target archs, as this process computed it."""
    return Path(jit_functions()[1].FLASHINFER_JIT_DIR)
