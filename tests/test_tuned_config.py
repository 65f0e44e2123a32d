import json
import logging
import subprocess
import sys
import timeit

import pytest

from vllm_metax.core import tuned_config as tc
from vllm_metax.core.serving import entry_for


def _cfg(device="NVIDIA H200"):
    buckets = []
    for b in (1, 8, 64):
        for c in (1024, 8192):
            buckets.append(tc.Bucket(b, c, 1, {
                "flashinfer": tc.FamilyChoice({"backend": "fa3" if b > 1 else "fa2"}, 10.0 * b, 12.0 * b, b > 1),
                "triton": tc.FamilyChoice({"num_kv_splits": 4 * b}, 30.0 * b, 40.0 * b, True)}, "flashinfer"))
    entry = tc.ModelEntry(tc.ModelDims(16, 512, 64), 64, ["FLASHINFER_MLA", "TRITON_MLA"], buckets,
                          "deepseek-v3", 8, "lowest weighted time")
    return tc.TunedConfig(device, {"sm_count": 132, "runs": [1]}, [entry])


def test_filename():
    assert tc.config_filename("NVIDIA H200") == "device_name=NVIDIA_H200.json"
    assert tc.config_filename("MetaX C500") == "device_name=MetaX_C500.json"


def test_roundtrip_and_lookup(tmp_path):
    path = tc.write_tuned_config(_cfg(), tmp_path)
    assert path.name == "device_name=NVIDIA_H200.json"
    cfg = tc.read_tuned_config(path)
    e = entry_for(cfg, tc.ModelDims(16, 512, 64)).entry
    assert e.page_size == 64 and e.backend_order[0] == "FLASHINFER_MLA"
    hit = e.lookup(8, 8192)
    assert hit.exact and hit.in_range and hit.bucket.families["flashinfer"].params == {"backend": "fa3"}
    snap = e.lookup(6, 2000)          # on a log2 scale 6 is nearest 8, 2000 nearest 1024
    assert not snap.exact and snap.in_range and (snap.bucket.batch_size, snap.bucket.context_len) == (8, 1024)
    snap = e.lookup(6, 3000)          # log2 3000 = 11.55: 1.45 from 8192, 1.55 from 1024
    assert snap.bucket.context_len == 8192
    out = e.lookup(512, 65536)
    assert not out.in_range and out.bucket.batch_size == 64 and out.bucket.context_len == 8192
    assert entry_for(cfg, tc.ModelDims(128, 512, 64)).entry is None
    assert e.buckets[1].families["flashinfer"].gain == pytest.approx(1.2)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: "not json {", "not valid JSON"),
    (lambda d: {**d, "schema_version": 99}, "schema_version 99 is not supported"),
    (lambda d: {k: v for k, v in d.items() if k != "device_name"}, "missing field 'device_name'"),
    (lambda d: {**d, "models": [{**d["models"][0], "global": {"page_size": 0, "backend_order": ["TRITON_MLA"]}}]}, "page_size must be one of 1, 2, 4"),
    (lambda d: {**d, "models": [{**d["models"][0], "global": {"page_size": 16, "backend_order": ["NOPE"]}}]}, "backend_order"),
    (lambda d: [1, 2], "top level must be a JSON object"),
])
def test_malformed(tmp_path, mutate, message):
    d = _cfg().to_json()
    bad = mutate(d)
    p = tmp_path / "device_name=NVIDIA_H200.json"
    p.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(tc.TunedConfigError, match=message):
        tc.read_tuned_config(p)


def test_resolution_order_and_mismatch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    tc.clear_cache()
    assert tc.resolve_tuned_config("NVIDIA H200").config is None
    tc.write_tuned_config(_cfg(), tmp_path)
    r = tc.resolve_tuned_config("NVIDIA H200")
    assert r.config is not None and "VLLM_METAX_MLA_CONFIG_FOLDER" in r.reason
    # a file named for this device but written for another is ignored, or fatal when strict
    other = _cfg("MetaX C500").to_json()
    (tmp_path / "device_name=NVIDIA_H200.json").write_text(json.dumps(other))
    assert tc.resolve_tuned_config("NVIDIA H200").config is None
    monkeypatch.setenv(tc.STRICT_ENV, "1")
    with pytest.raises(tc.TunedConfigError, match="written for device"):
        tc.resolve_tuned_config("NVIDIA H200")
    monkeypatch.delenv(tc.STRICT_ENV)
    (tmp_path / "device_name=NVIDIA_H200.json").write_text("{broken")
    with caplog.at_level(logging.WARNING):
        assert tc.load_tuned_config("NVIDIA H200") is None
        assert tc.load_tuned_config("NVIDIA H200") is None      # cached: one warning only
    assert sum("vllm_metax MLA" in r.message for r in caplog.records) == 1
    tc.clear_cache()


def test_lookup_is_cheap():
    e = _cfg().models[0]
    n = 20000
    per_call = timeit.timeit(lambda: e.lookup(37, 5000), number=n) / n
    print(f"lookup: {per_call * 1e6:.2f} us")
    assert per_call < 50e-6   # generous bound for a loaded CI box; the benchmark reports the real cost


def test_reader_is_stdlib_only():
    code = ("import sys, vllm_metax.core.tuned_config; "
            "bad = [m for m in ('torch', 'optuna', 'typer', 'rich', 'sqlite_utils', 'vllm') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kv_chunk_is_read_back_and_a_bad_one_is_refused(tmp_path):
    cfg = _cfg()
    cfg.models[0].buckets[0].families["flashinfer"].params["kv_chunk"] = "x0.5"
    path = tc.write_tuned_config(cfg, tmp_path)
    back = tc.read_tuned_config(path).models[0].buckets[0].families["flashinfer"].params
    assert back == {"backend": "fa2", "kv_chunk": "x0.5"}
    d = json.loads(path.read_text())
    for bad in ("x3", 0.5, None, "X0.5"):
        d["models"][0]["buckets"][0]["families"]["flashinfer"]["params"]["kv_chunk"] = bad
        path.write_text(json.dumps(d))
        with pytest.raises(tc.TunedConfigError, match="params.kv_chunk must be one of x0.25, x0.5"):
            tc.read_tuned_config(path)
