"""`mla-tune report --traffic` and `doctor --traffic` on a small synthetic tuned config: the
expected per-step attention time tuned against untuned, the share of steps outside or far from
the tuned buckets, the warning, the density plot."""

from __future__ import annotations

import json

import pytest

import traffic_support
from cli_support import run_main
from mla_tune.store.traffic import load_traffic
from mla_tune.views import doctor
from mla_tune.views.traffic_view import traffic_report
from vllm_metax.core import tuned_config as tc

DEVICE = "NVIDIA H200"
DIMS = tc.ModelDims(16, 512, 64, "bfloat16", "bfloat16")


def _bucket(b, c, time_us, default_us, q=1):
    return tc.Bucket(b, c, q, {"flashinfer": tc.FamilyChoice({"backend": "fa3"}, time_us, default_us)},
                     "flashinfer")


def write_config(folder, buckets=None, page=64, prefill=()):
    buckets = buckets or [_bucket(1, 1024, 10.0, 12.0), _bucket(32, 4096, 100.0, 150.0)]
    entry = tc.ModelEntry(DIMS, page, ["FLASHINFER_MLA", "TRITON_MLA"], buckets, "deepseek-v3", 8,
                          prefill=list(prefill))
    return tc.write_tuned_config(tc.TunedConfig(DEVICE, {"test": True}, [entry]), folder)


def write_traffic(path, decode: dict, device=DEVICE, prefill=None):
    return traffic_support.write_traffic(path, DIMS, decode, prefill, device)


TRAFFIC = {(1, 1000, 1): 900, (30, 4500, 1): 100, (256, 65536, 1): 50, (1, 1024, 2): 50}


def test_expected_time_and_coverage(tmp_path):
    cfg = tc.read_tuned_config(write_config(tmp_path))
    part = load_traffic(write_traffic(tmp_path / "t.db", TRAFFIC)).select()
    rep = traffic_report(part, cfg.models[0], str(cfg.path))
    # B1 (and its q_len 2 steps, snapped to q_len 1) at 10 us tuned / 12 untuned; B30 and B256
    # snap to B32 L4K at 100 / 150 us
    assert rep.steps == 1100 and rep.timed == 1100
    assert rep.tuned_us == pytest.approx((950 * 10 + 150 * 100) / 1100)
    assert rep.untuned_us == pytest.approx((950 * 12 + 150 * 150) / 1100)
    assert rep.speedup == pytest.approx(33900 / 24500)
    # outside: B256 L64K (beyond the tuned range) and the q_len-2 steps (no such bucket)
    assert rep.outside == 100 and rep.far == 100
    assert [(b.batch_size, b.context_len, b.steps, b.far_steps, b.kernel) for b in rep.buckets] == [
        (1, 1024, 950, 50, "flashinfer fa3"), (32, 4096, 150, 50, "flashinfer fa3")]
    assert rep.warning() is None and rep.warning(0.05) is not None


def test_far_but_inside_counts(tmp_path):
    """A step inside the tuned range but more than one grid step from every bucket is far."""
    cfg = tc.read_tuned_config(write_config(tmp_path, [
        _bucket(b, c, 10.0, 12.0) for b in (1, 64) for c in (1024, 32768)]))
    part = load_traffic(write_traffic(tmp_path / "t.db", {(8, 4096, 1): 30, (1, 1024, 1): 70})).select()
    rep = traffic_report(part, cfg.models[0])
    assert rep.outside == 0 and rep.far == 30
    assert "30.0% of the recorded steps" in rep.warning()


def test_a_side_kernel_bucket_is_timed_by_what_serves_it(tmp_path):
    b = tc.Bucket(1, 1024, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa3"}, 20.0, 22.0),
                               "split": tc.FamilyChoice({"backend": "triton", "num_splits": 32,
                                                  "partial": "bfloat16"}, 12.0, 12.0)}, "split")
    cfg = tc.read_tuned_config(write_config(tmp_path, [b]))
    part = load_traffic(write_traffic(tmp_path / "t.db", {(1, 1024, 1): 10})).select()
    rep = traffic_report(part, cfg.models[0])
    assert rep.buckets[0].kernel == "split" and rep.tuned_us == 12.0 and rep.untuned_us == 22.0


def test_report_cli_json_finds_the_devices_config(tmp_path, monkeypatch):
    write_config(tmp_path / "configs")
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path / "configs"))
    tc.clear_cache()
    t = write_traffic(tmp_path / "t.db", TRAFFIC)
    r = run_main(["report", "--traffic", t, "--format", "json", "--plot", tmp_path / "p.png"],
                 cwd=tmp_path)
    assert r.code == 0, r.output
    data = json.loads(r.stdout)
    assert data["steps"] == 1100 and data["outside_share"] == pytest.approx(100 / 1100)
    assert data["speedup"] == pytest.approx(33900 / 24500)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    r = run_main(["report", "--traffic", t], cwd=tmp_path)
    assert r.code == 0 and "Tuned buckets by recorded steps" in r.output


@pytest.mark.parametrize("args, message", [
    (["--full"], "drop --full"),
    (["--config", "missing.json"], "missing.json"),
])
def test_report_traffic_refusals(tmp_path, args, message):
    t = write_traffic(tmp_path / "t.db", TRAFFIC)
    r = run_main(["report", "--traffic", t, *args], cwd=tmp_path)
    assert r.code == 2 and message in r.output and r.exception is None, r.output


def test_report_traffic_without_a_config_says_so(tmp_path):
    t = write_traffic(tmp_path / "t.db", TRAFFIC, device="Some GPU")
    r = run_main(["report", "--traffic", t], cwd=tmp_path)
    assert r.code == 2 and "no tuned config to compare for 'Some GPU'" in r.output
    r = run_main(["report", "--config", "x.json"], cwd=tmp_path)
    assert r.code == 2 and "--config applies only with --traffic" in r.output


def test_doctor_warns_when_the_traffic_is_far_from_the_buckets(tmp_path, monkeypatch):
    write_config(tmp_path / "configs")
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path / "configs"))
    tc.clear_cache()
    near = write_traffic(tmp_path / "near.db", {(1, 1000, 1): 95, (64, 8192, 1): 5})
    far = write_traffic(tmp_path / "far.db", {(1, 1000, 1): 60, (256, 262144, 1): 40})
    ok = doctor.traffic_check(near, DEVICE)
    assert ok.status == doctor.OK and "5.0% of the steps" in ok.detail
    warn = doctor.traffic_check(far, DEVICE)
    assert warn.status == doctor.WARN and "40.0% of the recorded steps are outside" in warn.detail
    assert "mla-tune sweep --traffic" in warn.detail
    r = run_main(["doctor", "--traffic", far, "--format", "json"], cwd=tmp_path)
    assert r.code == 0, r.output
    checks = {c["what"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["traffic"]["status"] == "warn"


def test_prefill_plans_are_timed_by_their_prefill_bucket(tmp_path):
    pre = [tc.PrefillBucket(True, 2048, 512, {"backend": "fa3"}, 50.0, 60.0),
           tc.PrefillBucket(False, 256, 16384, {"backend": "fa2"}, 40.0, 80.0)]
    cfg = tc.read_tuned_config(write_config(tmp_path, prefill=pre))
    part = load_traffic(write_traffic(tmp_path / "t.db", {(1, 1024, 1): 1},
                                      prefill={(True, 2048, 512): 6, (False, 256, 16384): 2,
                                               (True, 65536, 65536): 2})).select()
    p = traffic_report(part, cfg.models[0]).prefill
    # the 64K plan snaps to (2048, 512): timed by it, and far
    assert p.plans == 10 and p.far == 2 and p.timed == 10
    assert p.tuned_us == pytest.approx((8 * 50 + 2 * 40) / 10)
    assert p.untuned_us == pytest.approx((8 * 60 + 2 * 80) / 10)
    assert traffic_report(part, tc.read_tuned_config(write_config(tmp_path / "np"))
                          .models[0]).prefill.far == 10          # no prefill section: all far
