"""Which accelerator is here, named the way the plugin and the tuned-config files name it.

MetaX devices are found through pymxsml (MetaX's management library: mxSmlInit,
mxSmlGetDeviceCount, mxSmlGetDeviceInfo(i).deviceName) or by a MetaX device name reported by torch
(MetaX's torch build exposes the CUDA API). vllm-free and cheap: torch is imported only if needed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

FORCE_ENV = "VLLM_METAX_FORCE"    # activate the platform plugin on a non-MetaX (or GPU-less) host
METAX_NAME_PREFIXES = ("metax", "mxc", "mxn")


@dataclass(frozen=True)
class DeviceInfo:
    name: str               # e.g. "NVIDIA H200", "MetaX C500"; "cpu" without an accelerator
    source: str             # pymxsml | torch | none
    is_metax: bool
    sm_count: int | None = None
    capability: tuple | None = None


def is_metax_name(name: str) -> bool:
    return name.strip().lower().startswith(METAX_NAME_PREFIXES)


def _pymxsml_name() -> str | None:
    try:
        import pymxsml  # MetaX hosts only
    except ImportError:
        return None
    try:
        pymxsml.mxSmlInit()
        if pymxsml.mxSmlGetDeviceCount() < 1:
            return None
        name = pymxsml.mxSmlGetDeviceInfo(0).deviceName
        name = name.decode() if isinstance(name, bytes) else str(name)
        return name.strip() or None
    except Exception:  # a driver that answers badly means "no MetaX device here"
        return None


@lru_cache(maxsize=1)
def detect_device() -> DeviceInfo:
    """The first visible accelerator (pymxsml first, then torch.cuda), cached per process."""
    name = _pymxsml_name()
    if name:
        sm, cap = _torch_props()
        return DeviceInfo(name, "pymxsml", True, sm, cap)
    try:
        import torch    # lazy: core/ imports the standard library only (read while vLLM starts)
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return DeviceInfo(props.name, "torch", is_metax_name(props.name),
                              props.multi_processor_count, (props.major, props.minor))
    except Exception:
        pass
    return DeviceInfo("cpu", "none", False)


def _torch_props():
    try:
        import torch    # lazy, as in detect_device
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return p.multi_processor_count, (p.major, p.minor)
    except Exception:
        pass
    return None, None


def forced() -> bool:
    return os.environ.get(FORCE_ENV, "").lower() in ("1", "true", "yes")
