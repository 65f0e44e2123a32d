"""What `vllm serve` shows of the plugin, and the engine core's process: the plugin's lines reach
vLLM's own log output (vLLM's handler and format, configured as `vllm serve` configures it), in a
fresh process as a server starts one; the platform and the tuned config resolve in a process
spawned the way vLLM starts its engine core. Real vllm==0.33.0, no GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import plugin_support as ps
from vllm_metax.core import tuned_config as tc
from vllm_metax.core.device import FORCE_ENV

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
DIMS = tc.ModelDims(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM, "bfloat16", "bfloat16")

# As `vllm serve` does before anything else (configure_logging_from_args), then what a server does
# at start-up: the engine config (platform.check_and_update_config: tuned config, block size), the
# attention backend choice, the metadata builder (decode kernels) and the MLA prefill backend.
SERVER_START = textwrap.dedent("""
    import sys, torch
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    configure_logging(LoggingConfig())
    import plugin_support as ps
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import AttentionSelectorConfig
    from vllm_metax.platform import MetaxPlatform
    import vllm_metax.backend.flashinfer_mla as fb
    import vllm_metax.platform as P
    from vllm.platforms.interface import DeviceCapability
    # a pretend Hopper with FlashInfer (as tests/test_plugin_selection.py): the CPU has neither
    fb.flashinfer_available = lambda: (True, "stand-in: FlashInfer MLA needs a GPU to plan")
    P._device_capability = lambda device_id: DeviceCapability(9, 0)
    vc = ps.make_vllm_config(sys.argv[1], block_size=int(sys.argv[2]) or None)
    with set_current_vllm_config(vc):
        sel = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                      block_size=vc.cache_config.block_size, use_mla=True)
        path = MetaxPlatform.get_attn_backend_cls(None, sel, num_heads=ps.NUM_HEADS)
    print("BACKEND", path, "BLOCK", vc.cache_config.block_size, flush=True)
    ps.make_builder(vc)
""")


def _config(folder: Path, device: str, page_size: int = 64, dims=DIMS) -> None:
    split = {"split": tc.FamilyChoice({"backend": "triton", "num_splits": 16, "partial": "bfloat16"}, time_us=10.0),
             "flashinfer": tc.FamilyChoice({"backend": "fa2"}, time_us=20.0)}
    buckets = [tc.Bucket(1, 4096, 1, dict(split), "split"),
               tc.Bucket(64, 4096, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa2"})}, "flashinfer")]
    entry = tc.ModelEntry(dims, page_size, ["FLASHINFER_MLA", "TRITON_MLA"], buckets,
                          model="deepseek-v2-lite", tp_size=1)
    tc.write_tuned_config(tc.TunedConfig(device, {"test": True}, [entry]), folder)


def _server_log(tmp_path: Path, folder: Path, block_size: int = 0) -> tuple[str, int]:
    env = dict(os.environ, **{FORCE_ENV: "1", tc.FOLDER_ENV: str(folder),
                              "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])})
    env.pop("VLLM_LOGGING_LEVEL", None)
    p = subprocess.run([sys.executable, "-c", SERVER_START, str(tmp_path / "model"), str(block_size)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    return p.stdout + p.stderr, p.returncode


def _vllm_lines(log: str, pattern: str) -> list[str]:
    """Lines in vLLM's format ("(...) INFO|WARNING <date> [file:line] <message>") that match."""
    fmt = re.compile(r"(INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[[\w./]+\.py:\d+\] (.*)$")
    out = []
    for ln in log.splitlines():
        m = fmt.search(ln)
        if m and re.search(pattern, m.group(2)):
            out.append(m.group(2))
    return out


def _device_name() -> str:
    from vllm_metax.core.device import detect_device
    return detect_device().name


def test_the_server_log_says_what_the_plugin_did(tmp_path):
    folder = tmp_path / "configs"
    _config(folder, _device_name(), page_size=64)
    log, rc = _server_log(tmp_path, folder)
    assert rc == 0, log[-3000:]
    cfg = folder / tc.config_filename(_device_name())
    assert len(_vllm_lines(log, rf"vllm_metax MLA: tuned config {re.escape(str(cfg))} \(found in \$"
                                rf"{tc.FOLDER_ENV}\)")) == 1, log[-3000:]
    entry = _vllm_lines(log, r"vllm_metax MLA: tuned entry 16 heads, kv_lora_rank 512, rope 64")
    assert len(entry) == 1 and "deepseek-v2-lite TP1" in entry[0] and "KV page size 64" in entry[0]
    assert len(_vllm_lines(log, r"KV cache block size 64 from the tuned config")) == 1, log[-3000:]
    assert _vllm_lines(log, r"Using FLASHINFER_MLA attention backend \(tuned config"), log[-3000:]
    kernels = _vllm_lines(log, r"FLASHINFER_MLA decode kernels: ")
    assert len(kernels) == 1 and "split-KV Triton in 1" in kernels[0] and "FlashInfer fa2 in 1" in kernels[0]
    assert "BACKEND vllm_metax.backend.flashinfer_mla.FlashInferMLABackend BLOCK 64" in log


def test_no_config_says_why_and_runs_untuned(tmp_path):
    log, rc = _server_log(tmp_path, tmp_path / "empty")
    assert rc == 0, log[-3000:]
    why = _vllm_lines(log, r"vllm_metax MLA: no tuned config for")
    assert len(why) == 1 and str(tmp_path / "empty") in why[0]
    assert _vllm_lines(log, r"decode kernels: FlashInfer \w+ every step \(untuned\)")
    assert "BLOCK 16" in log                                   # vLLM's own default


@pytest.mark.parametrize("case", ["other_device", "other_model", "block_size", "unreadable"])
def test_bad_config_on_this_path_is_one_log_line_and_an_untuned_server(tmp_path, case):
    """A config for another device or model, a --block-size that conflicts with it, a file that
    cannot be read: one line in vLLM's log, and the server starts untuned."""
    folder = tmp_path / "configs"
    name = _device_name()
    block = 0
    if case == "other_device":
        _config(folder, "NVIDIA H200")
        (folder / tc.config_filename("NVIDIA H200")).rename(folder / tc.config_filename(name))
        pattern = r"written for device 'NVIDIA H200'"
    elif case == "other_model":
        _config(folder, name, dims=tc.ModelDims(128, 512, 64, "bfloat16", "bfloat16"))
        pattern = r"has no entry for this model \(16 heads.*it has 128 heads"
    elif case == "block_size":
        _config(folder, name, page_size=64)
        block, pattern = 32, r"--block-size 32 differs from the page size 64 .* serving untuned"
    else:
        folder.mkdir()
        (folder / tc.config_filename(name)).write_bytes(b"\xff\xfe not json")
        pattern = r"ignored \(using defaults\)"
    log, rc = _server_log(tmp_path, folder, block)
    assert rc == 0, log[-3000:]
    said = _vllm_lines(log, pattern)
    assert len(said) == 1, log[-3000:]
    assert _vllm_lines(log, r"decode kernels: FlashInfer \w+ every step \(untuned\)"), log[-3000:]
    assert not _vllm_lines(log, r"tuned entry ")


def test_platform_and_tuned_config_resolve_in_a_spawned_engine_core_process(tmp_path, monkeypatch):
    """vLLM starts its engine core with its multiprocessing context (spawn here) and hands it the
    VllmConfig: there the plugin must be the platform again and the folder variable honoured."""
    from vllm.utils.system_utils import get_mp_context

    folder = tmp_path / "configs"
    _config(folder, _device_name(), page_size=32)
    monkeypatch.setenv(FORCE_ENV, "1")
    monkeypatch.setenv(tc.FOLDER_ENV, str(folder))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    tc.clear_cache()
    vc = ps.make_vllm_config(tmp_path / "model")
    assert vc.cache_config.block_size == 32
    ctx = get_mp_context()
    assert ctx.get_start_method() == "spawn"
    q = ctx.Queue()
    p = ctx.Process(target=ps.engine_core_probe, args=(vc, q))
    p.start()
    p.join(timeout=240)
    assert p.exitcode == 0
    got = q.get(timeout=5)
    assert got["platform"] == "vllm_metax.platform.MetaxPlatform", got
    assert got["config"] == str(folder / tc.config_filename(_device_name())), got
    assert got["page_size"] == 32 and got["block_size"] == 32, got
    tc.clear_cache()
