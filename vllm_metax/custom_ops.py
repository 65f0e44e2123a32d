"""vLLM's compiled kernels for the layers around attention (norms, activations, rotary) on the
metax platform, where vLLM would otherwise run their PyTorch code.

vLLM dispatches a `CustomOp` by platform: CUDA gets `forward_cuda` (its compiled kernels), an
out-of-tree platform gets `forward_oot`, which defaults to `forward_native`, PyTorch's several
elementwise kernels per op. Its IR ops (`rms_norm`, `fused_add_rms_norm`) take their provider order
from `Platform.get_default_ir_op_priority`, whose default is PyTorch's alone. So the metax platform,
with the very same kernels loaded (vLLM's `_C_stable_libtorch`, or MetaX's `mcoplib._C`, which
registers the same `torch.ops._C` names), ran every norm, SiLU and rotary of a decode step as
PyTorch code. On a lent H100, vLLM's own server decoded the 27-layer 16-head serving model at
2.16 ms p50 TPOT, 1.28 ms of it GPU kernels outside attention; the plugin's, tuned, at 5.13 ms
(bench/results/serve_bench_h100.md).

This module gives the platform CUDA's choices wherever the kernels are registered here:
- `ir_op_priority`: vLLM's compiled `vllm_c` provider before PyTorch's, as `CudaPlatform` orders
  them (PyTorch alone when inductor compiles, which fuses the native code itself);
- `register_cuda_forward`: for each op in `CUDA_FORWARD` whose kernels are registered, an
  out-of-tree subclass (vLLM's `CustomOp.register_oot`) whose `forward_oot` is vLLM's own
  `forward_cuda`. An op whose kernels are missing keeps PyTorch's code; one that another plugin
  (MetaX's vLLM-metax) registered first keeps that one;
- `route_merge_attn_states`: the MLA layers' merge of prefix and suffix attention (every prefill
  chunk with context) through vLLM's compiled `_C.merge_attn_states`, as on CUDA. vLLM takes that
  kernel only where `current_platform.is_cuda()`, elsewhere a Triton kernel that is JIT-compiled
  at the first long prompt a server sees (vLLM's JIT monitor: "Triton kernel JIT compilation during
  inference: merge_attn_states_kernel" on every plugin server of the lent H100, never on vLLM's own).
"""

from __future__ import annotations

import importlib

import torch

from vllm_metax.core.log import get_logger
from vllm_metax.kernels import has_op

logger = get_logger(__name__)

# The CustomOps whose forward_cuda is a compiled kernel (and nothing NVIDIA-only), with the torch
# ops it calls. RMSNorm is not here: its forward_cuda is forward_native, which calls the IR ops.
# DeepseekScalingRotaryEmbedding (YaRN) is not either: off FlashInfer its forward_cuda is native.
CUDA_FORWARD = {
    "vllm.model_executor.layers.activation.SiluAndMul": ("_C.silu_and_mul",),
    "vllm.model_executor.layers.activation.MulAndSilu": ("_C.mul_and_silu",),
    "vllm.model_executor.layers.activation.GeluAndMul": ("_C.gelu_and_mul", "_C.gelu_tanh_and_mul"),
    "vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding": ("_C.rotary_embedding",),
}
# vLLM's `vllm_c` implementations of its IR ops (vllm/kernels/vllm_c.py) and the ops they call
IR_OPS = {"rms_norm": "_C.rms_norm", "fused_add_rms_norm": "_C.fused_add_rms_norm"}


def ir_op_priority(using_inductor: bool, has=None) -> dict[str, list[str]]:
    """The provider order per IR op: CudaPlatform's (`vllm_c`, then `native`) where vLLM's kernel
    for that op is registered and inductor does not compile; `native` alone otherwise."""
    has = has or has_op
    return {op: ["native"] if using_inductor or not has(kernel) else ["vllm_c", "native"]
            for op, kernel in IR_OPS.items()}


def _load(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def register_cuda_forward(has=None, loader=_load) -> dict[str, str]:
    """Register, once per process, an out-of-tree subclass of each op in CUDA_FORWARD whose
    `forward_oot` is vLLM's `forward_cuda`. Returns what each op runs, by class name: "compiled",
    or why PyTorch's code stays. Never raises: an op that cannot be swapped keeps vLLM's default."""
    # lazy: vLLM's custom_op module resolves the current platform on import (vllm_metax.platform)
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    has = has or has_op
    outcome = {}
    for path, kernels in CUDA_FORWARD.items():
        name = path.rsplit(".", 1)[1]
        missing = [k for k in kernels if not has(k)]
        registered = op_registry_oot.get(name)
        if registered is not None:
            outcome[name] = ("compiled" if getattr(registered, "_vllm_metax_cuda_forward", False)
                             else f"kept {registered.__module__}.{registered.__qualname__}")
            continue
        if missing:
            outcome[name] = f"PyTorch code: {', '.join('torch.ops.' + k for k in missing)} not registered"
            continue
        try:
            cls = loader(path)
        except Exception as e:  # noqa: BLE001 - another vLLM build may lack the class
            outcome[name] = f"PyTorch code: {type(e).__name__}: {e}"
            continue
        sub = type(name, (cls,), {"forward_oot": cls.forward_cuda, "_vllm_metax_cuda_forward": True,
                                  "__module__": __name__, "__qualname__": f"{name}[compiled]"})
        CustomOp.register_oot(sub, name=name)
        sub.name = cls.name     # register_oot renames it; --compilation-config's custom_ops use this
        outcome[name] = "compiled"
    return outcome


# vLLM's modules that bound `merge_attn_states` at import: the MLA attention layers
MERGE_USERS = ("vllm.model_executor.layers.attention.mla_attention",
               "vllm.model_executor.layers.attention.sparse_mla_attention")


def compiled_merge(fallback):
    """vLLM's `merge_attn_states` as CudaPlatform runs it: the compiled kernel for the dtypes and
    head sizes it takes (vllm/v1/attention/ops/merge_attn_states.py's rule), `fallback` (vLLM's own
    function, which asserts on bad input and runs Triton) for everything else.

    The LSE tensors are [heads, tokens]; the plugin's FlashInfer prefill hands them over as
    transposed views. Earlier versions of the compiled kernel index them as contiguous
    (`head * num_tokens + token`), so they reach it contiguous (a copy of a few hundred KB at most),
    and an `output_lse` that is a strided view (the continuation merge writes a slice) keeps
    vLLM's merge."""
    from vllm import _custom_ops   # lazy: warns where vLLM has no vllm._C; loaded only where the op is

    head_multiple = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8}   # the kernel's dtypes

    def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                          output_lse=None, prefill_tokens_with_context=None, output_scale=None):
        multiple = head_multiple.get(prefix_output.dtype)
        if (multiple and prefix_output.shape[2] % multiple == 0
                and prefix_output.stride(1) == suffix_output.stride(1)
                and (output_lse is None or output_lse.is_contiguous())
                and (output_scale is not None or output.dtype in head_multiple)):
            return _custom_ops.merge_attn_states(output, prefix_output, prefix_lse.contiguous(),
                                                 suffix_output, suffix_lse.contiguous(), output_lse,
                                                 prefill_tokens_with_context, output_scale)
        return fallback(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                        prefill_tokens_with_context, output_scale)

    merge_attn_states.__wrapped__ = fallback
    merge_attn_states._vllm_metax_compiled = True
    return merge_attn_states


MERGE_ARGS = ("output", "output_lse", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse",
              "prefill_tokens_with_context", "output_scale")


def _merge_signature_mismatch() -> str | None:
    """Why the registered `_C.merge_attn_states` is not the one vLLM 0.33 calls (another build's,
    MetaX's `mcoplib` say, with the older six-argument kernel that wants contiguous heads), or None."""
    try:
        names = tuple(a.name for a in torch.ops._C.merge_attn_states.default._schema.arguments)
    except (AttributeError, RuntimeError) as e:
        return f"torch.ops._C.merge_attn_states has no readable schema ({e})"
    if names != MERGE_ARGS:
        return f"torch.ops._C.merge_attn_states takes ({', '.join(names)}), not vLLM 0.33's arguments"
    return None


def route_merge_attn_states(has=None, modules=MERGE_USERS) -> str:
    """Point each module of `modules` that calls vLLM's `merge_attn_states` at `compiled_merge`,
    once per process, where `_C.merge_attn_states` is registered. Returns "compiled" or why vLLM's
    Triton merge stays; never raises. A module whose name is bound to something else (another
    plugin's) keeps it."""
    has = has or has_op
    if not has("_C.merge_attn_states"):
        return "Triton: torch.ops._C.merge_attn_states not registered"
    if (why := _merge_signature_mismatch()) is not None:
        return f"Triton: {why}"
    try:
        # lazy, in the try: another vLLM build may lay these modules out differently
        from vllm.v1.attention.ops import merge_attn_states as source
        original = source.merge_attn_states
        users = [importlib.import_module(m) for m in modules]
    except Exception as e:  # noqa: BLE001 - another vLLM build may lay these out differently
        return f"Triton: {type(e).__name__}: {e}"
    routed = compiled_merge(original)
    bound = [u for u in users if getattr(u, "merge_attn_states", None) is original]
    for u in bound:
        u.merge_attn_states = routed
    kept = [u.__name__.rsplit(".", 1)[1] for u in users
            if not getattr(getattr(u, "merge_attn_states", None), "_vllm_metax_compiled", False)]
    if not kept:
        return "compiled"
    return ("compiled, except " if len(kept) < len(users) else "") + \
        f"another plugin's merge_attn_states kept in {', '.join(kept)}"


def summary(outcome: dict[str, str], priority: dict[str, list[str]] | None = None) -> str:
    """One log line: which ops run vLLM's compiled kernels and which PyTorch's code."""
    compiled = [n for n, what in outcome.items() if what == "compiled"]
    others = [f"{n} ({what})" for n, what in outcome.items() if what != "compiled"]
    parts = [f"vLLM's compiled kernels for {', '.join(compiled) or 'no CustomOp'}"]
    if priority:
        parts.append("IR ops " + ", ".join(f"{op}: {' > '.join(p)}" for op, p in priority.items()))
    if others:
        parts.append("not swapped: " + "; ".join(others))
    return "vllm_metax: " + "; ".join(parts)
