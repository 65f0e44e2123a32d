"""Scale-out: several sweeps or workers on one results.db and one shared optuna storage (a
journal file, or PostgreSQL started here on loopback), a worker killed mid-run."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_tune.families.base import Candidate
from mla_tune.cli import app
from mla_tune.tune.sweep.distributed import parse_gpus
from mla_tune.tune.search_space import SearchSpace
from mla_tune.tune.sweep.shared_bucket import Heartbeat, SharedBucket
from mla_tune.tune.study_storage import open_storage
from mla_tune.store.results import ResultsStore

TESTS = Path(__file__).parent
runner = CliRunner()
CLI = ("import sys; sys.path.insert(0, %r); import sweep_families; sweep_families.register(); "
       "from mla_tune.cli import main; main()" % str(TESTS))


def one_line(text: str) -> bool:
    return len([x for x in text.strip().splitlines() if x.strip()]) == 1


def stored(db: Path) -> list[tuple]:
    """(workload_id, candidate) of every stored trial."""
    with sqlite3.connect(db) as c:
        return c.execute("select workload_id, candidate from trials order by id").fetchall()


def cli(*args, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CLI, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}, **kw)


# ---------------------------------------------------------------- the claim, in one process

def test_two_claimants_split_a_seeded_study_with_no_overlap(tmp_path):
    storage = open_storage(tmp_path / "s.log")
    cands = [Candidate("reference", "torch", p) for p in (1, 2, 4, 8, 16, 32, 64, 128)] * 1
    space = SearchSpace.build(cands, cands[:1])
    a = SharedBucket(storage, "bucket", space)
    assert a.open(space.candidates, {"mode": "grid"}) is True
    b = SharedBucket(storage, "bucket", space, worker="other:1")
    assert b.open(space.candidates, {"mode": "grid"}) is False       # loaded, not seeded twice
    assert a.uid == b.uid and len(a.study.trials) == 8
    got = {"a": [], "b": []}
    gate = threading.Barrier(2)

    def take(name, sb):
        gate.wait()
        while True:
            claims = sb.claim(1)
            if not claims:
                return
            got[name] += [c.candidate.key for c in claims]

    threads = [threading.Thread(target=take, args=(n, sb)) for n, sb in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got["a"] + got["b"]) == sorted(c.key for c in space.candidates)
    assert not set(got["a"]) & set(got["b"])
    assert a.counts() == {"waiting": 0, "running": 8}


def test_a_dead_claimants_trial_is_failed_and_enqueued_again(tmp_path):
    storage = open_storage(tmp_path / "s.log")
    cands = [Candidate("reference", "torch", p) for p in (16, 64)]
    space = SearchSpace.build(cands, cands)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()                                            # a pid that no longer runs
    a = SharedBucket(storage, "b", space, worker=f"{socket.gethostname()}:{dead.pid}")
    a.open(space.candidates, {})
    held = a.claim(1)
    assert [c.candidate.page_size for c in held] == [16]
    b = SharedBucket(storage, "b", space)
    b.open(space.candidates, {})
    assert b.fail_stale() == 1 and b.fail_stale() == 0      # failed once, retried once
    retry = [t for t in b.study.trials if t.system_attrs.get("failed_trial") == held[0].number]
    assert len(retry) == 1 and retry[0].user_attrs["candidate"] == held[0].candidate.key
    first, second = b.claim(8), b.claim(8)           # a claimed batch never mixes page sizes
    assert sorted(c.candidate.key for c in first + second) == sorted(c.key for c in cands)
    assert len(first) == len(second) == 1
    assert b.claim(8) == []


# ---------------------------------------------------------------- whole sweeps

SMALL = ["--batches", "1,2,4", "--contexts", "64,128", "--samples", "3", "--warmup", "1", "--no-emit", "-q"]


@pytest.mark.parametrize("mode", ["grid", "tpe"])
def test_two_sweeps_on_one_db_both_finish_and_store_each_trial_once(tmp_path, mode):
    # the reported bug: each start deleted the other's study; one died with KeyError. TPE: both
    # ask one shared study (optuna's distributed TPE); a proposal another holds is not measured
    db = tmp_path / "results.db"
    args = ["sweep", "--db", str(db), "--mode", mode, *SMALL]
    ps = [cli(*args, cwd=tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in ps]
    assert [p.returncode for p in ps] == [0, 0], outs
    rows = stored(db)
    assert len(rows) == 18 and len(set(rows)) == 18               # 6 buckets x 3 pages, once each
    measured = [int(" ".join(o.split()).split(" trials measured")[0].split()[-1]) for o in outs]
    assert sum(measured) == 18, outs
    import optuna
    storage = open_storage(tmp_path / "results.optuna.log")
    studies = optuna.get_all_study_summaries(storage)
    assert len(studies) == 6 and all(f"| {mode} | cpu" in s.study_name for s in studies)
    for st in studies:          # each study knows all three candidates of its bucket, measured
        trials = optuna.load_study(study_name=st.study_name, storage=storage).trials
        assert len({t.user_attrs["candidate"] for t in trials if t.state.name == "COMPLETE"}) == 3


def test_gpus_runs_one_worker_per_gpu_and_emits_once(tmp_path):
    db = tmp_path / "results.db"
    p = cli("sweep", "--db", str(db), "--gpus", "0,1,2", "--emit", "--configs-dir", str(tmp_path / "cfg"),
            *[a for a in SMALL if a != "--no-emit"], cwd=tmp_path)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    assert "3 worker processes" in out and "18 trials measured, 0 answered" in " ".join(out.split())
    rows = stored(db)
    assert len(rows) == 18 and len(set(rows)) == 18
    import re
    done = re.findall(r"worker GPU (\d) \(pid \d+\): done, (\d+) measured", " ".join(out.split()))
    assert sorted(g for g, _ in done) == ["0", "1", "2"] and sum(int(n) for _, n in done) == 18, out
    with ResultsStore(db, create=False) as s:
        runs = s.runs()
    # one run record per worker that measured, each saying which GPU it had
    gpus = [r["cuda_visible_devices"] for r in runs]
    assert sorted(gpus) == sorted(g for g, n in done if int(n)) and len(set(gpus)) == len(gpus)
    assert [f.name for f in (tmp_path / "cfg").iterdir()] == ["device_name=cpu.json"]
    # a rerun: every study is finished, nothing is measured again
    p = cli("sweep", "--db", str(db), "--gpus", "0,1", *SMALL, cwd=tmp_path)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0 and "0 trials measured, 18 answered" in " ".join(out.split()), out
    assert stored(db) == rows


def _all_trials(storage) -> list:
    import optuna
    return [t for s in optuna.get_all_study_summaries(storage)
            for t in optuna.load_study(study_name=s.study_name, storage=storage).trials]


def _kill_a_worker_mid_run(tmp_path: Path, storage_spec: str, extra=()) -> tuple:
    """Sweep the sleepy family with 2 workers; the first worker to prepare a trial is killed
    there (SIGKILL, placed by event: mla_tune.fault_points), holding its claimed trials."""
    from fault_support import fault_env, passed, struck
    db = tmp_path / "results.db"
    args = ["sweep", "--db", str(db), "--family", "sleepy", "--gpus", "0,1", "--storage", storage_spec,
            "--batches", "1,2,4", "--contexts", "64", "--samples", "3", "--warmup", "1",
            "--no-emit", "-q", "--isolation", "inline", *extra] + [x for p in (1, 4, 16, 64)
                                                               for x in ("--page-size", str(p))]
    log = tmp_path / "fault.log"
    p = cli(*args, env={k: v for k, v in fault_env("trial-prepared", "kill", log).items()
                        if k.startswith("MLA_TUNE_FAULT")}, cwd=tmp_path)
    out = p.communicate(timeout=300)[0]
    assert p.returncode == 0, out
    pid = struck(log)
    assert pid is not None and pid != p.pid, f"no worker reached a prepared trial: {out}"
    assert ("trial-prepared", 1, pid) in passed(log)
    storage = open_storage(storage_spec)
    from optuna.trial import TrialState
    held = [t for t in _all_trials(storage) if t.user_attrs.get("worker", "").endswith(f":{pid}")
            and t.state == TrialState.FAIL]
    assert held, "the killed worker held a trial"
    return db, storage, held[0], pid, out


def _check_retried_and_once(db, storage, trial, pid, out):
    rows = stored(db)
    assert len(rows) == 12 and len(set(rows)) == 12, rows          # 3 buckets x 4 pages, once each
    trials = {t._trial_id: t for t in _all_trials(storage)}
    from optuna.trial import TrialState
    assert trials[trial._trial_id].state == TrialState.FAIL
    retries = [t for t in trials.values() if t.system_attrs.get("failed_trial") == trial.number
               and t.user_attrs["candidate"] == trial.user_attrs["candidate"]]
    assert [t.state for t in retries] == [TrialState.COMPLETE]      # measured again elsewhere
    assert retries[0].user_attrs["worker"].rpartition(":")[2] != str(pid)
    assert f"(pid {pid}): exited -9" in " ".join(out.split())
    with ResultsStore(db, create=False) as s:
        key = trial.user_attrs["candidate"]
        assert sum(r["candidate"] == key for r in s.trials() if r["status"] == "ok") == 3  # 3 buckets


@pytest.mark.slow
def test_a_killed_worker_trial_is_retried_by_another_worker_journal(tmp_path):
    out = _kill_a_worker_mid_run(tmp_path, str(tmp_path / "shared.optuna.log"))
    _check_retried_and_once(*out)


# ---------------------------------------------------------------- PostgreSQL on loopback

def _pg_bin() -> Path | None:
    found = shutil.which("initdb") or (sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or [None])[-1]
    return Path(found).resolve().parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres_url():
    """A throwaway PostgreSQL server on 127.0.0.1 in a tmp dir (as the postgres user when this
    runs as root: the server refuses root), stopped and removed afterwards."""
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): apt-get install postgresql; "
                    "CI installs them in .ci/run")
    pytest.importorskip("psycopg2", reason="psycopg2-binary (the test extra) is not installed")
    base = Path(tempfile.mkdtemp(prefix="mla-tune-pg-"))
    os.chmod(base, 0o755)
    as_user: list[str] = []
    user = os.environ.get("USER") or "mla"
    if os.geteuid() == 0:
        import pwd
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the server as")
        os.chown(base, pw.pw_uid, pw.pw_gid)
        as_user, user = ["runuser", "-u", "postgres", "--"], "postgres"
    data, port = base / "data", _free_port()

    def run(*cmd, check=True):
        return subprocess.run([*as_user, *map(str, cmd)], capture_output=True, text=True, timeout=120,
                              check=check)

    try:
        run(bindir / "initdb", "-D", data, "-U", user, "--auth=trust", "-E", "UTF8")
        run(bindir / "pg_ctl", "-D", data, "-l", base / "server.log", "-w", "-t", "60", "-o",
            f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c max_connections=100", "start")
        yield f"postgresql+psycopg2://{user}@127.0.0.1:{port}/postgres"
    finally:
        if (data / "postmaster.pid").exists():
            run(bindir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_postgres_shared_storage_killed_worker_retried(tmp_path, postgres_url):
    out = _kill_a_worker_mid_run(tmp_path, postgres_url, ["--heartbeat", "1"])
    _check_retried_and_once(*out)
    # the studies live in the server, one per bucket, every trial finished or failed
    from optuna.trial import TrialState
    states = {t.state for t in _all_trials(open_storage(postgres_url))}
    assert states == {TrialState.COMPLETE, TrialState.FAIL}


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("flags, message", [
    (["--gpus", "0,x"], "bad --gpus"),
    (["--gpus", "1,1"], "a GPU is named twice"),
    (["--heartbeat", "0"], "--heartbeat must be at least 1 s"),
    (["--storage", "nosuchdriver://x/y"], "cannot open the optuna storage"),
    (["--storage", "a.log", "--journal", "b.log"], "exclude each other"),
])
def test_bad_distribution_flags_are_one_line(tmp_path, flags, message):
    res = runner.invoke(app, ["sweep", "--db", str(tmp_path / "r.db"), *flags])
    assert res.exit_code == 2, res.output
    assert message in res.output and one_line(res.output) and "Traceback" not in res.output


def test_unreachable_postgres_is_one_line(tmp_path):
    pytest.importorskip("psycopg2")
    url = f"postgresql+psycopg2://nobody:secret@127.0.0.1:{_free_port()}/none"
    res = runner.invoke(app, ["sweep", "--db", str(tmp_path / "r.db"), "--storage", url, *SMALL])
    assert res.exit_code == 2, res.output
    assert "cannot open the optuna storage" in res.output and "secret" not in res.output
    assert one_line(res.output)


def test_parse_gpus():
    assert parse_gpus("0,1, 3") == ["0", "1", "3"]
    assert parse_gpus("4") == ["4"]
    with pytest.raises(ValueError):
        parse_gpus("")


def _heartbeat_decides(url: str) -> None:
    """A claim on another host (no pid to look at) lives while its heartbeat beats; once it
    stops, optuna fails the trial after the grace period and the retry callback enqueues it."""
    from optuna.trial import TrialState
    storage = open_storage(url, heartbeat_s=1)
    cands = [Candidate("reference", "torch", 16)]
    space = SearchSpace.build(cands, cands)
    beat = Heartbeat(storage, 1)
    far = SharedBucket(storage, "hb", space, heartbeat=beat, worker="another-host:4242", grace_s=600)
    far.open(cands, {})
    [held] = far.claim(1)
    here = SharedBucket(storage, "hb", space, grace_s=600)
    here.open(cands, {})
    time.sleep(3.5)                                   # past the 2 s grace: the beats keep it alive
    here.fail_stale()
    states = {t.number: t.state for t in here.study.get_trials(deepcopy=False)}
    assert states == {held.number: TrialState.RUNNING}
    beat.close()                                      # the far worker is gone
    time.sleep(3.5)
    here.fail_stale()
    trials = here.study.get_trials(deepcopy=False)
    assert trials[held.number].state == TrialState.FAIL
    [retry] = [t for t in trials if t.system_attrs.get("failed_trial") == held.number]
    assert retry.state == TrialState.WAITING and retry.user_attrs["candidate"] == cands[0].key
    assert [c.candidate.key for c in here.claim(1)] == [cands[0].key]


@pytest.mark.slow
def test_rdb_heartbeat_fails_a_silent_claim_and_retries_it_sqlite(tmp_path):
    _heartbeat_decides(f"sqlite:///{tmp_path / 'optuna.db'}")


@pytest.mark.slow
def test_rdb_heartbeat_fails_a_silent_claim_and_retries_it_postgres(postgres_url):
    _heartbeat_decides(postgres_url)


def test_a_new_results_db_beside_an_old_journal_measures_afresh(tmp_path):
    # the journal's studies belong to the DB they were made for: `rm results.db` starts over
    from mla_tune.tune.sweep.run import run_sweep
    from mla_tune.tune.sweep.request import SweepRequest
    db = tmp_path / "results.db"
    cfg = dict(db=db, device="cpu", isolation="inline", emit=False, batches="1", contexts="64",
               page_size=[16, 64], samples=3, warmup=1)
    assert run_sweep(SweepRequest(**cfg).config()).measured == 2
    assert run_sweep(SweepRequest(**cfg).config()).measured == 0          # resumed: all done
    for p in tmp_path.glob("results.db*"):
        p.unlink()
    again = run_sweep(SweepRequest(**cfg).config())
    assert (again.measured, again.cached) == (2, 0) and len(stored(db)) == 2
