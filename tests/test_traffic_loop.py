"""The CPU parts of issue 54's loop: bench/traffic_loop.py's judgement of two serve_bench runs
beside report --traffic's prediction, bench/tools/traffic_loop.sh's dry run, serve_bench's
--server-args, and bench/traffic_cost.py's measurement."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench_support import load_bench

ROOT = Path(__file__).resolve().parent.parent


def _run(tpots: list[float]) -> dict:
    reps = [{"p50_tpot_ms": t} for t in tpots]
    return {"runs": {"h16/tuned": {"runs": {"mid@inf": {"p50_tpot_ms": sorted(tpots)[len(tpots) // 2]}},
                                   "repeats": {"mid@inf": reps}}}}


def test_the_loop_judges_before_and_after_beside_the_prediction():
    loop = load_bench("traffic_loop")
    r = loop.compare(_run([10.0, 10.2, 10.1]), _run([9.0, 9.1, 9.05]),
                     {"tuned_us": 100.0, "far_share": 0.8}, {"tuned_us": 80.0, "far_share": 0.01},
                     attention_share=0.5)
    (c,) = r["cells"]
    assert c["before_p50"] == 10.1 and c["after_p50"] == 9.05 and c["verdict"] == "faster"
    assert r["predicted_attention_ratio"] == pytest.approx(0.8)
    assert r["predicted_tpot_ratio"] == pytest.approx(0.9)
    text = loop.render(r)
    assert "| mid@inf | 10.100 10.00-10.20 | 9.050 9.00-9.10 | 0.896 | faster |" in text
    assert "80.0% before, 1.0% after" in text
    same = loop.compare(_run([10.0, 10.2, 10.1]), _run([10.1, 9.9, 10.3]))
    assert same["cells"][0]["verdict"] == "within noise" and "predicted_attention_ratio" not in same


def test_the_loop_script_dry_runs_every_phase(tmp_path):
    env = dict(os.environ, DRY="1", OUT=str(tmp_path / "out"))
    p = subprocess.run(["bash", "bench/tools/traffic_loop.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    steps = [line[2:] for line in p.stderr.splitlines() if line.startswith("+ ")]
    assert any("serve_bench.py" in s and "--workloads mid --repeats 3" in s and "--speculative-config" in s
               for s in steps)
    assert any("mla_tune sweep" in s and "--traffic /tmp/loop/traffic.db --traffic-share 0.99" in s
               for s in steps)
    assert any("mla_tune emit" in s and "--traffic" in s for s in steps)
    assert any("--config-folder /tmp/loop/configs" in s for s in steps)
    assert steps[-1].startswith("python3 bench/traffic_loop.py")


@pytest.mark.vllm
def test_serve_bench_passes_server_args_to_every_server(tmp_path):
    sb = load_bench("serve_bench")
    args = type("A", (), {"server_args": "--speculative-config '{\"method\": \"ngram\"}'"})()
    assert sb.user_server_args(args) == ["--speculative-config", '{"method": "ngram"}']
    assert "mid" in sb.WORKLOADS and "mid" not in sb.DEFAULT_WORKLOADS


def test_traffic_cost_measures_under_a_microsecond_a_step():
    """The benchmark's own numbers, at a reduced size: the recorder's decode() well under 1 us."""
    tc = load_bench("traffic_cost")
    tc.STEPS, tc.REPEATS, tc.BATCHES = 2000, 3, (1, 64)
    rows = tc.measure()
    assert [r["batch"] for r in rows] == [1, 64]
    assert all(0 < r["decode_best"] < 5000 for r in rows)      # ns; 240-470 measured, loose for CI load
    assert "worst decode() median" in tc.render(rows)
