"""`mla-tune show FILE`: validate a tuned config as the plugin reads it, print it; malformed files
give one error line and exit 2."""

import csv
import io
import json

import pytest
from typer.testing import CliRunner

from mla_tune.cli import app
from mla_tune.tune.emit import emit_config
from mla_tune.store.results import ResultsStore
from results_fixture import H200, build_fixture_db
from vllm_metax.core import device as vdevice
from vllm_metax.core import tuned_config as tc

runner = CliRunner(env={"COLUMNS": "200"})


@pytest.fixture()
def cfg_path(tmp_path):
    fx = build_fixture_db(tmp_path / "results.db")
    with ResultsStore(fx.path) as s:
        return emit_config(s, tmp_path / "configs", device=H200)


@pytest.fixture(autouse=True)
def no_gpu_here(monkeypatch):
    monkeypatch.setattr(vdevice, "detect_device", lambda: vdevice.DeviceInfo("cpu", "none", False))


def _show(*args):
    return runner.invoke(app, ["show", *map(str, args)])


def test_show_table(cfg_path):
    res = _show(cfg_path)
    assert res.exit_code == 0, res.output
    for text in ("NVIDIA H200 (schema 1): provenance", "global choice per model",
                 "FLASHINFER_MLA > TRITON_MLA", "per-bucket plan choices", "num_kv_splits=16",
                 "0.7.2.post1"):
        assert text in res.stdout, text


def test_show_json_csv_markdown(cfg_path):
    want = tc.read_tuned_config(cfg_path).to_json()
    res = _show(cfg_path, "--format", "json")
    assert res.exit_code == 0 and json.loads(res.stdout) == want
    res = _show(cfg_path, "-f", "csv")
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert len(rows) == sum(len(b["families"]) for b in want["models"][0]["buckets"])
    fa = [r for r in rows if r["family"] == "flashinfer" and r["batch_size"] == "8" and r["context_len"] == "4096"]
    assert json.loads(fa[0]["params"]) == {"backend": "fa3"}
    res = _show(cfg_path, "-f", "markdown")
    assert res.stdout.startswith("# tuned config") and "| 8 | 4096 | 1 | flashinfer | fa3 |" in res.stdout


def test_show_lookup_says_when_outside_the_tuned_range(cfg_path):
    res = _show(cfg_path, "--lookup", "6,2000", "-f", "json")
    (hit,) = json.loads(res.stdout)["lookup"]
    assert hit["bucket"] == [8, 1024, 1] and not hit["exact"] and hit["in_range"]
    res = _show(cfg_path, "--lookup", "512,131072", "-f", "json")
    (hit,) = json.loads(res.stdout)["lookup"]
    assert hit["bucket"] == [64, 4096, 1] and not hit["in_range"]
    res = _show(cfg_path, "--lookup", "8")
    assert res.exit_code == 2 and "BATCH,CONTEXT" in res.stderr


def _write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize("mutate, message", [
    (lambda d: "{not json", "not valid JSON"),
    (lambda d: {**d, "schema_version": 7}, "schema_version 7 is not supported"),
    (lambda d: {k: v for k, v in d.items() if k != "models"}, "missing field 'models'"),
    (lambda d: {**d, "models": [{k: v for k, v in d["models"][0].items() if k != "global"}]},
     "missing field 'global'"),
    (lambda d: {**d, "models": [{**d["models"][0], "buckets": [{"batch_size": 1}]}]},
     "missing field 'families'"),
    (lambda d: {**d, "device_name": "MetaX C500"}, "file name says 'NVIDIA_H200'"),
])
def test_malformed_configs_one_line_exit_2(cfg_path, mutate, message):
    bad = _write(cfg_path, mutate(json.loads(cfg_path.read_text())))
    res = _show(bad)
    assert res.exit_code == 2, res.output
    assert message in res.stderr and res.stderr.strip().count("\n") == 0
    assert "Traceback" not in res.output and res.stdout == ""


def test_another_device(cfg_path, monkeypatch):
    res = _show(cfg_path, "--device", "MetaX C500")
    assert res.exit_code == 2
    assert "written for device 'NVIDIA H200', not 'MetaX C500' (--device)" in res.stderr
    assert _show(cfg_path, "--device", "NVIDIA_H200").exit_code == 0
    # on a machine with an accelerator, the detected device is the default expectation
    monkeypatch.setattr(vdevice, "detect_device",
                        lambda: vdevice.DeviceInfo("MetaX C500", "pymxsml", True, 104, None))
    res = _show(cfg_path)
    assert res.exit_code == 2 and "(this machine)" in res.stderr
    monkeypatch.setattr(vdevice, "detect_device",
                        lambda: vdevice.DeviceInfo(H200, "torch", False, 132, (9, 0)))
    assert _show(cfg_path).exit_code == 0


def test_missing_file(tmp_path):
    res = _show(tmp_path / "nope.json")
    assert res.exit_code == 2 and "cannot read" in res.stderr


# ---------------------------------------------------------------- --lookup: what is served

def _with_split(cfg_path, split_us, fi_us=20.0):
    """The fixture's config with the split kernel as best family at batch 1, context 1024."""
    data = json.loads(cfg_path.read_text())
    for b in data["models"][0]["buckets"]:
        if (b["batch_size"], b["context_len"]) == (1, 1024):
            b["families"]["flashinfer"].update(time_us=fi_us)
            b["families"]["split"] = {"params": {"backend": "triton", "num_splits": 16,
                                                 "partial": "bfloat16"},
                                      "time_us": split_us, "default_time_us": split_us,
                                      "significant": False}
            b["best_family"] = "split"
    cfg_path.write_text(json.dumps(data))
    return cfg_path


def test_lookup_answers_first_and_alone(cfg_path):
    res = _show(cfg_path, "--lookup", "8,4096")
    assert res.exit_code == 0, res.output
    first = res.stdout.splitlines()[0]
    assert first == "NVIDIA H200: served for batch 8, context 4096, q_len 1"
    assert "FLASHINFER_MLA: flashinfer fa3" in res.stdout
    # not the whole config before the answer
    assert "provenance" not in res.stdout and "per-bucket plan choices" not in res.stdout


def test_lookup_names_the_split_kernel_where_the_plugin_serves_it(cfg_path):
    _with_split(cfg_path, split_us=10.0)            # 2x faster than FlashInfer's choice
    res = _show(cfg_path, "--lookup", "1,1000", "-f", "json")
    (hit,) = json.loads(res.stdout)["lookup"]
    assert hit["best_family"] == "split" and hit["bucket"] == [1, 1024, 1]
    assert hit["served"]["attention_backend"] == "FLASHINFER_MLA"
    assert hit["served"]["family"] == "split" and hit["served"]["params"]["num_splits"] == 16
    assert set(hit["choices"]) == {"flashinfer", "triton", "split"}
    assert hit["choices"]["flashinfer"]["params"]["backend"] == "fa3"
    table = _show(cfg_path, "--lookup", "1,1000").stdout
    assert "FLASHINFER_MLA: split num_splits=16, partial=bfloat16" in " ".join(table.split())


def test_lookup_keeps_flashinfer_when_split_wins_by_less_than_the_plugins_margin(cfg_path):
    from vllm_metax.core.decisions import SPLIT_MIN_GAIN
    _with_split(cfg_path, split_us=20.0 / (SPLIT_MIN_GAIN * 0.99))
    (hit,) = json.loads(_show(cfg_path, "--lookup", "1,1024", "-f", "json").stdout)["lookup"]
    assert hit["best_family"] == "split" and hit["served"]["family"] == "flashinfer"
    assert "less than" in hit["served"]["note"]


def _with_flashmla(cfg_path, fm_us, fi_us=20.0, page=None):
    """The fixture's config with FlashMLA as best family at batch 8, context 4096 (and the
    entry's page size set to `page`)."""
    data = json.loads(cfg_path.read_text())
    if page is not None:
        data["models"][0]["global"]["page_size"] = page
    for b in data["models"][0]["buckets"]:
        if (b["batch_size"], b["context_len"]) == (8, 4096):
            b["families"]["flashinfer"].update(time_us=fi_us)
            b["families"]["flashmla"] = {"params": {"backend": "flashmla"}, "time_us": fm_us,
                                         "default_time_us": fm_us, "significant": False}
            b["best_family"] = "flashmla"
    cfg_path.write_text(json.dumps(data))
    return cfg_path


def test_lookup_names_flashmla_where_flashinfer_mla_serves_it_per_bucket(cfg_path):
    _with_flashmla(cfg_path, fm_us=10.0)            # 2x faster than FlashInfer's choice
    (hit,) = json.loads(_show(cfg_path, "--lookup", "8,4096", "-f", "json").stdout)["lookup"]
    assert hit["served"]["attention_backend"] == "FLASHINFER_MLA"
    assert hit["served"]["family"] == "flashmla" and hit["served"]["params"] == {"backend": "flashmla"}
    table = _show(cfg_path, "--lookup", "8,4096").stdout
    assert "FLASHINFER_MLA: flashmla" in " ".join(table.split())


@pytest.mark.parametrize("fm_us, page", [(20.0 / 1.04, None), (10.0, 16)])
def test_lookup_keeps_flashinfer_where_flashmla_wins_by_too_little_or_the_page_is_not_64(cfg_path, fm_us, page):
    _with_flashmla(cfg_path, fm_us=fm_us, page=page)
    (hit,) = json.loads(_show(cfg_path, "--lookup", "8,4096", "-f", "json").stdout)["lookup"]
    assert hit["best_family"] == "flashmla" and hit["served"]["family"] == "flashinfer"


def _triton_first(cfg_path):
    data = json.loads(cfg_path.read_text())
    data["models"][0]["global"]["backend_order"] = ["TRITON_MLA", "FLASHINFER_MLA"]
    cfg_path.write_text(json.dumps(data))
    return cfg_path


@pytest.mark.parametrize("context, splits", [(4096, 16), (8192, 16), (3000, 16), (8193, None), (16384, None)])
def test_lookup_applies_tritons_context_window_as_the_server_does(cfg_path, context, splits):
    """TRITON_MLA serves a bucket tuned at context c for [c/2, 2c] only, then vLLM's rule
    (`decisions.triton_choice`, what backend/triton_mla.py runs): show says the same."""
    _triton_first(cfg_path)
    (hit,) = json.loads(_show(cfg_path, "--lookup", f"8,{context}", "-f", "json").stdout)["lookup"]
    assert hit["bucket"] == [8, 4096, 1]
    served = hit["served"]
    assert served["attention_backend"] == "TRITON_MLA" and served["family"] == "triton"
    assert served["params"].get("num_kv_splits") == splits
    if splits is None:
        assert "vLLM's num_kv_splits rule" in served["note"] and "more than 2x" in served["note"]


def test_show_prints_no_python_dict(cfg_path):
    res = runner.invoke(app, ["show", str(cfg_path)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "{'" not in res.stdout and "['" not in res.stdout
    assert "p_threshold 0.002" in " ".join(res.stdout.split())


def test_lookup_takes_sizes_as_the_size_flags_write_them(cfg_path):
    """`--lookup 32,6k` as `--contexts 4K`: one parser for sizes."""
    got = [json.loads(_show(cfg_path, "--lookup", lk, "-f", "json").stdout)["request"]
           for lk in ("32,6k", "32,6K", "32,6144")]
    assert got == [[32, 6144, 1]] * 3
    for bad in ("32,6x", "32,٦٤", "32,6k,1,1"):
        res = _show(cfg_path, "--lookup", bad)
        assert res.exit_code == 2 and "--lookup takes" in res.stderr, res.output
