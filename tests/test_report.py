"""`mla-tune report` and mla_tune.views.report over a fixture DB whose every sample is known."""

import csv
import io
import json
import statistics

import pytest
from typer.testing import CliRunner

from mla_tune.families.base import Candidate
from mla_tune.cli import app
from mla_tune.problem.workload import model_preset, workload_for
from mla_tune.store.selection import SelectionError, TrialFilter
from mla_tune.views.report import build_report
from mla_tune.views.report_format import render_report
from mla_tune.store.results import ResultsStore
from mla_tune.store.stats import stats_of
from results_fixture import BATCHES, CONTEXTS, H200, METAX, MODEL, TP, build_fixture_db

runner = CliRunner(env={"COLUMNS": "220"})


@pytest.fixture()
def fx(tmp_path):
    return build_fixture_db(tmp_path / "results.db")


def _report(fx, **kw):
    with ResultsStore(fx.path) as s:
        return build_report(s, TrialFilter(**kw))


def _floor_us(row):
    # independent of mla_tune.problem.roofline: the DB's bytes/flops columns at the run's ceilings
    return max(row["bytes"] / (row["copy_gbps"] * 1e3), row["flops"] / (row["matmul_tflops"] * 1e6))


def test_numbers_equal_the_db(fx):
    rep = _report(fx)
    with ResultsStore(fx.path) as s:
        rows = {r["id"]: r for r in s.trials()}
        seen = 0
        for d, w, c in rep.lines():
            raw = s.samples(c.trial_id)
            assert raw == fx.samples[c.trial_id]          # the fixture's known numbers are stored
            row = rows[c.trial_id]
            if not raw:
                assert c.status == "invalid" and c.median_us is None and c.pct_roofline is None
                assert c.invalid_reason == row["invalid_reason"] and c.message == row["message"]
                continue
            st = stats_of(raw)
            assert c.median_us == statistics.median(raw) and c.n == len(raw)
            assert c.spread == st.spread and c.min_us == min(raw)
            if row["copy_gbps"]:
                assert c.pct_roofline == pytest.approx(100 * _floor_us(row) / c.median_us, rel=1e-12)
            else:
                assert c.pct_roofline is None                # CPU reference: no ceilings
            seen += 1
    assert seen == sum(1 for v in fx.samples.values() if v)


def test_speedup_over_family_default(fx):
    rep = _report(fx, device="NVIDIA H200")
    for _, w, c in rep.lines():
        if not c.ok:
            continue
        default = {"flashinfer": "flashinfer/auto/p64",
                   "triton": "triton/triton/p64/num_kv_splits=4,rule=vllm"}[c.family]
        dt = fx.trials[(("gpu2" if w.batch_size == 64 else "gpu"), w.batch_size, w.context_len, default)]
        assert c.default_candidate == default
        assert c.speedup_vs_default == pytest.approx(
            statistics.median(fx.samples[dt]) / statistics.median(fx.samples[c.trial_id]), rel=1e-12)


def test_winners_and_global_choice(fx):
    rep = _report(fx)
    assert [d.device_name for d in rep.devices] == [METAX, H200, "cpu"]   # GPUs first, reference last
    h200 = next(d for d in rep.devices if d.device_name == H200)
    for w in h200.workloads:
        winners = [c.candidate for c in w.lines if c.winner]
        assert winners == ["flashinfer/fa3/p64"]
        chosen = {c.family: c.candidate for c in w.lines if c.chosen}
        if w.batch_size != 64:
            assert chosen["triton"] == "triton/triton/p64/num_kv_splits=16"
        invalid = {c.candidate: c.invalid_reason for c in w.lines if not c.ok}
        assert invalid["flashinfer/cutlass/p64"] == "unsupported"
    (entry,) = h200.choice.models
    assert entry.page_size == 64 and entry.backend_order == ("FLASHINFER_MLA", "TRITON_MLA")
    # fa2 is 1.036x faster than auto on the MetaX: below min_ratio, so the default stays
    metax = next(d for d in rep.devices if d.device_name == METAX)
    (w,) = metax.workloads
    assert [c.candidate for c in w.lines if c.winner] == ["flashinfer/auto/p64"]
    assert "no significant difference" in metax.choice.models[0].buckets[0].families["flashinfer"].reason


def test_filters(fx):
    assert {d.device_name for d in _report(fx, device="NVIDIA_H200").devices} == {H200}
    assert {d.device_name for d in _report(fx, device="nvidia h200").devices} == {H200}
    assert {d.device_name for d in _report(fx, model="DeepSeek-V3").devices} == {H200, METAX, "cpu"}
    rep = _report(fx, runs=(fx.runs["gpu2"],))
    assert [(w.batch_size, w.context_len) for d in rep.devices for w in d.workloads] == [(64, 4096)]
    rep = _report(fx, device=H200, runs=(fx.runs["gpu"],))
    assert len(rep.devices[0].workloads) == len(BATCHES) * len(CONTEXTS)
    with pytest.raises(SelectionError, match="holds devices 'MetaX C500', 'NVIDIA H200', 'cpu'"):
        _report(fx, device="NVIDIA B200")
    with pytest.raises(SelectionError, match="models deepseek-v3"):
        _report(fx, model="kimi-k2")


def test_latest_trial_counts_and_older_ones_are_noted(fx):
    wl = workload_for(model_preset(MODEL), TP, 1, 1024)
    with ResultsStore(fx.path) as s:
        run = s.add_run({"kind": "gpu", "device_name": H200, "copy_gbps": 4000.0, "matmul_tflops": 800.0})
        wid = s.workload_id(wl, 1, 1)   # existing workload: its id comes back, bytes untouched
        tid = s.add_trial(run, wid, Candidate.parse("flashinfer/fa2/p64"), "ok",
                          {"kernel_us": [5.0, 5.1, 4.9]}, sweep="again", is_default=False)
        rep = build_report(s, TrialFilter(device=H200))
    (d,) = rep.devices
    assert d.superseded == 1
    (w,) = [w for w in d.workloads if (w.batch_size, w.context_len) == (1, 1024)]
    fa2 = [c for c in w.lines if c.candidate == "flashinfer/fa2/p64"]
    assert len(fa2) == 1 and fa2[0].trial_id == tid and fa2[0].median_us == 5.0
    assert "older trial(s)" in render_report(rep, "markdown", full=True)


def test_empty_db_says_so(tmp_path):
    ResultsStore(tmp_path / "e.db").close()
    with ResultsStore(tmp_path / "e.db") as s, pytest.raises(SelectionError, match="holds no trials yet"):
        build_report(s)


# ---------------------------------------------------------------- CLI, every format

def _cli(*args):
    return runner.invoke(app, ["report", *map(str, args)])


def test_cli_table(fx):
    res = _cli("--db", fx.path, "--full")
    assert res.exit_code == 0, res.output
    out = res.stdout
    for text in ("NVIDIA H200: runs", "candidates per workload", "best per bucket (page 64)",
                 "global choice", "FLASHINFER_MLA > TRITON_MLA", "unsupported: cutlass MLA needs SM100",
                 "wrong_result", "CPU torch reference", "winner"):
        assert text in out, text


def test_cli_json_numbers_equal_db(fx):
    res = _cli("--db", fx.path, "--format", "json", "--device", "NVIDIA H200")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    (dev,) = data["devices"]
    assert dev["device_name"] == H200 and [r["id"] for r in dev["runs"]] == [fx.runs["gpu"], fx.runs["gpu2"]]
    n = 0
    for w in dev["workloads"]:
        for c in w["candidates"]:
            raw = fx.samples[c["trial_id"]]
            assert c["median_us"] == (statistics.median(raw) if raw else None)
            n += 1
    assert n == sum(1 for k in fx.trials if k[0] in ("gpu", "gpu2"))
    (m,) = dev["models"]
    assert m["global"]["page_size"] == 64 and m["global"]["backend_order"] == ["FLASHINFER_MLA", "TRITON_MLA"]
    assert all(b["best_family"] == "flashinfer" for b in m["buckets"])
    assert data["rules"]["p_threshold"] == 0.002


def test_cli_csv(fx):
    res = _cli("--db", fx.path, "-f", "csv")
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert len(rows) == len(fx.trials)          # every trial is the latest of its candidate here
    for r in rows:
        raw = fx.samples[int(r["trial_id"])]
        assert (float(r["median_us"]) if r["median_us"] else None) == (statistics.median(raw) if raw else None)
    bad = [r for r in rows if r["status"] == "invalid"]
    assert {r["invalid_reason"] for r in bad} == {"unsupported", "wrong_result"}
    assert all(r["message"] for r in bad)
    assert {r["kind"] for r in rows} == {"gpu", "cpu-reference"}


def test_cli_markdown(fx):
    res = _cli("--db", fx.path, "--format", "markdown", "--model", "deepseek-v3", "--full")
    assert res.exit_code == 0, res.output
    md = res.stdout
    assert md.startswith("# mla-tune report")
    assert "## NVIDIA H200 · deepseek-v3 tp8 H16 (R512 P64 bfloat16): candidates per workload" in md
    assert "| B1 L1024 | flashinfer/fa3/p64 | 7.4 |" in md
    assert "## cpu [CPU torch reference" in md


@pytest.mark.parametrize("args, message", [
    (["--format", "xml"], "xml"),
    (["--device", "NVIDIA B200"], "no trials"),
    (["--run", "99"], "no trials"),
])
def test_cli_bad_input_exit_2(fx, args, message):
    res = _cli("--db", fx.path, *args)
    assert res.exit_code == 2
    assert message in res.output and "Traceback" not in res.output


def test_cli_missing_or_foreign_db_is_one_line_and_not_created(tmp_path):
    res = _cli("--db", tmp_path / "none.db")
    assert res.exit_code == 2 and not (tmp_path / "none.db").exists()
    assert res.stderr.strip().count("\n") == 0 and "no results DB" in res.stderr
    junk = tmp_path / "junk.db"
    junk.write_text("not a database")
    res = _cli("--db", junk)
    assert res.exit_code == 2 and "not a SQLite file" in res.stderr
    assert junk.read_text() == "not a database"


def test_the_summary_legend_names_the_families_the_table_shows():
    from mla_tune.views.report_format import _legend
    assert _legend({"flashinfer", "split"}) == \
        "fi = FlashInfer, sp = split-KV Triton decode (served by FLASHINFER_MLA)"
    assert _legend({"reference"}) == "ref = torch reference"
    assert _legend({None}).startswith("fi = FlashInfer, tr = Triton MLA, fm = FlashMLA")


def test_missing_default_db_points_at_the_shipped_results_db(fx, tmp_path, monkeypatch):
    import shutil
    monkeypatch.setattr("mla_tune.tune.sweep.buckets.detect_device", lambda: "cpu")
    work = tmp_path / "checkout"
    work.mkdir()
    shutil.copy(fx.path, work / "results.db")
    monkeypatch.chdir(work)
    res = runner.invoke(app, ["report"])
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0
    assert "no results DB at results-cpu.db" in res.stderr and "--db results.db" in res.stderr
    assert sorted(p.name for p in work.iterdir()) == ["results.db"]
    assert runner.invoke(app, ["report", "--db", "results.db"]).exit_code == 0


@pytest.mark.parametrize("full", [False, True])
def test_cpu_reference_timings_are_no_verdict(fx, full):
    from mla_tune.views.report import CPU_CAVEAT
    rep = _report(fx, device="cpu")
    text = render_report(rep, "markdown", full=full)
    assert CPU_CAVEAT in text
    assert "verdict" not in text.replace(CPU_CAVEAT, "").replace("not a verdict", "")
    assert ("global choice: none" in text) if full else ("CPU reference time per bucket" in text)
    gpu = render_report(_report(fx, device=H200), "markdown")
    assert CPU_CAVEAT not in gpu and ": verdict" in gpu


def test_one_time_format_everywhere():
    """Microseconds read the same in every view and reason: no `1.979e+04` beside `8727`, no
    `6,020` in the sweep against `6020.0` in the report."""
    from mla_tune.problem.units import us, us_text
    assert [us(v) for v in (8.44, 99.96, 591.6, 6020.0, 19786.4, None, float("nan"))] == \
        ["8.4", "100", "592", "6020", "19786", "-", "-"]
    assert us_text(19786.4) == "19786 us"
