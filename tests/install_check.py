"""Is every installed kernel library importable? The check that catches install drift.

On 2026-12-07 the README's two install commands, run in order in one venv, left uv's choice of
`cuda-python 12.6.2.post1` overwriting torch's `cuda-bindings 13.5` files; `import flashinfer`
then raised AttributeError, and the tests that need FlashInfer failed one by one with that error
buried in each. A library that is installed but does not import is a broken install, not a reason
to skip: the test session stops at its start with one line naming the package.

    python tests/install_check.py [dist=module ...]   # exit 0, or 1 with one line per broken package

Run in a subprocess (tests/conftest.py does), so importing vLLM or FlashInfer here cannot change
the test process (vLLM's import sets environment variables and torch options).
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import sys

# (distribution, module it provides): the optional libraries the tests import. A distribution
# that is not installed is not checked (its tests skip); one that is installed must import.
LIBRARIES = (
    ("torch", "torch"),
    ("triton", "triton"),
    ("cuda-bindings", "cuda.bindings.runtime"),
    ("flashinfer-python", "flashinfer"),
    ("flashinfer", "flashinfer"),                 # MetaX's vendor build
    ("vllm", "vllm"),
    ("psycopg2-binary", "psycopg2"),
    ("hypothesis", "hypothesis"),
)


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def broken(libraries=LIBRARIES) -> list[str]:
    """One line per installed distribution whose module does not import."""
    out = []
    for dist, module in libraries:
        version = installed(dist)
        if version is None:
            continue
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure to import is the finding
            first = str(e).splitlines()[0] if str(e) else ""
            out.append(f"broken install: {dist} {version} is installed but `import {module}` fails: "
                       f"{type(e).__name__}: {first}")
    return out


def main(argv: list[str]) -> int:
    libraries = [tuple(a.split("=", 1)) for a in argv] or LIBRARIES
    lines = broken(libraries)
    for line in lines:
        print(line)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
