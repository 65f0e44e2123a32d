"""The run record: the environment every measurement of a run was taken in."""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata

import torch


from vllm_metax.core.device import detect_device
from vllm_metax.core.profile import target_profile


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def _driver() -> str | None:
    smi = shutil.which("nvidia-smi") or shutil.which("mx-smi")
    if not smi or "nvidia" not in smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def capture_environment(kind: str, command: str = "", profile=None) -> dict:
    """Device, SM count, driver, CUDA, torch/flashinfer/vllm versions, host, python, and the
    target profile the run measures under (`profile`; None: the active one)."""
    dev = detect_device()
    return {
        "profile": target_profile(profile).name,
        "kind": kind,                       # "gpu" or "cpu-reference"
        "device_name": dev.name,
        "sm_count": dev.sm_count,
        "driver": _driver() if dev.source != "none" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "flashinfer": _version("flashinfer-python", "flashinfer"),
        "vllm": _version("vllm"),
        "host": socket.gethostname(),
        "python": f"{platform.python_implementation()} {sys.version.split()[0]}",
        "command": command,
        "capability": ".".join(map(str, dev.capability)) if dev.capability else None,
    }
