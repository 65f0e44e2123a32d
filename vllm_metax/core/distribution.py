"""Who else is installed as `vllm_metax`: MetaX's own vLLM-metax plugin is also a top-level package
`vllm_metax` with a `metax` platform entry point, so installing one over the other replaces files
silently. Stdlib only (importlib.metadata), cheap enough for plugin registration."""

from __future__ import annotations

import re
from importlib import metadata

OWN_DISTRIBUTION = "mla-tune"
PLATFORM_GROUP = "vllm.platform_plugins"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# a line of a file list (RECORD, installed-files.txt relative to the .egg-info, SOURCES.txt) that
# names a file of the vllm_metax package
_PACKAGE_FILE = re.compile(r"^(?:\.{1,2}/)*vllm_metax[/\\]", re.MULTILINE)


def _lists_package(dist) -> bool:
    """Whether the distribution's file list holds a vllm_metax/ file: one regex over the list's
    text, not `dist.files` (a path object per installed file: seconds over a full vLLM
    environment, paid by every process that loads the plugin)."""
    for name in ("RECORD", "installed-files.txt", "SOURCES.txt"):
        text = dist.read_text(name)
        if text:
            return bool(_PACKAGE_FILE.search(text))
    return False


def other_owners(distributions=None) -> list[str]:
    """Distributions other than this one that provide the `vllm_metax` package or a `metax`
    platform plugin, as "name version" (sorted)."""
    found = set()
    for dist in (metadata.distributions() if distributions is None else distributions):
        name = dist.metadata.get("Name") or ""
        if not name or _canonical(name) == OWN_DISTRIBUTION:
            continue
        top = (dist.read_text("top_level.txt") or "").split()
        owns_package = "vllm_metax" in top or _lists_package(dist)
        plugin = any(ep.group == PLATFORM_GROUP and ep.name == "metax" for ep in dist.entry_points)
        if owns_package or plugin:
            found.add(f"{name} {dist.version}")
    return sorted(found)


def clash_message(owners: list[str]) -> str | None:
    """One line for `mla-tune doctor` and the plugin's log, or None without a clash."""
    if not owners:
        return None
    return (f"another distribution also installs vllm_metax / the 'metax' vLLM platform plugin: "
            f"{', '.join(owners)}; the two replace each other's files (this is mla-tune's plugin, "
            f"not MetaX's vLLM-metax: see the README, 'On a MetaX host')")
