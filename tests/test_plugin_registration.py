"""The vllm_metax entry points: when the platform plugin activates (MetaX device, force variable,
neither), what vLLM's `current_platform` resolves to in a fresh process, and a simulated MetaX host
(a pymxsml stand-in reporting "MetaX C500")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import vllm_metax
from vllm_metax.core import device as device_mod
from vllm_metax.core import tuned_config as tc

ROOT = Path(__file__).resolve().parents[1]
_detect_device = device_mod.detect_device       # the cached original (tests may patch the name)
PYMXSML_STAND_IN = textwrap.dedent('''
    """Stand-in for MetaX's management library on a host without a MetaX GPU."""
    def mxSmlInit():
        pass
    def mxSmlGetDeviceCount():
        return 1
    class _Info:
        deviceName = b"MetaX C500"
    def mxSmlGetDeviceInfo(index):
        return _Info()
''')


def _pymxsml_module():
    mod = types.ModuleType("pymxsml")
    exec(PYMXSML_STAND_IN, mod.__dict__)
    return mod


@pytest.fixture
def clean_device(monkeypatch):
    """No force variable, no pymxsml, a fresh device cache (and again afterwards)."""
    monkeypatch.delenv(device_mod.FORCE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "pymxsml", None)      # import pymxsml -> ImportError
    device_mod.detect_device.cache_clear()
    tc.clear_cache()
    yield monkeypatch
    _detect_device.cache_clear()
    tc.clear_cache()


@pytest.fixture
def metax_host(clean_device):
    clean_device.setitem(sys.modules, "pymxsml", _pymxsml_module())
    device_mod.detect_device.cache_clear()
    return clean_device


def test_entry_points_declared_and_importable():
    tomllib = pytest.importorskip("tomllib")             # Python 3.11+
    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["vllm.platform_plugins"] == {"metax": "vllm_metax:register"}
    assert eps["vllm.general_plugins"] == {"metax_attention": "vllm_metax:register_attention_backends",
                                           "metax_ops": "vllm_metax:register_custom_ops"}
    assert callable(vllm_metax.register) and callable(vllm_metax.register_attention_backends)
    assert callable(vllm_metax.register_custom_ops)


def test_import_is_cheap():
    code = ("import sys, vllm_metax, vllm_metax.core.tuned_config, vllm_metax.core.device\n"
            "heavy = [m for m in ('vllm', 'torch', 'flashinfer', 'optuna', 'typer', 'rich', "
            "'sqlite_utils') if m in sys.modules]\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    assert out.stdout.strip() == ""


def test_inactive_without_metax_device_or_force(clean_device):
    clean_device.setattr(device_mod, "_torch_props", lambda: (None, None))
    active, why = vllm_metax.should_activate()
    assert vllm_metax.register() is None and not active
    assert device_mod.FORCE_ENV in why


def test_inactive_on_an_nvidia_gpu(clean_device):
    clean_device.setattr(device_mod, "detect_device",
                         lambda: device_mod.DeviceInfo("NVIDIA H200", "torch", False, 132, (9, 0)))
    assert vllm_metax.register() is None
    assert "not a MetaX device" in vllm_metax.should_activate()[1]


def test_force_variable_activates(clean_device):
    clean_device.setenv(device_mod.FORCE_ENV, "1")
    assert vllm_metax.register() == "vllm_metax.platform.MetaxPlatform"
    clean_device.setenv(device_mod.FORCE_ENV, "0")
    assert vllm_metax.register() is None


def test_simulated_metax_host_activates_unforced_and_finds_its_config(metax_host, tmp_path):
    dev = device_mod.detect_device()
    assert (dev.name, dev.source, dev.is_metax) == ("MetaX C500", "pymxsml", True)
    assert vllm_metax.register() == "vllm_metax.platform.MetaxPlatform"
    assert "MetaX C500" in vllm_metax.should_activate()[1]
    from vllm_metax.ops.device_backends import device_flashinfer_backends
    fb = device_flashinfer_backends()
    assert (fb.allowed, fb.default) == (("fa2",), "fa2")      # MetaX's FlashInfer: fa3 is no choice

    entry = tc.ModelEntry(tc.ModelDims(16, 512, 64), 32, ["FLASHINFER_MLA"],
                          [tc.Bucket(8, 4096, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa2"})}, "flashinfer")])
    tc.write_tuned_config(tc.TunedConfig("MetaX C500", {}, [entry]), tmp_path)
    metax_host.setenv(tc.FOLDER_ENV, str(tmp_path))
    res = tc.resolve_tuned_config(dev.name)
    assert res.path == tmp_path / "device_name=MetaX_C500.json" and res.config is not None


def test_general_plugin_leaves_vllm_alone_when_inactive(clean_device):
    """register_attention_backends must not import vLLM's registry, let alone override it."""
    clean_device.setattr(device_mod, "detect_device",
                         lambda: device_mod.DeviceInfo("NVIDIA H200", "torch", False, 132, (9, 0)))
    calls = []
    fake = types.ModuleType("vllm_metax.platform")
    fake.register_backends = lambda: calls.append(1)
    clean_device.setitem(sys.modules, "vllm_metax.platform", fake)
    vllm_metax.register_attention_backends()
    assert calls == []
    clean_device.setenv(device_mod.FORCE_ENV, "1")
    vllm_metax.register_attention_backends()
    assert calls == [1]


# ---------------------------------------------------------------- vLLM's own resolution

_PROBE = textwrap.dedent('''
    import json
    import vllm.platforms as vp
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    p = vp.current_platform
    load_general_plugins()
    print("RESULT " + json.dumps({
        "platform": type(p).__module__ + "." + type(p).__qualname__,
        "device": p.get_device_name() if type(p).__name__ == "MetaxPlatform" else None,
        "cuda_alike": p.is_cuda_alike(),
        "flashinfer_mla": E.FLASHINFER_MLA.get_path(),
    }))
''')


def _resolve_in_fresh_process(env_update: dict, extra_path: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in (device_mod.FORCE_ENV, "VLLM_PLUGINS", "VLLM_TARGET_DEVICE")}
    env.update(env_update)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path) if extra_path else None,
                                                      str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])



@pytest.mark.vllm
@pytest.mark.slow
def test_current_platform_is_the_plugin_under_the_force_variable():
    got = _resolve_in_fresh_process({device_mod.FORCE_ENV: "1"})
    assert got["platform"] == "vllm_metax.platform.MetaxPlatform"
    assert got["cuda_alike"] is True
    from vllm_metax.platform import FLASHINFER_MLA_CLASS
    assert got["flashinfer_mla"] == FLASHINFER_MLA_CLASS


@pytest.mark.vllm
@pytest.mark.slow
def test_current_platform_is_not_the_plugin_otherwise(tmp_path):
    (tmp_path / "pymxsml.py").write_text("raise ImportError('no MetaX library here')\n")
    got = _resolve_in_fresh_process({}, tmp_path)
    if got["platform"] == "vllm_metax.platform.MetaxPlatform":
        pytest.fail("the plugin activated without a MetaX device or the force variable")
    # vLLM's own FLASHINFER_MLA stays in place when our platform is not the active one
    assert got["flashinfer_mla"] == "vllm.v1.attention.backends.mla.flashinfer_mla.FlashInferMLABackend"


@pytest.mark.vllm
@pytest.mark.slow
def test_current_platform_on_a_simulated_metax_host(tmp_path):
    (tmp_path / "pymxsml.py").write_text(PYMXSML_STAND_IN)
    got = _resolve_in_fresh_process({}, tmp_path)
    assert got["platform"] == "vllm_metax.platform.MetaxPlatform"
    assert got["device"] == "MetaX C500"
    from vllm_metax.platform import FLASHINFER_MLA_CLASS
    assert got["flashinfer_mla"] == FLASHINFER_MLA_CLASS
