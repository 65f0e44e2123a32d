"""The install does not drift: the extras pin what the kernel libraries need, and a broken
kernel library stops the test session in one line (tests/install_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "install_check.py"


def fake_distribution(root: Path, dist: str, module: str, body: str, version: str = "1.0") -> None:
    """A package `module` whose import runs `body`, installed as distribution `dist`."""
    pkg = root.joinpath(*module.split("."))
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


def run_check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_an_installed_library_that_does_not_import_is_named_in_one_line(tmp_path):
    fake_distribution(tmp_path, "broken-bindings", "brokenbindings",
                      "raise AttributeError(\"module 'cuda.bindings.runtime' has no attribute "
                      "'cudaLibrary_t'\")\n", version="12.6.2.post1")
    fake_distribution(tmp_path, "fine-lib", "finelib", "VALUE = 1\n")
    r = run_check(tmp_path, "broken-bindings=brokenbindings", "fine-lib=finelib",
                  "not-installed-lib=notinstalled")
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        "broken install: broken-bindings 12.6.2.post1 is installed but `import brokenbindings` "
        "fails: AttributeError: module 'cuda.bindings.runtime' has no attribute 'cudaLibrary_t'"]


def test_libraries_that_import_or_are_absent_pass(tmp_path):
    fake_distribution(tmp_path, "fine-lib", "finelib", "VALUE = 1\n")
    r = run_check(tmp_path, "fine-lib=finelib", "not-installed-lib=notinstalled")
    assert (r.returncode, r.stdout) == (0, "")


def test_a_broken_kernel_library_stops_the_test_session_in_one_line(tmp_path):
    """The session-start hook (tests/conftest.py), end to end: a FlashInfer that is installed but
    fails to import (shadowed here by a fake one first on the path) stops pytest with exit 4."""
    fake_distribution(tmp_path, "flashinfer-python", "flashinfer",
                      "raise AttributeError('drifted bindings')\n", version="0.0.1")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                        str(ROOT / "tests" / "test_install.py")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 4, r.stdout[-2000:]
    assert ("broken install: flashinfer-python 0.0.1 is installed but `import flashinfer` fails: "
            "AttributeError: drifted bindings") in r.stdout + r.stderr


def extra(name: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"][name]]


def test_the_kernel_extras_refuse_the_cuda_python_that_breaks_flashinfer():
    """cuda-python 12.x ships its own `cuda/bindings` and overwrites torch 2.14's cuda-bindings 13
    (`import flashinfer`: no `cudaLibrary_t`); 13.4.4 is what a fresh resolve picked and works."""
    for name in ("flashinfer", "vllm"):
        pins = [r for r in extra(name) if r.name == "cuda-python"]
        assert pins, f"extra {name!r} does not constrain cuda-python"
        spec = pins[0].specifier
        assert not spec.contains("12.6.2.post1") and spec.contains("13.4.4")
