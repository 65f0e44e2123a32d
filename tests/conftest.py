import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


HAS_CUDA = _has_cuda()
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_sessionstart(session):
    """Start the install check (tests/install_check.py) beside collection: a kernel library that
    is installed but does not import stops the session in one line, instead of failing or
    skipping its tests one by one."""
    session.config._install_check = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("install_check.py"))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish_install_check(config) -> None:
    proc = getattr(config, "_install_check", None)
    if proc is None:
        return
    config._install_check = None
    out, _ = proc.communicate()
    if proc.returncode:
        lines = out.strip().splitlines() or [f"tests/install_check.py exited with {proc.returncode}"]
        pytest.exit("\n".join(lines), returncode=4)


def pytest_collection_modifyitems(config, items):
    _finish_install_check(config)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_vllm = pytest.mark.skip(reason="needs vllm==0.33.0 installed")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "vllm" in item.keywords and not HAS_VLLM:
            item.add_marker(skip_vllm)


@pytest.fixture(autouse=True)
def _no_shipped_tuned_configs(tmp_path_factory, monkeypatch):
    """Tests never read the configs/ this repository ships (the H200 one among them): a test that
    wants a tuned config writes its own. Subprocesses get the same through the environment."""
    from vllm_metax.core import tuned_config as tc
    from vllm_metax.core.tuned_config import discovery
    empty = tmp_path_factory.mktemp("no-packaged-configs")
    monkeypatch.setattr(discovery, "PACKAGED_FOLDER", empty)    # where the plugin searches
    monkeypatch.setattr(tc, "PACKAGED_FOLDER", empty)           # what readers see (mla_tune.validate)
    monkeypatch.setenv(tc.PACKAGED_ENV, str(empty))
    tc.clear_cache()
    yield
    tc.clear_cache()


@pytest.fixture(autouse=True)
def _plugin_records_reach_caplog(monkeypatch):
    """The plugin logs under vLLM's `vllm` logger (vllm_metax.core.log). Some vLLM entry points a test
    calls apply vLLM's logging config, which turns that logger's propagation off for the rest of
    the process; caplog listens at the root, so every test starts with it on again."""
    import logging

    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
