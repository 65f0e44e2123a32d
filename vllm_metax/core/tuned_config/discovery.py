"""Where the plugin finds this device's tuned config, and the one copy a process keeps: the
folder variable, then the packaged configs/; a file that cannot be used is reported, and is an
error only in strict mode."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vllm_metax.core.log import get_logger
from vllm_metax.core.tuned_config.files import config_filename, read_tuned_config
from vllm_metax.core.tuned_config.schema import TunedConfig, TunedConfigError

logger = get_logger(__name__)

FOLDER_ENV = "VLLM_METAX_MLA_CONFIG_FOLDER"   # own variable: vLLM-metax overwrites VLLM_TUNED_CONFIG_FOLDER
STRICT_ENV = "VLLM_METAX_MLA_CONFIG_STRICT"
PACKAGED_ENV = "VLLM_METAX_MLA_PACKAGED_FOLDER"   # tests only: stand-in for the shipped folder
# the package's configs/ (vllm_metax/configs)
PACKAGED_FOLDER = Path(os.environ.get(PACKAGED_ENV) or Path(__file__).resolve().parents[2] / "configs")


def search_folders() -> list[tuple[Path, str]]:
    """Where the plugin looks, in order, with why."""
    out = []
    if os.environ.get(FOLDER_ENV):
        out.append((Path(os.environ[FOLDER_ENV]), f"${FOLDER_ENV}"))
    out.append((PACKAGED_FOLDER, "packaged configs/"))
    return out


@dataclass(frozen=True)
class Resolution:
    """What the plugin would load for a device, and why (shown by `mla-tune doctor`)."""

    config: TunedConfig | None
    path: Path | None
    reason: str


def strict_mode() -> bool:
    return os.environ.get(STRICT_ENV, "").lower() in ("1", "true", "yes")


def resolve_tuned_config(device_name: str) -> Resolution:
    """Find, read and validate this device's file. Never raises unless strict mode is on.

    A file (or anything else) named like the config that cannot be used is reported, not skipped;
    strict mode raises for it, the lenient mode returns no config and says why."""
    try:
        name = config_filename(device_name)
    except TunedConfigError as e:
        return _unusable(e, None)
    tried = []
    for folder, why in search_folders():
        path = folder / name
        tried.append(str(path))
        if not os.path.lexists(path):
            continue
        try:
            cfg = read_tuned_config(path)
        except TunedConfigError as e:
            return _unusable(e, path)
        if cfg.device_name.replace(" ", "_") != device_name.strip().replace(" ", "_"):
            return _unusable(TunedConfigError(f"{path}: written for device {cfg.device_name!r}, "
                                              f"this is {device_name!r}"), path)
        return Resolution(cfg, path, f"found in {why}")
    return Resolution(None, None, f"no tuned config for {device_name!r} (looked for {', '.join(tried)})")


def _unusable(error: TunedConfigError, path: Path | None) -> Resolution:
    """A name or file that cannot be used: the error in strict mode, else no config and why."""
    if strict_mode():
        raise error
    return Resolution(None, path, f"ignored (using defaults): {error}")


_CACHE: dict = {}


def load_tuned_config(device_name: str) -> TunedConfig | None:
    """Cached per device for the life of the process; a miss or a bad file logs one warning."""
    if device_name in _CACHE:
        return _CACHE[device_name]
    res = resolve_tuned_config(device_name)
    if res.config is None:
        logger.warning("vllm_metax MLA: %s", res.reason)
    else:
        logger.info("vllm_metax MLA: tuned config %s (%s)", res.path, res.reason)
    _CACHE[device_name] = res.config
    return res.config


def clear_cache() -> None:
    _CACHE.clear()
