"""The sweep on the CPU: buckets, end to end through the CLI, resume, budgets, faults, flags."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_support import run_main
from typer.testing import CliRunner

import sweep_families
from mla_tune.cli import app
from mla_tune.problem.workload import ProblemError, model_preset
from mla_tune.store.results import ResultsStore
from mla_tune.tune.sweep.buckets import (default_space, journal_path_for, parse_duration, parse_sizes,
                                   plan_buckets)
from mla_tune.tune.sweep.run import run_sweep
from mla_tune.tune.sweep.config import SweepConfig
from mla_tune.tune.sweep.request import SweepRequest
from mla_tune.tune.sweep.plan import CPU_REFERENCE_NOTE

TESTS = Path(__file__).resolve().parent
V3 = model_preset("deepseek-v3")
runner = CliRunner()


@pytest.fixture(autouse=True)
def families():
    sweep_families.register()


def one_line(text: str) -> bool:
    return len([line for line in text.strip().splitlines() if line.strip()]) == 1


def trial_keys(db) -> list:
    with ResultsStore(db, create=False) as s:
        return [(r["workload_id"], r["candidate"]) for r in s.trials()]


# ---------------------------------------------------------------- planning

def test_sizes_and_durations():
    assert parse_sizes("1-128") == [1, 2, 4, 8, 16, 32, 64, 128]
    assert parse_sizes("1K-32K") == [1024, 2048, 4096, 8192, 16384, 32768]
    assert parse_sizes("16, 4k,1") == [1, 16, 4096]
    for bad in ("abc", "8-2", "0", "1-x", ""):
        with pytest.raises(ValueError):
            parse_sizes(bad)
    assert parse_duration("9m") == 540 and parse_duration("1h30m") == 5400
    assert parse_duration("90") == 90 and parse_duration("0") == 0
    with pytest.raises(ValueError):
        parse_duration("5x")


def test_buckets_from_model_and_tp():
    b = plan_buckets(V3, [1, 8], [1, 4], [1024], q_lens=[1, 2])
    assert len(b) == 8
    assert {x.workload.num_heads for x in b} == {128, 16}
    assert {(x.tp_size, x.workload.num_heads) for x in b} == {(1, 128), (8, 16)}
    assert {x.workload.q_len for x in b} == {1, 2}
    assert b[0].label.startswith("deepseek-v3 TP1 H128")
    with pytest.raises(ProblemError, match="does not divide"):
        plan_buckets(V3, [3], [1], [1024])


def test_default_spaces():
    gpu, cpu = default_space("cuda"), default_space("cpu")
    # the H200 run: DeepSeek-V3 TP1 + TP8, batch 1-128 x context 1K-32K, under a 9-minute budget
    assert gpu.tp_sizes == (1, 8) and len(gpu.batch_sizes) * len(gpu.context_lens) == 48
    assert gpu.time_budget_s <= 540 and gpu.samples >= 10
    assert len(cpu.tp_sizes) * len(cpu.batch_sizes) * len(cpu.context_lens) <= 4
    assert journal_path_for("x/results.db") == Path("x/results.optuna.log")


# ---------------------------------------------------------------- end to end on the CPU

@pytest.fixture(scope="module")
def cpu_sweep(tmp_path_factory):
    """One default `mla-tune sweep` on the CPU (reference family, worker process)."""
    d = tmp_path_factory.mktemp("cpu")
    db = d / "results.db"
    res = runner.invoke(app, ["sweep", "--db", str(db)])
    return d, db, res


def test_cpu_sweep_end_to_end(cpu_sweep):
    d, db, res = cpu_sweep
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert " ".join(CPU_REFERENCE_NOTE.split()[:12]) in out      # says what it measures, and why
    assert "torch.cuda.is_available() is False" in out
    assert "12 trials measured" in out
    # its timings are shown as what they are, and no page size or backend order is drawn from them
    assert "not a verdict" in out and "page size" not in out.lower() and "backend order" not in out
    with ResultsStore(db, create=False) as s:
        rows = s.trials()
        assert len(rows) == 12 and {r["run_kind"] for r in rows} == {"cpu-reference"}
        assert all(r["status"] == "ok" and len(r["samples"]["kernel_us"]) == 10 for r in rows)
        assert all(r["is_default"] == 1 for r in rows)      # each reference page is its own default
        assert len(s.runs()) == 1
    # the optuna study, one per bucket, where optuna-dashboard can open it
    import optuna
    from mla_tune.tune.study_storage import journal_storage
    storage = journal_storage(journal_path_for(db))
    names = optuna.get_all_study_names(storage=storage)
    studies = [optuna.load_study(study_name=n, storage=storage) for n in names]
    assert len(studies) == 4 and all(len(s.trials) == 3 for s in studies)
    assert all(s.user_attrs["mode"] == "grid" for s in studies)
    assert all(s.trials[0].user_attrs["candidate"].startswith("reference/torch/") for s in studies)
    # the CPU is not a serving device: no tuned config unless asked for, and the output says so
    assert "no tuned config written: the CPU reference is not a serving device" in out
    assert not list(Path.cwd().glob("configs/device_name=cpu.json"))


def test_cpu_sweep_emits_only_when_asked(cpu_sweep, tmp_path):
    d, db, _ = cpu_sweep
    res = runner.invoke(app, ["sweep", "--db", str(db), "--emit", "--configs-dir",
                              str(tmp_path / "configs"), "-q"])
    assert res.exit_code == 0, res.output
    assert "0 trials measured, 12 answered" in " ".join(res.output.split())
    (cfg,) = (tmp_path / "configs").glob("*.json")
    assert json.loads(cfg.read_text())["device_name"] == "cpu"
    res = run_main(["sweep", "--db", str(db), "--emit", "-q"])      # no folder named: refused
    assert res.code == 2 and "--configs-dir" in res.stderr


def test_rerun_measures_nothing_twice(cpu_sweep):
    d, db, _ = cpu_sweep
    before = trial_keys(db)
    res = runner.invoke(app, ["sweep", "--db", str(db), "--no-emit", "-q"])
    assert res.exit_code == 0, res.output
    assert "0 trials measured, 12 answered" in " ".join(res.output.split())
    assert trial_keys(db) == before


def test_replay_over_the_cpu_db_reaches_the_same_winners(cpu_sweep):
    from mla_tune.tune.choose import choose_from_store
    from mla_tune.tune.sweep.replay import replay_sweep
    d, db, _ = cpu_sweep
    with ResultsStore(db, create=False) as s:
        direct = choose_from_store(s)
    replay = replay_sweep(db, SweepConfig(buckets=[], mode="grid", emit=False))
    assert replay.measured == 12 and len(replay.buckets) == 4

    def winners(ch):
        return [(m.page_size, [(b.batch_size, b.context_len, {f: v.chosen.key for f, v in b.families.items()})
                               for b in m.buckets]) for m in ch.models]

    assert winners(replay.choice) == winners(direct)
    # through the CLI, with TPE forced: it still finds everything in a 3-point space; writes nothing
    before = trial_keys(db)
    res = runner.invoke(app, ["sweep", "--replay", str(db), "--mode", "tpe", "-q"])
    assert res.exit_code == 0, res.output
    assert "nothing is measured" in res.output and "replayed 12 stored trials" in res.output
    assert trial_keys(db) == before


def test_resume_after_a_partial_sweep(tmp_path):
    db = tmp_path / "r.db"
    small = dict(db=db, device="cpu", isolation="inline", emit=False, batches="1",
                 contexts="64", page_size=[1, 16, 64], samples=3, warmup=1)
    first = run_sweep(SweepRequest(**small).config())
    assert (first.measured, first.cached) == (3, 0)
    second = run_sweep(SweepRequest(**{**small, "batches": "1,2"}).config())
    assert (second.measured, second.cached) == (3, 3)          # only the new bucket is measured
    keys = trial_keys(db)
    assert len(keys) == len(set(keys)) == 6
    third = run_sweep(SweepRequest(**{**small, "remeasure": True}).config())
    assert third.measured == 3 and len(trial_keys(db)) == 9      # asked for: measured again
    with ResultsStore(db, create=False) as s:
        assert len(s.runs()) == 3


def descendants(pid: int) -> list[int]:
    """Child processes of pid, recursively (from /proc: Linux)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                parent[int(d.name)] = int(fields[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        cur = todo.pop()
        kids = [c for c, pp in parent.items() if pp == cur]
        out += kids
        todo += kids
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_kill_9_and_rerun_keeps_every_finished_trial(tmp_path):
    from fault_support import SCRIPT, fault_env, passed, start, wait_stopped
    db = tmp_path / "results.db"
    args = ["sweep", "--db", str(db), "--family", "sleepy", "--batches", "1,2", "--contexts", "64",
            "--samples", "3", "--no-emit", "-q"] + [x for p in (1, 4, 16, 64)
                                                    for x in ("--page-size", str(p))]
    # placed by event, not by clock: the sweep stops itself as its third trial is committed
    log = tmp_path / "fault.log"
    p = start(args, tmp_path, fault_env("trial-stored:3", "stop", log))
    try:
        assert wait_stopped(p), f"the sweep ended before its third trial: {p.communicate()[1]}"
        assert passed(log)[-1][:2] == ("trial-stored", 3)
        helpers = descendants(p.pid)                            # fork server, measuring worker
        assert helpers, "the sweep measures in a worker process"
    finally:
        p.kill()                                                # SIGKILL, mid-sweep
        p.communicate()
    deadline = time.monotonic() + 20                            # no worker outlives the sweep
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in helpers):
        time.sleep(0.1)
    assert not [pid for pid in helpers if Path(f"/proc/{pid}").exists()]
    with ResultsStore(db, create=False) as s:
        before = {r["id"]: (r["workload_id"], r["candidate"], r["samples"]) for r in s.trials()}
    assert len(before) == 3
    # the rerun measures in this process: what it must show is the store's, not the worker's
    res = subprocess.run([sys.executable, "-c", SCRIPT, *args, "--isolation", "inline"],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert f"{8 - len(before)} trials measured, {len(before)} answered" in " ".join(res.stdout.split())
    with ResultsStore(db, create=False) as s:
        after = {r["id"]: (r["workload_id"], r["candidate"], r["samples"]) for r in s.trials()}
    assert all(after[i] == v for i, v in before.items())        # every finished trial kept as is
    keys = [(w, c) for w, c, _ in after.values()]
    assert len(keys) == 8 and len(set(keys)) == 8                # nothing measured twice


def test_time_budget_stops_and_a_rerun_continues(tmp_path):
    db = tmp_path / "r.db"
    cfg = dict(db=db, device="cpu", emit=False, family=["sleepy"], batches="1,2,4",
               contexts="64", page_size=[16, 64, 128], samples=3, warmup=1, isolation="inline")
    cut = run_sweep(SweepRequest(**cfg, time_budget="1s").config())
    assert cut.stopped_early >= 1 and cut.measured < 9
    rest = run_sweep(SweepRequest(**cfg).config())
    assert rest.cached == cut.measured and rest.measured == 9 - cut.measured
    assert len(set(trial_keys(db))) == len(trial_keys(db)) == 9


class VirtualClock:
    """`time` for the sweep's budget: it stands still but for the pauses a test family asks for,
    so a budget test measures in its own seconds, whatever else loads the machine."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):        # time.time, perf_counter, ...: the real ones
        return getattr(time, name)


def virtual_budget_clock(monkeypatch) -> VirtualClock:
    """Every module that spends or checks a sweep's time budget reads the virtual clock."""
    from mla_tune.tune import search
    from mla_tune.tune.sweep import in_process, measure, shared, start

    clock = VirtualClock()
    for module in (search, measure, in_process, shared, start):
        monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr(sweep_families.SlowStartBackend, "pause", staticmethod(clock.sleep))
    return clock


def test_the_first_round_trips_start_up_costs_are_not_the_first_buckets_share(tmp_path, monkeypatch):
    """H200 2026-12-04: the first bucket's first round took 3.6 s beyond JIT (first CUDA use,
    first capture, clocks ramping up from idle), over its share of a 300 s budget (~1.7 s, estimated), and lost
    its other page sizes in a sweep that then used 124 s of the 300. Here the first run pauses 2 s,
    over the first bucket's ~1.7 s share of a 5 s budget: nothing may be cut. The budget runs on
    a virtual clock (only the pauses spend it), so a loaded machine cannot cut a bucket."""
    clock = virtual_budget_clock(monkeypatch)
    monkeypatch.setattr(sweep_families.SlowStartBackend, "first_pause_s", 2.0)
    db = tmp_path / "r.db"
    cfg = dict(db=db, device="cpu", emit=False, batches="1,2,4", contexts="64",
               page_size=[16, 64, 128], samples=3, warmup=1, isolation="inline", time_budget="5s")
    t0 = clock.now
    out = run_sweep(SweepRequest(**cfg, family=["slowstart"]).config())
    assert clock.now - t0 == pytest.approx(2.0)          # the one start-up pause, nothing else
    assert out.stopped_early == 0 and out.measured == 9
    assert len(set(trial_keys(db))) == 9
    # the control: a pause in every candidate's first run is the search's own time, and is cut
    monkeypatch.setattr(sweep_families.SlowStartBackend, "first_pause_s", 1.0)
    monkeypatch.setattr(sweep_families.SlowStartBackend, "each", True)
    cut = run_sweep(SweepRequest(**{**cfg, "db": tmp_path / "c.db"}, family=["slowstart"]).config())
    assert cut.stopped_early >= 1 and cut.measured < 9


def test_time_budget_is_shared_by_expected_cost_and_slack_moves_on():
    """The default grid on 2026-12-02 cut the largest buckets (B64-128 x L16K-32K) while small ones
    left time unused: shares now follow trials x bytes moved, and an early finish is re-shared."""
    from mla_tune.families import Candidate
    from mla_tune.tune.search_space import SearchSpace
    from mla_tune.tune.sweep.plan import PlannedBucket, budget_share, bucket_weight

    buckets = plan_buckets(model_preset("deepseek-v3"), [8], [1, 128], [1024, 32768])

    def planned(b, n=10):
        space = SearchSpace.build([Candidate("flashinfer", f"b{i}", 64) for i in range(n)])
        assert len(space) == n
        return PlannedBucket(b, space, "grid", n)
    small, big = (planned(b) for b in buckets
                  if b.workload.batch_size * b.workload.context_len in (1024, 128 * 32768))
    assert bucket_weight(big) > 4 * bucket_weight(small)         # 4.8 GB of KV vs 1.2 MB
    assert bucket_weight(planned(small.bucket, 20)) == pytest.approx(2 * bucket_weight(small))
    w = [bucket_weight(small), bucket_weight(big)]
    first = budget_share(100.0, w)
    assert first == pytest.approx(100 * w[0] / sum(w)) and first < 25
    assert budget_share(100.0 - 1.0, w[1:]) == pytest.approx(99.0)   # what small left goes on
    assert budget_share(10.0, [0.0, 0.0]) == pytest.approx(5.0)


# ---------------------------------------------------------------- faults in a sweep

def test_sweep_survives_crashing_and_hanging_candidates(tmp_path):
    db = tmp_path / "r.db"
    cfg = SweepRequest(db=db, device="cpu", emit=False, family=["faulty"], batches="1,2",
                       contexts="64", page_size=[16], samples=3, warmup=1, timeout=2.0).config()
    out = run_sweep(cfg)
    assert out.faults == 8 and out.restarts >= 8
    with ResultsStore(db, create=False) as s:
        rows = s.trials()
    by = {}
    for r in rows:
        by.setdefault(r["batch_size"], {})[r["backend"]] = (r["status"], r["invalid_reason"])
    for batch in (1, 2):
        assert by[batch]["torch"] == ("ok", None)
        assert by[batch]["abort"] == by[batch]["segv"] == by[batch]["poison"] == ("invalid", "crash")
        assert by[batch]["hang"] == ("invalid", "timeout")
    # a clean refusal in the first bucket is not retried with the same heads and page size
    assert by[1]["refuse"] == ("invalid", "unsupported") and "refuse" not in by[2]
    assert [b.planned.space.dropped for b in out.buckets][1][0][0].backend == "refuse"
    m = out.choice.models[0]
    assert all(b.families["faulty"].chosen.key == "faulty/torch/p16" for b in m.buckets)
    # faults are data: a rerun does not run them again
    again = run_sweep(cfg)
    assert again.measured == 0 and again.faults == 0


def test_a_refusal_is_learnt_once_for_every_later_bucket(tmp_path):
    # the H200 sweep of 2026-12-02 re-tried 19 refused candidates in 83 of 96 buckets: a space
    # was rebuilt only for the bucket right after a new refusal
    db = tmp_path / "r.db"
    sweep_families.RefusingBackend.prepared.clear()
    cfg = SweepRequest(db=db, device="cpu", emit=False, family=["refusing"], batches="1,2,4,8",
                       contexts="64", page_size=[16], samples=2, warmup=1, isolation="inline").config()
    out = run_sweep(cfg)
    assert [b for b, _ in sweep_families.RefusingBackend.prepared].count("refuse") == 1
    assert [len(b.planned.space.dropped) for b in out.buckets] == [0, 1, 1, 1]
    assert [k for _, k in trial_keys(db)].count("refusing/refuse/p16") == 1   # stored, visible
    # a later sweep on the same DB knows the refusal from the store
    sweep_families.RefusingBackend.prepared.clear()
    run_sweep(SweepRequest(db=db, device="cpu", emit=False, family=["refusing"], batches="16",
                           contexts="64", page_size=[16], samples=2, warmup=1, isolation="inline").config())
    assert {b for b, _ in sweep_families.RefusingBackend.prepared} == {"torch"}


def test_tpe_mode_live_on_the_cpu(tmp_path):
    out = run_sweep(SweepRequest(db=tmp_path / "r.db", device="cpu", emit=False, mode="tpe",
                                 isolation="inline", batches="1", contexts="64", samples=3, warmup=1).config())
    (b,) = out.buckets
    assert b.search.mode == "tpe" and b.search.stopped == "complete" and out.measured == 3


# ---------------------------------------------------------------- flags and exit codes

@pytest.mark.parametrize("flags, message", [
    (["--tp", "3"], "does not divide"),
    (["--batches", "abc"], "bad size list"),
    (["--mode", "fast"], "'fast' is not one of 'auto', 'grid', 'tpe'"),
    (["--isolation", "threads"], "'threads' is not one of 'auto', 'process', 'inline'"),
    (["--samples", "1"], "'--samples': Input should be greater than or equal to 2"),
    (["--time-budget", "5x"], "bad duration"),
    (["--family", "nope"], "unknown kernel family"),
    (["--model", "gpt-5"], "unknown model"),
    (["--q-len", "512", "--contexts", "256"], "q_len"),
    (["--mix", "/nonexistent.csv"], "cannot read workload mix"),
    (["--replay", "/nonexistent.db"], "no results DB"),
    (["--min-ratio", "0.5"], "--min-ratio"),
])
def test_bad_flags_give_one_line_and_exit_2(tmp_path, flags, message):
    db = [] if flags[0] == "--replay" else ["--db", str(tmp_path / "r.db")]
    res = run_main(["sweep", *db, *flags])
    assert res.code == 2 and res.exception is None, res.output
    assert message in res.output and one_line(res.output), res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "r.db").exists()        # refused before anything is written


def test_not_a_db_is_left_untouched(tmp_path):
    p = tmp_path / "notes.db"
    p.write_text("my notes\n")
    res = runner.invoke(app, ["sweep", "--db", str(p)])
    assert res.exit_code == 2 and "not an mla-tune results DB" in res.output and one_line(res.output)
    assert p.read_text() == "my notes\n"


def test_usage_errors_through_the_console_script_are_one_line(tmp_path):
    for flags in (["--tp", "x"], ["--bogus"]):
        res = subprocess.run([sys.executable, "-c", "from mla_tune.cli import main; main()", "sweep",
                              "--db", str(tmp_path / "r.db"), *flags],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and one_line(res.stderr), res.stderr
        assert "Traceback" not in res.stderr


def test_a_script_without_a_main_guard_can_sweep_in_a_worker(tmp_path):
    # multiprocessing re-runs the parent's __main__ script in each child; the sweep hides it, so
    # a library user's script needs no `if __name__ == "__main__"` and runs its sweep once
    script = tmp_path / "my_sweep.py"
    script.write_text(
        "import sys\nfrom pathlib import Path\n"
        "from mla_tune.tune.sweep.run import run_sweep\n"
        "from mla_tune.tune.sweep.request import SweepRequest\n"
        "out = run_sweep(SweepRequest(db=Path(sys.argv[1]), device='cpu', isolation='process',\n"
        "    emit=False, batches='1', contexts='64', page_size=[16], samples=3, warmup=1).config())\n"
        "print('measured', out.measured)\n")
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "r.db")], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["measured", "1"]


def test_no_family_that_runs_here_is_exit_1(tmp_path):
    res = runner.invoke(app, ["sweep", "--db", str(tmp_path / "r.db"), "--family", "flashinfer"])
    assert res.exit_code == 1, res.output
    assert "no kernel family can run on cpu" in res.output and "CUDA" in res.output


# ---------------------------------------------------------------- the store change it needs

def test_v1_results_db_gains_the_default_mark(tmp_path):
    import sqlite_utils
    from mla_tune.store import integrity, schema
    p = tmp_path / "v1.db"
    db = sqlite_utils.Database(p)
    schema.MIGRATIONS[0](db)
    db[integrity.META_TABLE].insert({"key": "schema_version", "value": "1"}, pk="key")
    db["runs"].insert({"id": 1, "kind": "gpu", "device_name": "x"})
    # whole rows, as a v1 sweep stored them (the store refuses a row no version could have written)
    db["workloads"].insert({"id": 1, "model": "m", "num_heads": 16, "kv_lora_rank": 512,
                            "qk_rope_head_dim": 64, "softmax_scale": 0.07, "batch_size": 1,
                            "context_len": 64, "q_len": 1, "ragged": "uniform", "seed": 0,
                            "q_dtype": "bfloat16", "kv_dtype": "bfloat16", "total_kv_tokens": 64,
                            "bytes": 73728, "flops": 1000})
    db["trials"].insert({"id": 1, "run_id": 1, "workload_id": 1, "family": "a", "backend": "b",
                         "page_size": 1, "params": "{}", "candidate": "a/b/p1", "status": "ok"})
    db.close()
    with ResultsStore(p) as s:
        assert s.schema_version == schema.SCHEMA_VERSION >= 2
        assert "is_default" in {c.name for c in s.db["trials"].columns}
        assert s.db["trials"].get(1)["candidate"] == "a/b/p1"


def test_ceilings_subprocess_without_cuda_returns_nothing():
    """On a machine without CUDA the child fails and the run record simply has no ceilings."""
    from mla_tune.tune.sweep.start import ceilings_in_subprocess
    import torch
    if torch.cuda.is_available():
        import pytest
        pytest.skip("has CUDA")
    assert ceilings_in_subprocess(timeout=60) == {}


def test_the_ceilings_probe_runs_beside_the_worker_and_is_ended(monkeypatch):
    from mla_tune.tune.sweep import start as sweep_start
    monkeypatch.setattr(sweep_start.CeilingsProbe, "CODE",
                        "import json, time; time.sleep(0.2); print(json.dumps({'copy_gbps': 1.0}))")
    probe = sweep_start.CeilingsProbe(timeout=30).start()
    assert probe.proc is not None and probe.result() == {"copy_gbps": 1.0} and probe.proc is None
    monkeypatch.setattr(sweep_start.CeilingsProbe, "CODE", "import time; time.sleep(60)")
    slow = sweep_start.CeilingsProbe(timeout=30).start()
    proc = slow.proc
    slow.close()                          # a sweep that measured nothing never asks
    assert proc.poll() is not None and slow.result() == {}


def test_the_time_line_splits_the_wall():
    from mla_tune.tune.sweep.outcome import SweepOutcome
    from mla_tune.tune.sweep.plan import SweepPlan
    o = SweepOutcome(SweepPlan("cuda", "gpu", [], {}, []), seconds=100.0,
                     time_split={"samples_s": 20.0, "jit_s": 10.0, "measure_s": 60.0, "startup_s": 15.0,
                                 "plan_s": 8.0, "choose_s": 2.0})
    line = o.time_line()
    assert line.startswith("time: 100.0 s = timed samples 20.0 s + JIT 10.0 s + other measuring 30.0 s")
    assert ("start-up 15.0 s + planning 8.0 s + search/store 15.0 s + choice/emit 2.0 s "
            "(20% of the wall") in line
    assert SweepOutcome(SweepPlan("cpu", "cpu-reference", [], {}, [])).time_line() == ""
    assert "\n" not in line                  # no worker split measured: one line
    # planning's own parts, what they leave of plan_s named as the rest
    o.time_split["planning"] = {"checks_s": 0.5, "families_s": 4.0, "spaces_s": 1.5, "store_s": 1.0}
    more = o.time_line()
    assert more.splitlines()[0] == line
    assert more.splitlines()[1] == ("planning: input checks 0.5 s, worker/probe/JIT start 0.0 s, "
                                    "families (their imports) 4.0 s, search spaces 1.5 s, "
                                    "workloads, studies and prebuild start 1.0 s, the rest 1.0 s")


def test_the_worker_split_adds_up_to_other_measuring():
    """A real measured batch (CPU reference family) reports its phases; the time line's second
    line names them with JIT out of preparing and the timed samples out of sampling."""
    from mla_tune.families.reference import ReferenceFamily
    from mla_tune.measure import trial
    from mla_tune.measure.trial import PHASES, MeasureSettings
    from mla_tune.tune.sweep.outcome import PHASE_NAMES, SweepOutcome
    from mla_tune.tune.sweep.plan import SweepPlan
    from mla_tune.families import Candidate
    from mla_tune.problem.workload import custom_model, workload_for
    assert tuple(PHASE_NAMES) == PHASES
    w = workload_for(custom_model(2, 32, 16), 1, 2, 8)
    entries = [(ReferenceFamily(), Candidate("reference", "torch", p)) for p in (4, 8)]
    res = trial.measure_interleaved(entries, w, MeasureSettings(samples=3), rounds=1,
                                    problems=trial.ProblemCache())
    for r in res:
        assert r.status == "ok" and set(r.phase_s) == set(PHASES) and all(v >= 0 for v in r.phase_s.values())
    split = {k: sum(r.phase_s[k] for r in res) for k in PHASES}
    o = SweepOutcome(SweepPlan("cuda", "gpu", [], {}, []), seconds=10.0,
                     time_split={**split, "measure_s": 5.0, "samples_s": 0.0, "jit_s": 0.0})
    second = o.time_line().splitlines()[1]
    assert second.startswith("other measuring: preparing ") and "correctness checks" in second


def test_the_journal_is_written_without_fsync_and_reads_back(tmp_path, monkeypatch):
    import os
    import optuna
    from mla_tune.tune.study_storage import journal_storage

    def no_fsync(fd):
        raise AssertionError("fsync called")

    monkeypatch.setattr(os, "fsync", no_fsync)
    path = tmp_path / "j.optuna.log"
    study = optuna.create_study(study_name="s", storage=journal_storage(path))
    t = study.ask()
    t.suggest_int("x", 0, 3)
    study.tell(t, 1.5)
    again = optuna.load_study(study_name="s", storage=journal_storage(path))   # a later process
    assert [x.value for x in again.trials] == [1.5]


def test_a_gpu_sweep_starts_its_worker_before_planning_and_surfaces_its_start_error(monkeypatch, tmp_path):
    """EarlyStart (what a GPU sweep starts before the families' imports): a real worker process
    comes up in a thread and answers; a start that fails is raised by wait(), in the sweep's
    thread; on the CPU nothing is started."""
    from mla_tune.measure import worker as worker_mod
    from mla_tune.measure.trial import MeasureSettings
    from mla_tune.tune.sweep import start as sweep_start
    monkeypatch.setenv("MLA_TUNE_JIT_PREBUILD", "0")
    monkeypatch.setattr(sweep_start.CeilingsProbe, "CODE", "print('{}')")
    buckets = plan_buckets(model_preset("deepseek-v3"), [8], [1], [256])
    cfg = SweepConfig(buckets=buckets, device="cuda", families=["reference"], isolation="process",
                      db=tmp_path / "r.db")
    early = sweep_start.EarlyStart(cfg, MeasureSettings(device="cpu"))
    try:
        assert isinstance(early.runner, worker_mod.WorkerRunner)
        assert early.runner.preload == ("reference",)
        early.wait()
        assert early.runner._proc is not None and early.runner._proc.is_alive()
        wl = buckets[0].workload
        from mla_tune.families import Candidate
        [r] = early.runner.measure(wl, [Candidate("reference", "torch", 16)])
        assert r.status == "ok", r.message
    finally:
        early.close()
    assert early.runner._proc is None

    def refuse(self):
        raise worker_mod.WorkerError("the measuring worker process did not start: test")

    monkeypatch.setattr(worker_mod.WorkerRunner, "start", refuse)
    early = sweep_start.EarlyStart(cfg, MeasureSettings(device="cpu"))
    with pytest.raises(worker_mod.WorkerError, match="did not start: test"):
        early.wait()
    early.close()
    cpu = sweep_start.EarlyStart(SweepConfig(buckets=buckets, device="cpu"), MeasureSettings())
    assert cpu.runner is None and cpu.ceilings is None and cpu.prebuild is None
    assert cpu.wait() < 0.1
    cpu.close()


# ---------------------------------------------------------------- the request and its one check

def test_a_page_no_family_of_the_sweep_runs_at_is_refused_by_its_spec(tmp_path):
    from mla_tune.tune.sweep.check import check_page_sizes
    from mla_tune.validate import InputError
    res = runner.invoke(app, ["sweep", "--family", "triton", "--page-size", "8", "--page-size", "64",
                              "--db", str(tmp_path / "r.db"), "--dry-run"])
    assert res.exit_code == 2, res.output
    assert "--page-size 8: no kernel family of this sweep runs at it (triton: page a multiple of 16)" \
        in " ".join(res.output.split())
    assert list(tmp_path.iterdir()) == []
    check_page_sizes([8, 64], ["triton", "flashinfer"])      # FlashInfer runs any page
    check_page_sizes([8], ["reference"])                     # no spec: any page
    with pytest.raises(InputError, match="flashmla: page 64"):
        check_page_sizes([64, 32], ["flashmla"])
    with pytest.raises(InputError, match="must be one of"):
        check_page_sizes([48], ["flashinfer"])                # not a block size the plugin serves


def test_a_request_built_in_code_is_checked_as_the_command_is():
    from mla_tune.validate import InputError
    req = SweepRequest(replay=Path("r.db"), samples=5, tp=[], family=("triton",))
    assert req.tp is None and req.family == ("triton",)       # a flag given no value is not given
    assert req.given == {"replay", "samples", "family"}        # what differs from the defaults
    with pytest.raises(InputError, match="--family, --samples do not apply to a replay"):
        req.replay_config()
    with pytest.raises(InputError, match="--storage and --journal exclude each other"):
        SweepRequest(device="cpu", storage="s.log", journal=Path("j.log")).config()
    with pytest.raises(InputError, match="--device-name does not apply to a live sweep"):
        SweepRequest(device="cpu", device_name="NVIDIA H200").config()
    # the command line's own `given`: a flag set to its default value is still given
    with pytest.raises(InputError, match="--name does not apply to a replay"):
        SweepRequest(replay=Path("r.db"), given=frozenset({"replay", "name"})).replay_config()
