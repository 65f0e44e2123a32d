"""Never lose a result (issue 52): one file given for two roles is refused before anything is
written, however spelt; nothing is created through a dangling symbolic link; a report writes no
byte beside the DB it reads; and faults placed by event (mla_tune.fault_points), a kill at every
step of a sweep, a merge and an emit, and a disk turning read-only mid-sweep, lose no trial."""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import sweep_families
from cli_support import one_line, run_main
from fault_support import ROOT, fault_env, passed, run_to_fault, start, strace_works, wait_stopped
from mla_tune.store.errors import StoreError
from mla_tune.store.results import ResultsStore

SWEEP = ["--batches", "1,2", "--contexts", "64", "--samples", "3", "--warmup", "1",
         "--isolation", "inline", "-q", "--no-emit", "--family", "reference"]
FULL = 6                  # 2 buckets x 3 page sizes of the reference family


@pytest.fixture(autouse=True)
def families():
    sweep_families.register()


def files(root: Path) -> dict:
    """Every entry below root: content hash and mtime of files, link targets of links."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_file():
            out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        else:
            out[rel] = "dir"
    return out


def stored(db: Path) -> tuple[int, int]:
    with sqlite3.connect(db) as c:
        return c.execute("select count(*), count(distinct workload_id || ' ' || candidate) "
                         "from trials").fetchone()


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    """A folder holding a CPU sweep's DB (x.db) and journal."""
    d = tmp_path_factory.mktemp("swept")
    sweep_families.register()
    res = run_main(["sweep", "--db", "x.db", *SWEEP], cwd=d)
    assert res.code == 0, res.output[-400:]
    return d


def refused(args, cwd, *words) -> None:
    before = files(Path(cwd))
    res = run_main(args, cwd=cwd)
    assert res.code == 2 and res.exception is None and one_line(res.stderr), (args, res.output[-400:])
    for w in words:
        assert w in res.stderr, (args, res.stderr)
    assert files(Path(cwd)) == before, args            # nothing created, nothing changed


# ---------------------------------------------------------------- one path, two roles

@pytest.mark.parametrize("second", [
    ["--journal", "x.db"], ["--journal", "./x.db"], ["--journal", "sub/../x.db"],
    ["--storage", "x.db"], ["--storage", "sqlite:///x.db"], ["--storage", "sqlite:///./x.db"],
    ["--storage", "ABS"], ["--journal", "link.db"], ["--storage", "sqlite:///link.db"],
    ["--emit", "--configs-dir", "x.db"]])
def test_a_new_db_given_again_as_journal_storage_or_configs_folder_is_refused(tmp_path, second):
    (tmp_path / "sub").mkdir()
    os.symlink("x.db", tmp_path / "link.db")          # a link to the DB-to-be
    second = [f"sqlite:///{tmp_path / 'x.db'}" if a == "ABS" else a for a in second]
    refused(["sweep", *SWEEP, "--db", "x.db", *[a for a in second if a != "--no-emit"]], tmp_path,
            "are one file", str(tmp_path / "x.db"))


def test_an_existing_db_given_again_through_a_link_a_hard_link_or_another_spelling(swept, tmp_path):
    shutil.copy(swept / "x.db", tmp_path / "x.db")
    os.link(tmp_path / "x.db", tmp_path / "hard.db")
    os.symlink(tmp_path / "x.db", tmp_path / "abs-link.db")
    for second in (["--journal", "hard.db"], ["--journal", "abs-link.db"],
                   ["--storage", f"sqlite:///{tmp_path}/./hard.db"], ["--journal", str(tmp_path / "x.db")]):
        refused(["sweep", *SWEEP, "--db", "x.db", *second], tmp_path, "are one file")
    # the launcher of --gpus workers checks before it seeds their studies
    refused(["sweep", *SWEEP, "--db", "x.db", "--gpus", "0,1", "--storage", "hard.db"], tmp_path,
            "are one file")
    # the reads: emit into the DB's own path, a plot over it
    refused(["emit", "--db", "x.db", "--configs-dir", "./x.db"], tmp_path, "are one file")
    refused(["report", "--db", "x.db", "--plot", "abs-link.db"], tmp_path, "are one file")


@pytest.mark.parametrize("target", ["x.db", "./x.db", "link.db", "hard.db", "ABS"])
def test_merge_refuses_a_source_that_is_its_target(swept, tmp_path, target):
    shutil.copy(swept / "x.db", tmp_path / "x.db")
    os.symlink("x.db", tmp_path / "link.db")
    os.link(tmp_path / "x.db", tmp_path / "hard.db")
    target = str(tmp_path / "x.db") if target == "ABS" else target
    refused(["merge", "x.db", "--db", target], tmp_path, "are one file")
    refused(["merge", target, "--db", "x.db"], tmp_path, "are one file")


def test_the_case_the_issue_found_no_longer_loses_the_trial(tmp_path):
    """`sweep --db x.db --journal x.db` made x.db a journal and set the results DB aside as a
    damaged journal. Now refused, and the same sweep with its own journal stores every trial."""
    refused(["sweep", *SWEEP, "--db", "x.db", "--journal", "x.db"], tmp_path)
    assert not list(tmp_path.iterdir())
    res = run_main(["sweep", *SWEEP, "--db", "x.db", "--journal", "j.log"], cwd=tmp_path)
    assert res.code == 0, res.output[-400:]
    assert stored(tmp_path / "x.db") == (FULL, FULL)
    assert run_main(["report", "--db", "x.db"], cwd=tmp_path).code == 0


# ---------------------------------------------------------------- dangling links

def test_nothing_is_created_through_a_dangling_symbolic_link(swept, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(swept / "x.db", tmp_path / "good.db")
    os.symlink(tmp_path / "elsewhere" / "t.db", tmp_path / "link.db")
    refused(["merge", "good.db", "--db", "link.db"], tmp_path, "symbolic link", "does not exist")
    refused(["sweep", *SWEEP, "--db", "link.db"], tmp_path, "symbolic link", "does not exist")
    refused(["sweep", *SWEEP, "--db", "new.db", "--journal", "link.db"], tmp_path, "symbolic link")
    os.symlink(tmp_path / "elsewhere" / "p.png", tmp_path / "link.png")
    refused(["report", "--db", "good.db", "--plot", "link.png"], tmp_path, "symbolic link")
    with pytest.raises(StoreError, match="symbolic link"):
        ResultsStore(tmp_path / "link.db")
    assert not (tmp_path / "elsewhere" / "t.db").exists()
    # a link to an existing DB is that DB: merged into as named
    os.symlink("good.db", tmp_path / "alias.db")
    shutil.copy(swept / "x.db", tmp_path / "other.db")
    assert run_main(["merge", "other.db", "--db", "alias.db"], cwd=tmp_path).code == 0


# ---------------------------------------------------------------- a report is a read

def _killed_writer_left_wal(db: Path) -> None:
    """A writer killed after a commit: its -wal (holding the commit) and -shm stay beside db."""
    code = ("import os, sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
            "c.execute('pragma journal_mode=wal'); "
            "c.execute(\"update trials set message = 'only-in-the-wal' where id = 1\"); c.commit(); "
            "os.kill(os.getpid(), 9)")
    subprocess.run([sys.executable, "-c", code, str(db)])
    assert Path(f"{db}-wal").stat().st_size and Path(f"{db}-shm").exists()


def _as_nobody_works() -> str | None:
    if os.geteuid() != 0:
        return None
    if shutil.which("setpriv") is None:
        return "running as root (chmod does not stop root) and setpriv is missing"
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        sys.executable, "-c", "import mla_tune"], capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd="/")
    return None if r.returncode == 0 else ("running as root and the unprivileged user cannot "
                                           "import this checkout: " + r.stderr.decode()[-120:])


@pytest.fixture
def open_tmp():
    """A scratch folder other users can reach (pytest's own is private to this user)."""
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="mla-tune-ro-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_report_changes_no_byte_beside_a_db_in_a_folder_it_cannot_write(swept, open_tmp):
    tmp_path = open_tmp
    folder = tmp_path / "ro"
    folder.mkdir()
    shutil.copy(swept / "x.db", folder / "w.db")
    _killed_writer_left_wal(folder / "w.db")
    why = _as_nobody_works()
    if why:
        pytest.skip(why)
    cmd = [sys.executable, "-m", "mla_tune", "report", "--db", str(folder / "w.db"), "-f", "json"]
    if os.geteuid() == 0:
        # root writes through any permission: the report runs as an unprivileged user, who owns
        # the DB files (so SQLite could open -shm for writing) but not the folder
        for f in folder.iterdir():
            os.chown(f, 65534, 65534)
        for p in (tmp_path, folder):
            os.chmod(p, 0o755)
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + cmd
    else:
        os.chmod(folder, 0o555)
    before = files(folder)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/",
                           env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)})
    finally:
        os.chmod(folder, 0o755)
    assert r.returncode == 0, r.stderr[-400:]
    assert "only-in-the-wal" in r.stdout                  # the killed writer's commit is read
    assert files(folder) == before                        # db, -wal, -shm: same bytes, same mtimes


def test_the_store_opens_a_db_for_reading_in_sqlite_read_only_mode(swept, tmp_path):
    shutil.copy(swept / "x.db", tmp_path / "w.db")
    _killed_writer_left_wal(tmp_path / "w.db")
    with ResultsStore(tmp_path / "w.db", create=False) as s:
        assert s.trials()[0]["message"] == "only-in-the-wal"
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            s.db.conn.execute("update trials set message = 'x'")


# ---------------------------------------------------------------- faults placed by event

@pytest.mark.parametrize("event", ["db-created", "journal-written:1", "trial-prepared:2",
                                   "trial-stored:3"])
def test_a_kill_at_each_step_of_a_sweep_loses_no_trial(tmp_path, event):
    log = tmp_path / "fault.log"
    r = run_to_fault(["sweep", "--db", "x.db", *SWEEP], tmp_path, event, log=log)
    name, _, n = event.partition(":")
    assert r.returncode == -9, r.stderr[-400:]
    assert (name, int(n or 1)) == passed(log)[-1][:2]     # the fault struck right after its event
    assert (tmp_path / "x.db").exists()
    before = stored(tmp_path / "x.db")[0]
    assert before == sum(e[0] == "trial-stored" for e in passed(log))   # each stored one kept
    res = run_main(["sweep", "--db", "x.db", *SWEEP], cwd=tmp_path)
    assert res.code == 0, res.output[-400:]
    assert stored(tmp_path / "x.db") == (FULL, FULL)      # every trial once, the finished kept
    assert f"{FULL - before} trials measured, {before} answered" in " ".join(res.stdout.split())


def test_a_kill_mid_merge_leaves_the_target_as_it_was(swept, tmp_path):
    shutil.copy(swept / "x.db", tmp_path / "a.db")
    run_main(["sweep", "--db", "b.db", *SWEEP, "--contexts", "128"], cwd=tmp_path)
    shutil.copy(tmp_path / "b.db", tmp_path / "t.db")
    before = stored(tmp_path / "t.db")
    r = run_to_fault(["merge", "a.db", "--db", "t.db"], tmp_path, "merge-copied")
    assert r.returncode == -9 and ("merge-copied", 1) == passed(tmp_path / "fault.log")[-1][:2]
    assert stored(tmp_path / "t.db") == before           # the transaction never committed
    assert run_main(["merge", "a.db", "--db", "t.db"], cwd=tmp_path).code == 0
    assert stored(tmp_path / "t.db") == (before[0] + FULL, before[1] + FULL)


def test_a_kill_mid_emit_leaves_the_old_config_whole(swept, tmp_path):
    shutil.copy(swept / "x.db", tmp_path / "x.db")
    args = ["emit", "--db", "x.db", "--device", "cpu", "--configs-dir", "cfg"]
    assert run_main(args, cwd=tmp_path).code == 0
    [config] = (tmp_path / "cfg").glob("*.json")
    old = config.read_bytes()
    r = run_to_fault(args, tmp_path, "emit-written")
    assert r.returncode == -9 and ("emit-written", 1) == passed(tmp_path / "fault.log")[-1][:2]
    assert config.read_bytes() == old                    # the new one was never renamed over it
    res = run_main(["show", str(config), "--device", "cpu"], cwd=tmp_path)
    assert res.code == 0, res.output[-300:]
    assert run_main(args, cwd=tmp_path).code == 0
    assert [p.name for p in (tmp_path / "cfg").iterdir()] == [config.name]   # no temp file left


def test_a_sweep_stopped_at_an_event_is_seen_in_that_state(tmp_path):
    """stop: the test acts on a known state (here: three trials stored, nothing after)."""
    p = start(["sweep", "--db", "x.db", *SWEEP], tmp_path, fault_env("trial-stored:3", "stop"))
    try:
        assert wait_stopped(p), p.communicate()[1][-400:]
        assert stored(tmp_path / "x.db") == (3, 3)
    finally:
        p.kill()
        p.communicate()


def test_a_disk_turning_read_only_mid_sweep_stops_it_in_one_line_and_a_rerun_resumes(tmp_path):
    why = strace_works()
    if why:
        pytest.skip(why)
    r = run_to_fault(["sweep", "--db", "x.db", *SWEEP], tmp_path, "trial-stored:2", "readonly")
    assert r.returncode == 1 and one_line(r.stderr), r.stderr[-600:]
    assert "the sweep stopped" in r.stderr and "rerun the same command to resume" in r.stderr
    assert ("trial-stored", 2) == [e[:2] for e in passed(tmp_path / "fault.log")
                                   if e[0] == "trial-stored"][-1]
    assert stored(tmp_path / "x.db") == (2, 2)
    res = run_main(["sweep", "--db", "x.db", *SWEEP], cwd=tmp_path)
    assert res.code == 0, res.output[-400:]
    assert stored(tmp_path / "x.db") == (FULL, FULL)


def test_an_unset_fault_point_is_one_global_test():
    from mla_tune import fault_points
    code = ("import os\nfor k in ('MLA_TUNE_FAULT_AT', 'MLA_TUNE_FAULT_LOG'): os.environ.pop(k, None)\n"
            "from mla_tune import fault_points as f\nassert f._PLAN is None\n"
            "from vllm_metax.core.tuned_config import files\nassert files.BEFORE_REPLACE is None")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert set(fault_points.EVENTS) >= {"db-created", "journal-written", "trial-prepared",
                                        "trial-stored", "merge-copied", "emit-written"}


def test_a_study_whose_creator_died_before_naming_itself_is_taken_over_soon(tmp_path):
    """A kill right after the journal's first write leaves a study with no seeder named: the
    next sweep takes it over after UNNAMED_SEEDER_S, not after the full SEED_WAIT_S (60 s)."""
    import time
    from mla_tune.families.base import Candidate
    from mla_tune.tune.sweep import shared_bucket as sb
    from mla_tune.tune.search_space import SearchSpace
    from mla_tune.tune.study_storage import open_storage, quiet_optuna
    storage = open_storage(tmp_path / "s.log")
    quiet_optuna().create_study(study_name="bucket", storage=storage)    # then the creator died
    cands = [Candidate("reference", "torch", p) for p in (16, 64, 128)]
    space = SearchSpace.build(cands, cands[:1])
    t0 = time.monotonic()
    b = sb.SharedBucket(storage, "bucket", space)
    assert b.open(space.candidates, {"mode": "grid"}) is False
    assert time.monotonic() - t0 < sb.SEED_WAIT_S / 2
    assert len(b.study.trials) == 3 and b.uid
