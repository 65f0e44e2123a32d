"""One of vLLM's compiled kernel libraries, found beside the installed vllm package and loaded with
`torch.ops.load_library`, without importing vllm (whose own loaders refuse an out-of-tree platform
such as `metax`): the FlashMLA and FA3 ops use it. vLLM 0.33.0 builds these libraries against
torch's stable C ABI, so one build serves several torch versions. Loading happens once per
process and never raises: a library that is missing or built for another torch/CUDA is a reason."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import torch


def hopper_reason(name: str, kernels: str, device=None, capability: tuple | None = None) -> str | None:
    """Why `name`'s `kernels` (a Hopper-only build, sm_90a) cannot run on this device, or None;
    `capability` overrides the device's (tests)."""
    if capability is None:
        if not torch.cuda.is_available():
            return f"{name} needs a CUDA device (torch sees none)"
        capability = tuple(torch.cuda.get_device_capability(device))
    if capability[0] != 9:
        return (f"{kernels} are built for Hopper (sm_90a); this device is compute capability "
                f"{capability[0]}.{capability[1]}")
    return None


class VllmLibrary:
    def __init__(self, subdir: str, glob: str, namespace: str, ops: tuple[str, ...], what: str):
        self.subdir, self.glob, self.namespace, self.ops, self.what = subdir, glob, namespace, ops, what
        self._lock = threading.Lock()
        self.loaded: tuple[bool, str] | None = None

    def path(self) -> Path | None:
        """The library file, found without importing vllm (None if absent)."""
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):
            return None
        for d in (spec.submodule_search_locations or []) if spec is not None else []:
            found = sorted((Path(d) / self.subdir).glob(self.glob))
            if found:
                return found[0]
        return None

    def has_ops(self) -> bool:
        try:
            ns = getattr(torch.ops, self.namespace)
            for op in self.ops:
                getattr(ns, op)
            return True
        except (AttributeError, RuntimeError):
            return False

    def load(self) -> tuple[bool, str]:
        """(loaded, why not), decided once per process."""
        with self._lock:
            if self.loaded is not None:
                return self.loaded
            if self.has_ops():                     # vllm (or someone) loaded it already
                self.loaded = (True, "")
                return self.loaded
            path = self.path()
            if path is None:
                self.loaded = (False, f"{self.what} is not installed")
                return self.loaded
            try:
                torch.ops.load_library(str(path))
            except Exception as e:  # another torch/CUDA's build: unavailable, not a crash
                self.loaded = (False, f"cannot load {path.name}: {type(e).__name__}: {str(e)[:300]}")
                return self.loaded
            self.loaded = (True, "") if self.has_ops() else (
                False, f"{path.name} loaded but registers no {self.namespace}::{self.ops[0]}")
            return self.loaded
