"""`mla-tune prebuild`: which FlashInfer JIT modules each shipped config serves (exact names, from
the functions the server chooses with and FlashInfer's own names), the dry run, and its errors.
A real compile is slow and needs nvcc; the GPU check that the server loads nothing else is
tests/test_gpu_prebuild.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cli_support import one_line, run_main
from mla_tune.measure import served_prebuild as sp

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "vllm_metax" / "configs"
H100 = CONFIGS / "device_name=NVIDIA_H100_80GB_HBM3.json"
H200 = CONFIGS / "device_name=NVIDIA_H200.json"
HOPPER = sp.Target((9, 0), "9.0a", "--arch 9.0a")

DECODE_FA3 = ("batch_mla_attention_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_ckv_512_"
              "head_dim_kpe_64_profiler_False_planabi2_sm90")
DECODE_FA2 = DECODE_FA3.removesuffix("_sm90")
PREFILL = ("batch_prefill_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32_head_dim_qk_192_"
           "head_dim_vo_128_posenc_0_use_swa_False_use_logits_cap_False_f16qk_False")
PREFILL_FA3 = PREFILL + "_sm90"
PREFILL_FA2 = PREFILL + "_kv_stride_equal"     # the equal-stride module FlashInfer's fa2 ragged run loads


def _names(path, target=HOPPER, model=None, tp=1):
    from vllm_metax.core import tuned_config as tc
    cfg = tc.read_tuned_config(path)
    return [m.name for m in sp.served_modules(sp.select_entries(cfg, model, tp), target)]


@pytest.mark.parametrize("path", [H100, H200], ids=["h100", "h200"])
def test_each_shipped_config_serves_exactly_these_modules_on_hopper(path):
    # decode: every bucket's FlashInfer value is fa3; prefill: fa3 (the default and most buckets)
    # and fa2 (the 16-head entry's short causal bucket); vLLM's FA3 buckets need no module
    assert _names(path) == [DECODE_FA3, PREFILL_FA3, PREFILL_FA2]


def test_one_entry_per_model():
    # 128 heads (deepseek-v3 at TP 1): its prefill buckets name fa3 and vllm_fa3 only
    assert _names(H100, model="deepseek-v3", tp=1) == [DECODE_FA3, PREFILL_FA3]
    assert _names(H100, model="deepseek-v3", tp=8) == [DECODE_FA3, PREFILL_FA2, PREFILL_FA3]
    with pytest.raises(sp.PrebuildError, match="no entry for this model"):
        _names(H100, model="deepseek-v3", tp=2)


def test_a_device_without_fa3_builds_the_fa2_default_instead():
    # an A100 running the H100 file: fa3 is no plan-time choice there, so every bucket plans fa2
    assert _names(H100, sp.Target((8, 0), "8.0", "--arch 8.0")) == [DECODE_FA2, PREFILL_FA2]


def test_the_names_are_the_ones_flashinfers_loaders_build(monkeypatch, tmp_path, jit_cache):
    """FlashInfer's own loaders (what its wrappers call at plan time) ask for the module of our
    name: fa2's ragged prefill loads the equal-stride module, fa3 the public one, decode its URI."""
    from flashinfer import prefill
    from flashinfer.jit import core, env
    from flashinfer.mla._batch_mla._backends import _fa_common
    monkeypatch.setattr(env, "FLASHINFER_GEN_SRC_DIR", tmp_path)     # generated sources only
    asked = []

    class Asked(Exception):
        pass

    def build_and_load(spec):
        asked.append(spec.name)
        raise Asked

    monkeypatch.setattr(core.JitSpecNvcc, "build_and_load", build_and_load)
    from vllm_metax.core import tuned_config as tc
    modules = sp.served_modules(tc.read_tuned_config(H200).models, HOPPER)
    for m in modules:
        loader = (_fa_common.get_batch_mla_module if m.kind == "decode"
                  else prefill.get_batch_prefill_module).__wrapped__
        asked.clear()
        with pytest.raises(Asked):
            loader(m.backend, *m._args())
        assert asked == [m.name]


def test_no_fa_module_where_the_config_names_only_compiled_kernels(tmp_path):
    """A decode value FlashInfer ships compiled (or a prefill served by vLLM's FA3 only) adds no
    JIT module; an entry without buckets plans the device default."""
    from vllm_metax.backend.served_modules import decode_modules, prefill_modules
    from vllm_metax.core import decisions, tuned_config as tc
    entry = tc.read_tuned_config(H100).models[0]
    hopper = decisions.flashinfer_backends(False, (9, 0))
    empty = tc.ModelEntry(entry.dims, entry.page_size, entry.backend_order, [])
    assert [m.backend for m in decode_modules(empty, hopper)] == ["fa3"]
    assert [m.backend for m in prefill_modules(empty, decisions.prefill_backends(False, (9, 0), True))] == ["fa3"]


# ---------------------------------------------------------------- the command

@pytest.fixture
def jit_cache(monkeypatch, tmp_path):
    """FlashInfer's JIT cache in a temporary folder, for the Hopper target."""
    monkeypatch.setenv(sp.ARCH_ENV, "9.0a")
    from flashinfer.jit import env
    monkeypatch.setattr(env, "FLASHINFER_WORKSPACE_DIR", env._get_workspace_dir_name())
    monkeypatch.setattr(env, "FLASHINFER_JIT_DIR", tmp_path / "cached_ops")
    return tmp_path / "cached_ops"


def test_dry_run_lists_every_module_and_whether_it_is_built(jit_cache):
    lib = jit_cache / PREFILL_FA2 / f"{PREFILL_FA2}.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    r = run_main(["prebuild", "--dry-run", "--arch", "9.0a", "--config", H100])
    assert r.code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == f"target: sm 9.0 (--arch 9.0a); config: {H100}"
    assert lines[1] == f"FlashInfer JIT cache: {jit_cache}"
    assert lines[2:] == [
        f"missing  MLA decode ckv 512 kpe 64, fa3, bfloat16/bfloat16: {DECODE_FA3}",
        f"missing  ragged prefill qk 192 vo 128, fa3, bfloat16/bfloat16: {PREFILL_FA3}",
        f"built    ragged prefill qk 192 vo 128, fa2, bfloat16/bfloat16: {PREFILL_FA2}",
        "3 modules: 1 built, 2 to build"]
    assert not any(jit_cache.glob("*/build.ninja"))           # a dry run writes nothing


def test_without_nvcc_one_line_and_exit_2(jit_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    r = run_main(["prebuild", "--arch", "9.0a", "--config", H100])
    assert r.code == 2 and one_line(r.stderr), r.output
    assert "no nvcc at" in r.stderr and "CUDA_HOME" in r.stderr
    assert not any(jit_cache.glob("*/build.ninja"))


@pytest.mark.parametrize("content, words", [
    ("{not json", "json"),
    ('{"schema_version": 1, "device_name": "NVIDIA H100 80GB HBM3", "models": []}', "provenance"),
])
def test_a_bad_config_file_is_one_line_and_exit_2(jit_cache, tmp_path, content, words):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = run_main(["prebuild", "--dry-run", "--arch", "9.0a", "--config", bad])
    assert r.code == 2 and one_line(r.stderr) and r.exception is None, r.output
    assert words in r.stderr.lower()


@pytest.mark.parametrize("args, words", [
    (["--arch", "sm90", "--config", H100], "--arch must be MAJOR.MINOR"),
    (["--arch", "9.0a", "--config", "/nonexistent.json"], "no such file"),
    (["--arch", "9.0a", "--config", H100, "--model", "no-such-model"], "unknown model"),
    (["--arch", "9.0a", "--config", H100, "--jobs", "0"], "--jobs"),
])
def test_bad_input_is_one_line_and_exit_2(jit_cache, args, words):
    r = run_main(["prebuild", "--dry-run", *args])
    assert r.code == 2 and one_line(r.stderr) and r.exception is None, r.output
    assert words in r.stderr


def test_a_flashinfer_that_names_modules_otherwise_is_one_line(jit_cache, monkeypatch):
    """MetaX's 0.2.x FlashInfer line has other generator signatures: one line, exit 2, no traceback."""
    from flashinfer.jit.attention import modules

    def old_uri(dtype_q, dtype_kv, dtype_o, dtype_idx, head_dim_ckv, head_dim_kpe):
        return "batch_mla_attention"
    monkeypatch.setattr(modules, "get_batch_mla_uri", old_uri)
    r = run_main(["prebuild", "--dry-run", "--arch", "9.0a", "--config", H100])
    assert r.code == 2 and one_line(r.stderr) and r.exception is None, r.output
    assert "does not name its decode modules as 0.7 does" in r.stderr


def test_no_gpu_and_no_arch_says_what_to_give(monkeypatch):
    from vllm_metax.core.device import DeviceInfo
    monkeypatch.delenv(sp.ARCH_ENV, raising=False)
    with pytest.raises(sp.PrebuildError, match="give --arch"):
        sp.resolve_target(None, DeviceInfo("cpu", "none", False))
    with pytest.raises(sp.PrebuildError, match="give --config"):
        sp.load_config(None, DeviceInfo("cpu", "none", False))
    # FlashInfer's own variable is the target where set (the server reads it too)
    monkeypatch.setenv(sp.ARCH_ENV, "9.0a 10.0a")
    assert sp.resolve_target(None).capability == (9, 0)


def test_a_failed_build_is_one_line_per_module():
    from mla_tune.measure.jit_prebuild import build_error
    ninja = RuntimeError("Ninja build failed. Ninja output:\n[1/4] nvcc ... -o x.cuda.o\nFAILED: [code=1] x.so\n"
                         "/usr/bin/ld: cannot find -lcuda: No such file or directory\n"
                         "collect2: error: ld returned 1 exit status\nninja: build stopped: subcommand failed.")
    assert build_error(ninja) == "/usr/bin/ld: cannot find -lcuda: No such file or directory"
    assert build_error(OSError("ninja: not found")) == "OSError: ninja: not found"


def test_build_modules_builds_each_and_reports_failures_without_stopping(monkeypatch):
    """Every module at once, the jobs shared out by source files; a failure is that module's line."""
    from mla_tune.measure import jit_prebuild

    class Module:
        def __init__(self, name, sources, fail=False):
            self.name, self.sources, self.fail = name, sources, fail

        def spec(self):
            return self

    built = {}

    def run_build(spec, slots):
        built[spec.name] = slots
        if spec.fail:
            raise RuntimeError("nvcc fatal: Unsupported gpu architecture 'compute_90a'")

    monkeypatch.setattr(jit_prebuild, "_run_build", run_build)
    seen = []
    mods = [Module("decode", ["a"] * 3), Module("fa2", ["b"] * 10, fail=True), Module("fa3", ["c"] * 10)]
    out = jit_prebuild.build_modules(mods, jobs=16, done=lambda m, s, e: seen.append(m.name))
    assert [(m.name, e) for m, _, e in out] == [
        ("decode", None), ("fa2", "nvcc fatal: Unsupported gpu architecture 'compute_90a'"), ("fa3", None)]
    assert sorted(seen) == ["decode", "fa2", "fa3"]
    assert built == {"decode": 2, "fa2": 7, "fa3": 7}          # 16 jobs over 23 sources
    jit_prebuild.build_modules(mods, jobs=2)
    assert built == {"decode": 1, "fa2": 1, "fa3": 1}          # never fewer than one


def test_a_module_builds_as_flashinfers_own_build_does(monkeypatch, tmp_path):
    """Under the module's lock, its ninja file written, ninja run in its folder with the job count."""
    from flashinfer.jit import cpp_ext
    from mla_tune.measure import jit_prebuild
    ran = []
    monkeypatch.setattr(cpp_ext, "run_ninja", lambda d, f, verbose, max_jobs=None: ran.append((d, f, max_jobs)))

    class Spec:
        lock_path, build_dir, ninja_path = tmp_path / "m.lock", tmp_path / "m", tmp_path / "m" / "build.ninja"

        def write_ninja(self):
            assert (tmp_path / "m.lock").exists()              # inside the lock
            ran.append("ninja file")

    jit_prebuild._run_build(Spec(), 5)
    assert ran == ["ninja file", (tmp_path / "m", tmp_path / "m" / "build.ninja", 5)]


def _toolkit_links() -> bool:
    """nvcc and ninja, and a libcuda.so for FlashInfer's `-lcuda` (the toolkit's stub or a
    driver's): a toolkit without it compiles but cannot link (this project's CPU machine)."""
    import os
    if shutil.which("nvcc") is None or shutil.which("ninja") is None:
        return False
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or \
        str(Path(shutil.which("nvcc")).resolve().parent.parent)
    return any(Path(d, "libcuda.so").exists() for d in (f"{home}/lib64/stubs", f"{home}/lib64",
                                                         "/usr/lib/x86_64-linux-gnu", "/usr/lib64"))


@pytest.mark.slow
@pytest.mark.skipif(not _toolkit_links(), reason="needs nvcc, ninja and libcuda.so (or its stub)")
def test_a_real_build_is_found_up_to_date_by_the_servers_next_build(tmp_path):
    """Compile one decode module for sm_90a into a fresh cache in a child process (FlashInfer fixes
    its cache folder at import), then build it again as a server's first plan would: no work."""
    import subprocess
    import sys
    code = ("import time\n"
            "from mla_tune.measure.jit_prebuild import build_modules\n"
            "from vllm_metax.ops.flashinfer_jit import decode_module\n"
            "m = decode_module('fa2', 'bfloat16', 'bfloat16', 512, 64)\n"
            "[(_, s, err)] = build_modules([m], 2)\n"
            "assert err is None, err\n"
            "assert m.built()\n"
            "t = time.monotonic(); m.spec().build(need_lock=True); again = time.monotonic() - t\n"
            "assert again < 5, again\n"
            "print('ok', round(s), round(again, 2))\n")
    env = {**__import__("os").environ, "FLASHINFER_WORKSPACE_BASE": str(tmp_path),
           sp.ARCH_ENV: "9.0a", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr[-3000:]
