"""`mla-tune prebuild`: build the FlashInfer JIT modules a tuned config serves, ahead of the server.

Without it a server's first start compiles them (nvcc, ~20 s each on a GPU host) inside vLLM's
warm-up and CUDA-graph capture. Which modules: `vllm_metax.backend.served_modules` (the backend
values the server's own choice functions pick, on the target's capability); where: FlashInfer's
own JIT cache, under the same name, folder and lock a server's first plan uses (`FLASHINFER_WORKSPACE_BASE`,
default the home folder; the target archs' folder), built by FlashInfer's own spec and ninja file,
so the server's ninja finds every module up to date.

The target is this machine's GPU, or `arch` ("9.0a": FlashInfer's FLASHINFER_CUDA_ARCH_LIST
spelling) on a machine without one. A build there is found by the server only where the paths in
FlashInfer's build files are the same (the same image: venv, CUDA_HOME, FLASHINFER_WORKSPACE_BASE).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from mla_tune.problem.workload import model_preset
from vllm_metax.core import decisions, device as core_device, serving, tuned_config as tc
from vllm_metax.ops.flashinfer_jit import JitUnknown, jit_dir

ARCH_ENV = "FLASHINFER_CUDA_ARCH_LIST"       # FlashInfer's target archs (else the visible GPUs')
CACHE_ENV = "FLASHINFER_WORKSPACE_BASE"      # FlashInfer's cache root (else the home folder)
_ARCH = re.compile(r"^(\d+)\.(\d+)([a-z]?)$")


class PrebuildError(ValueError):
    """The prebuild cannot start (no target, no config, no nvcc, unknown FlashInfer): one line."""


@dataclass(frozen=True)
class Target:
    """What the modules are built for: a capability and how it was found."""

    capability: tuple
    arch: str | None        # FLASHINFER_CUDA_ARCH_LIST to set, None: FlashInfer's own detection
    source: str             # "--arch", "$FLASHINFER_CUDA_ARCH_LIST", or the GPU's name
    is_metax: bool = False


def parse_arch(text: str) -> tuple:
    """ "9.0a" -> (9, 0); a PrebuildError for anything FlashInfer's arch list would not take."""
    m = _ARCH.match(text.strip())
    if not m:
        raise PrebuildError(f"--arch must be MAJOR.MINOR with an optional suffix, as FlashInfer's "
                            f"{ARCH_ENV} takes it (e.g. 9.0a for H100/H200, 8.0 for A100), "
                            f"got {text!r}")
    return int(m.group(1)), int(m.group(2))


def resolve_target(arch: str | None, device=None) -> Target:
    """--arch, else $FLASHINFER_CUDA_ARCH_LIST (its first arch), else the visible GPU."""
    if arch is not None:
        return Target(parse_arch(arch), arch.strip(), f"--arch {arch.strip()}")
    env = os.environ.get(ARCH_ENV, "").split()
    if env:
        try:
            return Target(parse_arch(env[0]), None, f"${ARCH_ENV}")
        except PrebuildError:
            raise PrebuildError(f"${ARCH_ENV}={os.environ[ARCH_ENV]!r} is not an arch list "
                                "FlashInfer takes (e.g. 9.0a)") from None
    dev = device or core_device.detect_device()
    if dev.capability is None:
        raise PrebuildError("no GPU here to build for: give --arch (e.g. 9.0a for H100/H200) "
                            "and --config FILE")
    return Target(tuple(dev.capability), None, dev.name, dev.is_metax)


def apply_target(target: Target) -> None:
    """Point FlashInfer at the target's arch before it is imported (its cache folder and nvcc
    flags are fixed at import); a PrebuildError where FlashInfer was imported for another target."""
    if target.arch is not None:
        os.environ[ARCH_ENV] = target.arch
    env = sys.modules.get("flashinfer.jit.env")
    if env is not None and hasattr(env, "_get_workspace_dir_name") \
            and env._get_workspace_dir_name() != env.FLASHINFER_WORKSPACE_DIR:
        raise PrebuildError("FlashInfer was imported in this process for another target; run "
                            "the prebuild in a fresh process")


def load_config(path: str | None, device=None):
    """The tuned config to build for: `path`, else the one the plugin loads on this GPU (as
    `mla-tune doctor` finds it). A PrebuildError where there is none; TunedConfigError for a
    file that cannot be used."""
    if path is not None:
        if not os.path.isfile(path):
            raise PrebuildError(f"--config {path}: no such file")
        return tc.read_tuned_config(path)
    dev = device or core_device.detect_device()
    if dev.source == "none":
        raise PrebuildError("no GPU here to find its tuned config: give --config FILE")
    res = tc.resolve_tuned_config(dev.name)
    if res.config is None:
        raise PrebuildError(f"no tuned config to build for: {res.reason}; give --config FILE")
    return res.config


def select_entries(cfg, model: str | None, tp_size: int = 1, dtype: str = "bfloat16") -> list:
    """The config's entries (all of them: a server runs the model it is started with), or the
    one `model` at `tp_size` runs with."""
    if model is None:
        return list(cfg.models)
    m = model_preset(model)
    dims = decisions.model_key(m.heads_per_rank(tp_size), m.kv_lora_rank, m.qk_rope_head_dim,
                               dtype, dtype)
    served = serving.entry_for(cfg, dims)
    if served.entry is None:
        raise PrebuildError(served.why.removesuffix(": serving untuned"))
    return [served.entry]


def served_modules(entries, target: Target) -> list:
    """The FlashInfer JIT modules `entries` serve on `target` (`vllm_metax.backend.served_modules`)."""
    # lazy: these import the ops (torch, Triton); naming the target and its config needs neither
    from vllm_metax.backend.served_modules import config_modules
    from vllm_metax.ops import device_backends
    dev = core_device.DeviceInfo(target.source, "target", target.is_metax, None, target.capability)
    return config_modules(entries, device_backends.device_flashinfer_backends(device=dev),
                          device_backends.device_prefill_backends(device=dev))


def cache_folder() -> Path:
    """FlashInfer's JIT cache folder for the target (after `apply_target`); PrebuildError where
    this FlashInfer has no JIT cache prebuild knows."""
    try:
        return jit_dir()
    except JitUnknown as e:
        raise PrebuildError(str(e)) from None


def check_names(modules) -> None:
    """Name every module through this FlashInfer's own functions (what the cache holds them
    under); a PrebuildError where they do not take the arguments its 0.7 line takes."""
    for m in modules:
        try:
            m.name
        except Exception as e:  # noqa: BLE001 - another FlashInfer line names its modules otherwise
            raise PrebuildError(f"this FlashInfer does not name its {m.kind} modules as 0.7 does "
                                f"({type(e).__name__}: {e}): its modules build at first use") from None


def find_nvcc() -> str:
    """The nvcc FlashInfer will run ($CUDA_HOME/bin/nvcc, else the one on PATH); a PrebuildError
    naming what is missing."""
    try:
        from flashinfer.jit.cpp_ext import get_cuda_path   # lazy: FlashInfer is optional here
        home = get_cuda_path()
    except Exception as e:  # noqa: BLE001 - FlashInfer raises RuntimeError when it finds none
        raise PrebuildError(f"no nvcc: FlashInfer compiles its modules with the CUDA toolkit's "
                            f"nvcc ({e}); install it or set CUDA_HOME") from None
    nvcc = Path(home) / "bin" / "nvcc"
    if not (nvcc.is_file() and os.access(nvcc, os.X_OK)):
        where = f"CUDA_HOME={os.environ['CUDA_HOME']}" if os.environ.get("CUDA_HOME") else "PATH"
        raise PrebuildError(f"no nvcc at {nvcc} (from {where}): FlashInfer compiles its modules "
                            "with the CUDA toolkit's nvcc; install it or set CUDA_HOME")
    if shutil.which("ninja") is None:
        raise PrebuildError("no ninja on PATH: FlashInfer builds its modules with ninja "
                            "(pip install ninja, or activate the venv that has it)")
    return str(nvcc)


def default_jobs() -> int:
    return max(1, os.cpu_count() or 1)
