"""The "triton" kernel family (vLLM's Triton MLA decode): space, default rule, availability, and
correctness against the torch reference under the Triton interpreter on the CPU.

The interpreter must be chosen before triton decorates vLLM's kernels, and vllm only keeps real
Triton on a GPU-less host when CUDA_VISIBLE_DEVICES is empty; both are fixed at import time, so
the kernel checks run in one child process. Triton 3.8's interpreter miscomputes bfloat16 dots,
so they use float16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mla_tune.families import Candidate, CandidateInvalid, get_family
from mla_tune.families import triton_mla as fam
from mla_tune.measure.trial import MeasureSettings, measure
from mla_tune.problem.workload import Workload, model_preset, workload_for

V3 = model_preset("deepseek-v3")


def _w(heads=16, batch=2, ctx=40, **kw) -> Workload:
    return Workload(heads, 512, 64, 192 ** -0.5, batch, ctx, **kw)


def test_registered_as_the_triton_family():
    assert isinstance(get_family("triton"), fam.TritonMLAFamily)
    assert get_family("triton").family == "triton"


def test_candidate_key_round_trips_with_the_rule_marker():
    c = Candidate("triton", "triton", 64, {"num_kv_splits": 8, "rule": "vllm"})
    assert c.key == "triton/triton/p64/num_kv_splits=8,rule=vllm"
    assert Candidate.parse(c.key) == c
    assert Candidate.parse(c.key).params == {"num_kv_splits": 8, "rule": "vllm"}


def test_split_choices_run_from_one_to_one_tile_per_split():
    assert fam.split_choices(workload_for(V3, 8, 1, 1024), None) == [1, 2, 4, 8, 16, 32]
    assert fam.split_choices(workload_for(V3, 8, 1, 32768), None) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert fam.split_choices(_w(ctx=40), None) == [1, 2]
    assert fam.split_choices(_w(ctx=1), None) == [1]


def test_split_choices_stop_at_64_ctas_per_sm():
    # 128 requests x 8 head tiles = 1024 CTAs per split; 64 x 132 SMs allows 8 splits
    assert fam.split_choices(workload_for(V3, 1, 128, 32768), 132) == [1, 2, 4, 8]
    assert fam.split_choices(workload_for(V3, 8, 1, 32768), 132)[-1] == 256


def test_ragged_workloads_split_by_their_longest_request():
    w = _w(batch=8, ctx=64, ragged="lognormal", seed=3)
    top = fam.split_choices(w, None)[-1]
    assert top * fam.KERNEL_BLOCK_N >= max(w.seq_lens) > top * fam.KERNEL_BLOCK_N // 2


def test_page_sizes_off_the_multiple_of_16_are_refused(monkeypatch):
    b = fam.TritonMLAFamily()
    with pytest.raises(CandidateInvalid) as e:
        b.prepare(_w(), Candidate("triton", "triton", 1, {"num_kv_splits": 1}), problem=None)
    assert e.value.reason == "unsupported" and "a multiple of 16" in e.value.message
    monkeypatch.setattr(fam, "_sm_count", lambda: None)
    monkeypatch.setattr(fam, "vllm_num_kv_splits", lambda n, sm=None: 1)
    assert {c.page_size for c in b.space(_w(), [1, 8, 16, 64])} == {16, 64}


def test_measure_stores_a_refused_page_size_as_invalid():
    r = measure(fam.TritonMLAFamily(), _w(), Candidate("triton", "triton", 8, {"num_kv_splits": 1}),
                MeasureSettings())
    assert r.status == "invalid" and r.invalid_reason == "unsupported"


def test_default_is_vllms_rule_and_lies_in_the_space(monkeypatch):
    monkeypatch.setattr(fam, "_sm_count", lambda: 132)
    monkeypatch.setattr(fam, "vllm_num_kv_splits", lambda n, sm=None: 4)
    b = fam.TritonMLAFamily()
    w = _w(ctx=2048)
    d = b.default_candidate(w, 64)
    assert d.params == {"num_kv_splits": 4, "rule": "vllm"}
    space = b.space(w, [64])
    assert d in space
    assert [c.params.get("rule") for c in space].count("vllm") == 1


def test_unavailable_with_the_reason_when_vllm_cannot_be_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.ops.triton_decode_attention", None)
    fam._kernel.cache_clear()
    try:
        a = fam.TritonMLAFamily().available("cuda")
        assert not a.ok and "vllm" in a.reason
        with pytest.raises(CandidateInvalid) as e:
            fam.TritonMLAFamily().prepare(_w(), Candidate("triton", "triton", 16, {"num_kv_splits": 1}),
                                           problem=None)
        assert e.value.reason == "unsupported"
    finally:
        fam._kernel.cache_clear()


def test_unavailable_when_triton_cannot_be_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    fam._kernel.cache_clear()
    try:
        a = fam.TritonMLAFamily().available("cuda")
        assert not a.ok and "triton" in a.reason
    finally:
        fam._kernel.cache_clear()


@pytest.mark.vllm
def test_cpu_without_the_interpreter_is_unavailable(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a = fam.TritonMLAFamily().available("cpu")
    assert not a.ok and ("TRITON_INTERPRET" in a.reason)


_CHILD = textwrap.dedent("""
    import json
    from mla_tune.families import Candidate, get_family
    from mla_tune.families import triton_mla as fam
    from mla_tune.measure.trial import MeasureSettings, check_correctness, measure
    from mla_tune.problem.workload import Workload

    b = get_family("triton")
    out = {"available": [b.available("cpu").ok, b.available("cpu").reason], "cases": []}
    def wl(h, bs, ctx, **kw):
        return Workload(h, 512, 64, 192 ** -0.5, bs, ctx, q_dtype="float16", kv_dtype="float16", **kw)
    cases = [  # (workload, page, num_kv_splits or None for vLLM's rule)
        (wl(16, 2, 40), 16, None),
        (wl(16, 2, 40), 16, 2),
        (wl(16, 3, 100, ragged="uniform-random", seed=1), 16, 4),
        (wl(16, 3, 60, ragged="lognormal", seed=2), 32, 2),
        (wl(32, 2, 70, q_len=2), 64, 2),       # causal rows, 2 head tiles
        (wl(16, 1, 5), 16, 8),                 # splits longer than the sequence: empty splits
    ]
    for w, page, n in cases:
        c = b.default_candidate(w, page) if n is None else Candidate("triton", "triton", page, {"num_kv_splits": n})
        err = check_correctness(b, w, c, MeasureSettings(), seed=7)
        out["cases"].append([w.label(), c.key, err])
    out["rule"] = {str(L): fam.vllm_num_kv_splits(L, None) for L in (1, 511, 1024, 1500, 4096, 32768)}
    out["rule_capped"] = fam.vllm_num_kv_splits(32768, 8)
    t = measure(b, wl(16, 1, 20), Candidate("triton", "triton", 16, {"num_kv_splits": 1}),
                MeasureSettings(warmup=0, samples=2))
    out["measure"] = [t.status, len(t.samples.get("kernel_us", [])), t.compile_s]
    bf = measure(b, Workload(16, 512, 64, 0.07, 1, 20), b.default_candidate(wl(16, 1, 20), 16),
                 MeasureSettings(samples=1))
    out["bf16"] = [bf.status, bf.invalid_reason, bf.message]
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.vllm
def test_kernel_matches_the_reference_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["available"][0], out["available"]
    assert len(out["cases"]) == 6
    for label, key, err in out["cases"]:
        assert err < 5e-3, (label, key, err)
    assert out["cases"][0][1] == "triton/triton/p16/num_kv_splits=1,rule=vllm"
    # vLLM 0.33's rule: next_power_of_2(max_seq_len // 512), capped at 2 x SMs
    assert out["rule"] == {"1": 1, "511": 1, "1024": 2, "1500": 2, "4096": 8, "32768": 64}
    assert out["rule_capped"] == 16
    status, n_samples, compile_s = out["measure"]
    assert status == "ok" and n_samples == 2 and compile_s > 0
    assert out["bf16"][:2] == ["invalid", "unsupported"] and "bfloat16" in out["bf16"][2]


_RULE_CHILD = textwrap.dedent("""
    import json, sys
    from mla_tune.families import triton_mla as fam
    fam._kernel()
    read = fam.rule_from_source()
    heavy = "vllm.config" in sys.modules
    imported = fam.imported_rule()
    grid = [(L, sm) for L in (1, 511, 512, 1023, 1024, 1500, 4096, 8191, 32768, 1 << 20)
            for sm in (1, 8, 78, 132, 1 << 30)]
    print("RESULT " + json.dumps({"read": read is not None, "heavy_before_import": heavy,
        "same": all(read(L, sm) == imported(L, sm) for L, sm in grid),
        "rule_is_read": fam._vllm_rule() is not imported}))
""")


@pytest.mark.vllm
def test_vllms_split_rule_read_from_its_source_equals_the_imported_one():
    """The planner reads vLLM's num_kv_splits rule from the installed source instead of importing
    the backend module (vllm.config and the MLA layers); both give the same splits."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _RULE_CHILD], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out == {"read": True, "heavy_before_import": False, "same": True, "rule_is_read": True}


@pytest.mark.vllm
def test_a_rule_source_in_another_shape_is_imported_instead(monkeypatch, tmp_path):
    """A rule that reads something the source-reader does not know makes it answer None."""
    import types
    pkg = tmp_path / "attention"
    (pkg / "backends" / "mla").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    src = pkg / "backends" / "mla" / "triton_mla.py"
    fake_attention = types.SimpleNamespace(__file__=str(pkg / "__init__.py"))
    fake_triton = types.SimpleNamespace(triton=types.SimpleNamespace(next_power_of_2=lambda n: n))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention", fake_attention)
    monkeypatch.setitem(sys.modules, "vllm.triton_utils", fake_triton)
    import vllm.v1
    monkeypatch.setattr(vllm.v1, "attention", fake_attention, raising=False)
    src.write_text("K = 4\ndef _compute_num_kv_splits(n, sm):\n    return min(n // K, sm)\n")
    assert fam.rule_from_source()(64, 100) == 16
    src.write_text("import os\ndef _compute_num_kv_splits(n, sm):\n    return int(os.environ['X'])\n")
    assert fam.rule_from_source() is None
    src.write_text("def other(n, sm):\n    return 1\n")
    assert fam.rule_from_source() is None


_VENDOR_CHILD = textwrap.dedent("""
    import json
    from mla_tune.families import Candidate, get_family
    from mla_tune.measure.trial import MeasureSettings, check_correctness
    from mla_tune.problem.workload import Workload
    from vllm_metax.ops import triton_launch

    launches = []
    stage1 = triton_launch._stage1

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append({k: kw[k] for k in ("BLOCK_N", "BLOCK_DMODEL", "BLOCK_DPE", "BLOCK_H",
                                                    "num_stages", "num_warps", "NUM_KV_SPLITS")})
                launches[-1]["grid"] = list(grid)
                return stage1[grid](*args, **kw)
            return launch

    triton_launch._stage1 = Recording()
    b = get_family("triton", "metax")
    def wl(h, bs, ctx, **kw):
        return Workload(h, 512, 64, 192 ** -0.5, bs, ctx, q_dtype="float16", kv_dtype="float16", **kw)
    cases = [(wl(16, 2, 40), 16, None), (wl(16, 3, 100, ragged="uniform-random", seed=1), 16, 4),
             (wl(32, 2, 70, q_len=2), 64, 2)]
    out = {"cases": []}
    for w, page, n in cases:
        c = (b.default_candidate(w, page) if n is None else
             Candidate("triton", "triton", page, {"num_kv_splits": n, "variant": "metax"}))
        err = check_correctness(b, w, c, MeasureSettings(), seed=7)
        out["cases"].append([w.label(), c.key, err])
    out["launches"] = launches
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.vllm
def test_the_vendor_launch_runs_vllms_kernels_with_block_16_one_stage_under_the_interpreter():
    """The "metax" variant: vLLM's own stage-1 and merge kernels launched with the vendor's
    settings (vllm_metax.ops.triton_launch), correct against the torch reference."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env.pop("VLLM_METAX_PROFILE", None)
    proc = subprocess.run([sys.executable, "-c", _VENDOR_CHILD], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["cases"][0][1].endswith(",rule=vllm,variant=metax")       # the profile's default
    for label, key, err in out["cases"]:
        assert "variant=metax" in key and err < 5e-3, (label, key, err)
    assert len(out["launches"]) >= 3
    for launch in out["launches"]:
        assert (launch["BLOCK_N"], launch["num_stages"], launch["num_warps"]) == (16, 1, 4)
        assert (launch["BLOCK_DMODEL"], launch["BLOCK_DPE"], launch["BLOCK_H"]) == (512, 64, 16)
    assert [ln["grid"][2] for ln in out["launches"]][-2:] == [2, 2]      # num_kv_splits programs
