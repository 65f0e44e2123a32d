"""An integrity pass (issue #39): what the tool reads (stored rows, journals, storages, merge
sources, config files, typed numbers) damaged on purpose, and machine faults during a sweep.

Every case is one command on a scratch copy; it is counted as an internal error (a traceback or
"internal error"), a silent accept (exit 0 where the input is bad), a changed file (any file of
the scratch folder changed by a refused call), a hang (no answer in 60 s), a lost trial (a
resumed sweep that does not end with each candidate of each bucket stored exactly once), or a
valid input refused. Commands run in this process (tests/cli_support.run_main) except where the
process itself matters (closed stdout, /dev/full, faults), which run the console script.

    python bench/integrity_pass.py [--kinds 1,2,...]     # prints a table; exit 1 on any problem

Kinds as in the issue: 1 rows, 2 journal vs DB, 3 storage flags, 4 merge, 5 config files,
6 numbers and streams, 7 faults, each placed by an event (mla_tune.fault_points), never by a clock: a kill
at each step of a sweep, mid-merge and mid-emit; a disk turning read-only mid-sweep (strace
injects EROFS; skipped without strace); a full disk (a small tmpfs: root only; skipped otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bad_input_pass import tree  # noqa: E402  (the same file-tree fingerprint)
H200 = "NVIDIA H200"
GPU_DB = ROOT / "tests" / "data" / "triton_vs_flashinfer_h200.db"     # schema 2, 214 trials
SWEEP = ["--batches", "1,2", "--contexts", "64", "--samples", "3", "--warmup", "1",
         "--isolation", "inline", "-q", "--no-emit", "--family", "reference"]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), "COLUMNS": "120"}


class Hang(Exception):
    pass


def run(args, cwd, timeout=60):
    from cli_support import run_main

    def alarm(*_):
        raise Hang()
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    try:
        return run_main(args, cwd=cwd)
    except Hang:
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_proc(args, cwd, timeout=300, stdout=subprocess.PIPE, **kw):
    code = ("import sys; sys.path.insert(0, %r); import sweep_families; sweep_families.register(); "
            "from mla_tune.cli import main; main()" % str(ROOT / "tests"))
    try:
        r = subprocess.run([PY, "-c", code, *args], cwd=cwd, stdout=stdout, stderr=subprocess.PIPE,
                           text=True, timeout=timeout, env=ENV, **kw)
    except subprocess.TimeoutExpired:
        return None
    return r


class Tally:
    def __init__(self):
        self.cases: Counter = Counter()
        self.failures: list = []        # (kind, label, problem)

    def add(self, kind: str, label: str, problem: str | None):
        self.cases[kind] += 1
        if problem:
            self.failures.append((kind, label, problem))

    def judge(self, kind, label, res, before, after, bad=True, extra=""):
        """res: CliResult/CompletedProcess/None; bad: the input is bad (must be refused)."""
        if res is None:
            return self.add(kind, label, "hang")
        code = getattr(res, "code", getattr(res, "returncode", None))
        text = (getattr(res, "output", None) or ((res.stdout or "") + (res.stderr or "")))
        exc = getattr(res, "exception", None)
        if exc is not None or "Traceback" in text or "internal error" in text:
            return self.add(kind, label, f"internal error{extra}: {text.strip()[-160:]!r}")
        if bad and code == 0:
            return self.add(kind, label, f"silent accept: {text.strip()[-120:]!r}")
        if not bad and code != 0:
            return self.add(kind, label, f"valid refused: {text.strip()[-160:]!r}")
        if bad and len((getattr(res, "stderr", "") or "").strip().splitlines()) != 1:
            return self.add(kind, label, f"not one line: {text.strip()[-160:]!r}")
        if bad and before != after:
            diff = sorted(set(before.items()) ^ set(after.items()))
            return self.add(kind, label, f"changed files {[d[0] for d in diff][:3]}")
        self.add(kind, label, None)


# ---------------------------------------------------------------- kind 1: stored rows

ROW_CASES = {
    # label: (SQL applied to a copy, bad?)
    "params not JSON": ("update trials set params = '{\"num_kv_splits\": 4' where id = 3", True),
    "params a list": ("update trials set params = '[1, 2]' where id = 4", True),
    "params a string": ("update trials set params = '\"fa3\"' where id = 5", True),
    "params nested": ("update trials set params = '{\"a\": {\"b\": 1}}' where id = 6", True),
    "params 5000 digits": ("update trials set params = '{\"num_kv_splits\": " + "7" * 5000 + "}' where id = 7", True),
    "params empty text": ("update trials set params = '' where id = 8", True),
    "params NULL (no knobs)": ("update trials set params = NULL where params = '{}' and id in "
                               "(select min(id) from trials where params = '{}')", False),
    "page size NULL": ("update trials set page_size = NULL where id = 9", True),
    "page size text": ("update trials set page_size = 'sixty-four' where id = 10", True),
    "page size 48": ("update trials set page_size = 48 where id = 11", True),
    "page size negative": ("update trials set page_size = -64 where id = 12", True),
    "page size blob": ("update trials set page_size = x'40' where id = 13", True),
    "status unknown": ("update trials set status = 'maybe' where id = 14", True),
    "invalid without reason": ("update trials set status = 'invalid', invalid_reason = NULL where id = 15", True),
    "is_default 7": ("update trials set is_default = 7 where id = 16", True),
    "family empty": ("update trials set family = '' where id = 17", True),
    "candidate NULL": ("update trials set candidate = NULL where id = 18", True),
    "trial of no run": ("update trials set run_id = 999 where id = 19", True),
    "trial of no workload": ("update trials set workload_id = 999 where id = 20", True),
    "compile_s negative": ("update trials set compile_s = -1 where id = 21", True),
    "compile_s text": ("update trials set compile_s = 'slow' where id = 22", True),
    "run rows gone": ("delete from runs", True),
    "sample NULL": ("update samples set value = NULL where rowid = 5", True),
    "sample text": ("update samples set value = 'fast' where rowid = 6", True),
    "sample negative": ("update samples set value = -3.5 where rowid = 7", True),
    "sample infinite": ("update samples set value = 9e999 where rowid = 8", True),
    "sample of no trial": ("update samples set trial_id = 99999 where rowid = 9", True),
    "sample metric NULL": ("update samples set metric = NULL where rowid = 10", True),
    "sample idx negative": ("update samples set idx = -1 where rowid = 11", True),
    "samples value re-declared TEXT": (
        "create table s2 (trial_id INTEGER, metric TEXT, idx INTEGER, value TEXT); "
        "insert into s2 select trial_id, metric, idx, cast(value as text) from samples; "
        "drop table samples; alter table s2 rename to samples", True),
    "model NULL": ("update workloads set model = NULL where id = 2", True),
    "batch NULL": ("update workloads set batch_size = NULL where id = 3", True),
    "batch text": ("update workloads set batch_size = 'eight' where id = 4", True),
    "batch zero": ("update workloads set batch_size = 0 where id = 5", True),
    "batch huge": ("update workloads set batch_size = 1000000000000 where id = 6", True),
    "context text": ("update workloads set context_len = '4K' where id = 7", True),
    "q_len over context": ("update workloads set q_len = context_len + 1 where id = 8", True),
    "heads zero": ("update workloads set num_heads = 0 where id = 9", True),
    "dtype unknown": ("update workloads set q_dtype = 'int3' where id = 10", True),
    "kind unknown": ("update workloads set ragged = 'weird' where id = 11", True),
    "scale text": ("update workloads set softmax_scale = 'x' where id = 12", True),
    "seq_lens garbage": ("update workloads set seq_lens = 'garbage' where id = 13", True),
    "seq_lens wrong count": ("update workloads set seq_lens = '[1, 2, 3]' where id = 14", True),
    "seq_lens negative": ("update workloads set seq_lens = (select json_group_array(-5) from "
                          "(select 1 from samples limit (select batch_size from workloads where id = 15)))"
                          " where id = 15", True),
    "seq_lens strings": ("update workloads set seq_lens = (select json_group_array('a') from "
                         "(select 1 from samples limit (select batch_size from workloads where id = 16)))"
                         " where id = 16", True),
    "device NULL": ("update runs set device_name = NULL where id = (select min(id) from runs)", True),
    "copy_gbps negative": ("update runs set copy_gbps = -1 where id = (select min(id) from runs)", True),
    "run kind NULL": ("update runs set kind = NULL where id = (select min(id) from runs)", True),
    "version negative": ("update mla_tune_meta set value = '-1' where key = 'schema_version'", True),
    "version text": ("update mla_tune_meta set value = 'four' where key = 'schema_version'", True),
    "version 5000 digits": ("update mla_tune_meta set value = '" + "9" * 5000 + "' where key = 'schema_version'", True),
    "version NULL": ("update mla_tune_meta set value = NULL where key = 'schema_version'", True),
    "version 2.0": ("update mla_tune_meta set value = '2.0' where key = 'schema_version'", True),
    "version superscript": ("update mla_tune_meta set value = '²' where key = 'schema_version'", True),
    "only the meta table": ("drop table samples; drop table trials; drop table workloads; drop table runs", True),
    "no trials table": ("drop table samples; drop table trials", True),
    "trials lacks params": ("alter table trials drop column params", True),
    "valid copy": ("select 1", False),
}


def _mutated(src: Path, dst: Path, sql: str, wal: bool = False) -> None:
    shutil.copy(src, dst)
    c = sqlite3.connect(dst)
    c.executescript(sql)
    if wal:
        c.execute("pragma journal_mode=wal")
    c.commit()
    c.close()
    for side in ("-wal", "-shm"):
        Path(f"{dst}{side}").unlink(missing_ok=True)


def kind_rows(t: Tally, w: Path, cpu_db: Path):
    for label, (sql, bad) in ROW_CASES.items():
        for base_name, base in (("gpu", GPU_DB), ("cpu", cpu_db)):
            d = w / f"rows-{base_name}"
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            try:
                _mutated(base, d / "x.db", sql)
            except sqlite3.Error:
                continue            # a column this DB's schema has not (seq_lens before schema 4)
            plain = d / "plain.db"
            _mutated(base, plain, "select 1")
            same = plain.read_bytes() == (d / "x.db").read_bytes()
            plain.unlink()
            if bad and same:
                continue            # the small DB has no row the statement changes
            if not bad and base_name == "cpu" and "params" in label:
                continue
            device = H200 if base_name == "gpu" else "cpu"
            calls = [["report", "--db", "x.db"], ["report", "--db", "x.db", "-f", "json"],
                     ["emit", "--db", "x.db", "--device", device, "--out", "out"],
                     ["sweep", "--replay", "x.db", "-q", "--device-name", device],
                     ["merge", "x.db", "--db", "merged.db"]]
            if base_name == "cpu":
                calls.append(["sweep", "--db", "x.db", *SWEEP])
            for args in calls:
                before = tree(d)
                res = run(args, d)
                after = tree(d)
                if not bad:
                    t.judge("1 rows", f"{label} ({base_name}): {args[0]}", res, before, after, bad=False)
                else:
                    t.judge("1 rows", f"{label} ({base_name}): {' '.join(args[:2])}", res, before, after)
                for f in ("out", "merged.db"):
                    p = d / f
                    if p.is_dir():
                        shutil.rmtree(p)
                    elif p.exists():
                        p.unlink()


# ---------------------------------------------------------------- kind 2: journal vs DB

def _stored(db: Path) -> tuple[int, int]:
    c = sqlite3.connect(db)
    n, distinct = c.execute("select count(*), count(distinct workload_id || ' ' || candidate) "
                            "from trials").fetchone()
    c.close()
    return n, distinct


def kind_journal(t: Tally, w: Path, cpu_db: Path):
    full = _stored(cpu_db)[1]

    def scenario(label, damage, expect_ok=True, reruns=2):
        d = w / "journal"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        shutil.copy(cpu_db, d / "x.db")
        shutil.copy(cpu_db.with_name(cpu_db.stem + ".optuna.log"), d / "x.optuna.log")
        damage(d)
        for i in range(reruns):
            before = tree(d)
            res = run(["sweep", "--db", "x.db", *SWEEP], d, timeout=240)
            if not expect_ok:
                t.judge("2 journal", f"{label} (run {i + 1})", res, before, tree(d), bad=True)
                return
            t.judge("2 journal", f"{label} (run {i + 1})", res, before, tree(d), bad=False)
            if res is not None and res.code == 0:
                n, distinct = _stored(d / "x.db")
                if n != distinct or distinct != full:
                    t.add("2 journal", f"{label} (run {i + 1}) stored", f"lost trials: {n} rows, "
                          f"{distinct} distinct, {full} expected")

    def cut(frac):
        def f(d):
            j = d / "x.optuna.log"
            data = j.read_bytes()
            pos = int(len(data) * frac)
            while data[pos:pos + 1] in (b"\n", b""):
                pos -= 1
            j.write_bytes(data[:pos])
        return f

    def garble(d):
        j = d / "x.optuna.log"
        lines = j.read_bytes().splitlines(keepends=True)
        lines[len(lines) // 2] = lines[len(lines) // 2][:20] + b"\n"
        j.write_bytes(b"".join(lines))

    def delete_trial(which):
        def f(d):
            c = sqlite3.connect(d / "x.db")
            tid = c.execute(f"select {which}(id) from trials").fetchone()[0]
            c.execute("delete from samples where trial_id = ?", [tid])
            c.execute("delete from trials where id = ?", [tid])
            c.commit()
            c.close()
        return f

    def delete_runs(d):
        c = sqlite3.connect(d / "x.db")
        c.execute("delete from runs")
        c.commit()
        c.close()

    def no_journal(d):
        (d / "x.optuna.log").unlink()

    def empty_journal(d):
        (d / "x.optuna.log").write_bytes(b"")

    scenario("journal cut mid-line (end)", cut(0.999))
    scenario("journal cut mid-line (middle)", cut(0.5))
    scenario("journal line garbled in the middle", garble)
    scenario("trial deleted (first)", delete_trial("min"))
    scenario("trial deleted (last)", delete_trial("max"))
    scenario("run rows gone", delete_runs, expect_ok=False)
    scenario("journal removed", no_journal)
    scenario("journal emptied", empty_journal)


# ---------------------------------------------------------------- kind 3: storage flags

def kind_storage(t: Tally, w: Path, cpu_db: Path):
    d = w / "storage"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    (d / "notes.txt").write_text("my notes\nline two\n")
    shutil.copy(cpu_db, d / "results.db")
    (d / "blob.bin").write_bytes(os.urandom(2000))
    sqlite3.connect(d / "other.sqlite").execute("create table t (x)").connection.close()
    base = ["sweep", "--db", "new.db", *SWEEP]
    cases = [["--storage", "notes.txt"], ["--storage", "results.db"], ["--storage", "blob.bin"],
             ["--storage", ""], ["--storage", " "], ["--storage", f"sqlite:///{d / 'results.db'}"],
             ["--storage", f"sqlite:///{d / 'other.sqlite'}"], ["--storage", f"sqlite:///{d / 'notes.txt'}"],
             ["--storage", "nosuchdialect://x/y"], ["--storage", "postgresql://"],
             ["--storage", str(d)], ["--storage", "/dev/null"],
             ["--heartbeat", "0"], ["--heartbeat", "99999999"], ["--heartbeat", "10"],
             ["--heartbeat", "5", "--storage", "j.log"],
             ["--gpus", "²"], ["--gpus", "0,²"], ["--gpus", "٣"], ["--gpus", "1" * 5000],
             ["--gpus", "0,,1"], ["--gpus", "-1"]]
    for extra in cases:
        before = tree(d)
        res = run(base + extra, d)
        t.judge("3 storage", " ".join(x[:40] for x in extra), res, before, tree(d))
    # one file for two roles (#52), however spelt: refused before anything is written; each call
    # in a fresh folder (an accepted one may have replaced a link by a file)
    two_roles = [["--db", "new.db", "--journal", "new.db"], ["--db", "new.db", "--storage", "new.db"],
                 ["--db", "new.db", "--storage", "sqlite:///new.db"],
                 ["--db", "new.db", "--storage", "sqlite:///ABS/new.db"],
                 ["--db", "./new.db", "--journal", "new.db"], ["--db", "new.db", "--journal", "link-new.db"],
                 ["--db", "new.db", "--journal", "sub/../new.db"],
                 ["--db", "results.db", "--journal", "hard-results.db"],
                 ["--db", "results.db", "--storage", "link-results.db"],
                 ["--db", "new.db", "--emit", "--configs-dir", "new.db"],
                 ["--db", "new.db", "--gpus", "0,1", "--storage", "link-new.db"],
                 ["--db", "dangling.db"], ["--db", "new.db", "--journal", "dangling.db"]]
    sweep = [a for a in SWEEP if a != "--no-emit"]
    calls = [["sweep", *sweep, *extra] + ([] if "--emit" in extra else ["--no-emit"]) for extra in two_roles]
    calls += [["merge", "results.db", "--db", "results.db"], ["merge", "./results.db", "--db", "results.db"],
              ["merge", "results.db", "--db", "link-results.db"],
              ["merge", "hard-results.db", "--db", "ABS/results.db"],
              ["merge", "results.db", "--db", "dangling.db"],
              ["emit", "--db", "results.db", "--configs-dir", "./results.db"],
              ["report", "--db", "results.db", "--plot", "link-results.db"]]
    r = w / "roles"
    for args in calls:
        shutil.rmtree(r, ignore_errors=True)
        (r / "sub").mkdir(parents=True)
        (r / "elsewhere").mkdir()
        shutil.copy(cpu_db, r / "results.db")
        os.link(r / "results.db", r / "hard-results.db")
        os.symlink("new.db", r / "link-new.db")
        os.symlink("results.db", r / "link-results.db")
        os.symlink("elsewhere/t.db", r / "dangling.db")
        args = [a.replace("ABS", str(r)) for a in args]
        before = tree(r)
        res = run(args, r)
        label = " ".join(args[len(sweep) + 1:] if args[0] == "sweep" else args).replace(str(r), "ABS")
        t.judge("3 storage", "two roles: " + label, res, before, tree(r))


# ---------------------------------------------------------------- kind 4: merge

def kind_merge(t: Tally, w: Path, cpu_db: Path):
    d = w / "merge"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    src = d / "src"
    src.mkdir()
    _mutated(GPU_DB, src / "wal.db", "select 1", wal=True)
    _mutated(cpu_db, src / "walcpu.db", "select 1", wal=True)
    # a good WAL-mode source: merged, and nothing appears beside it
    for name in ("wal.db", "walcpu.db"):
        before = tree(src)
        res = run(["merge", str(src / name), "--db", str(d / "t.db")], d)
        t.judge("4 merge", f"good WAL source {name}", res, before, before, bad=False)
        if tree(src) != before:
            t.add("4 merge", f"good WAL source {name}: source folder", "changed files")
    # refused merges: nothing beside the sources, no target made
    _mutated(GPU_DB, src / "bad-params.db", ROW_CASES["params not JSON"][0], wal=True)
    _mutated(GPU_DB, src / "bad-sample.db", ROW_CASES["sample text"][0], wal=True)
    _mutated(GPU_DB, src / "bad-orphan.db", ROW_CASES["trial of no run"][0], wal=True)
    _mutated(GPU_DB, src / "bad-version.db", ROW_CASES["version 5000 digits"][0], wal=True)
    _mutated(cpu_db, src / "bad-lens.db", ROW_CASES["batch zero"][0].replace("id = 5", "id = 1"), wal=True)
    _mutated(GPU_DB, src / "only-meta.db", ROW_CASES["only the meta table"][0], wal=True)
    os.mkfifo(src / "fifo.db")
    (src / "notes.db").write_text("notes")
    for name in ("bad-params.db", "bad-sample.db", "bad-orphan.db", "bad-version.db", "bad-lens.db",
                 "only-meta.db", "fifo.db", "notes.db"):
        for target in ("new.db", "t.db"):
            before = tree(d)
            res = run(["merge", str(src / "wal.db"), str(src / name), "--db", str(d / target)], d,
                      timeout=30)
            t.judge("4 merge", f"{name} into {target}", res, before, tree(d))
    # a read-only folder (a bind mount: root ignores permission bits), holding a clean DB and
    # one a killed writer left with its -wal (a committed trial) and -shm beside it
    ro = d / "ro"
    ro.mkdir()
    shutil.copy(src / "wal.db", ro / "wal.db")
    shutil.copy(cpu_db, ro / "killed.db")
    _killed_writer(ro / "killed.db")
    if subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True).returncode == 0 \
            and subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode == 0:
        try:
            for name in ("wal.db", "killed.db"):
                before = stamps(ro)
                res = run(["report", "--db", str(ro / name), "-f", "json"], d)
                t.judge("4 merge", f"report of {name} in a read-only folder", res, {}, {}, bad=False)
                if name == "killed.db" and res is not None and "only-in-the-wal" not in res.stdout:
                    t.add("4 merge", "report of killed.db: the -wal's commit", "lost trials (not read)")
                res = run(["merge", str(ro / name), "--db", str(d / f"t2-{name}")], d)
                t.judge("4 merge", f"merge of {name} in a read-only folder", res, {}, {}, bad=False)
                if stamps(ro) != before:
                    t.add("4 merge", f"{name} in a read-only folder", "changed files (bytes or mtimes)")
        finally:
            subprocess.run(["umount", str(ro)])
    # the case: a user who owns the files (SQLite could open -shm for writing) but may not
    # write the folder; as root, the report runs as nobody (setpriv), since chmod does not stop root
    open_dir = Path(tempfile.mkdtemp(prefix="mla-integrity-ro-"))
    try:
        os.chmod(open_dir, 0o755)
        shutil.copy(cpu_db, open_dir / "w.db")
        _killed_writer(open_dir / "w.db")
        cmd = [PY, "-m", "mla_tune", "report", "--db", str(open_dir / "w.db"), "-f", "json"]
        if os.geteuid() == 0:
            for f in open_dir.iterdir():
                os.chown(f, 65534, 65534)
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + cmd
        else:
            os.chmod(open_dir, 0o555)
        before = stamps(open_dir)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/",
                           env={**ENV, "HOME": str(open_dir.parent)})
        os.chmod(open_dir, 0o755)
        t.judge("4 merge", "report as a user who may not write the folder (-wal, -shm left)", r, {}, {},
                bad=False)
        if r.returncode == 0 and "only-in-the-wal" not in r.stdout:
            t.add("4 merge", "report as that user: the -wal's commit", "lost trials (not read)")
        if stamps(open_dir) != before:
            t.add("4 merge", "report as a user who may not write the folder",
                  "changed files (bytes or mtimes of db, -wal, -shm)")
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


def _killed_writer(db: Path) -> None:
    """A writer killed after a commit: its -wal (holding the commit) and -shm stay beside db."""
    code = ("import os, sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
            "c.execute('pragma journal_mode=wal'); "
            "c.execute(\"update trials set message = 'only-in-the-wal' where id = 1\"); c.commit(); "
            "os.kill(os.getpid(), 9)")
    subprocess.run([PY, "-c", code, str(db)])


def stamps(root: Path) -> dict:
    """Content hash and mtime of every file below root."""
    return {k: (v, (root / k).stat().st_mtime_ns if v not in ("dir", "special") else None)
            for k, v in tree(root).items()}


# ---------------------------------------------------------------- kind 5: config files

def kind_configs(t: Tally, w: Path, cpu_db: Path):
    from vllm_metax.core import tuned_config as tc
    d = w / "configs"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    good = (ROOT / "configs" / "device_name=NVIDIA_H200.json").read_text()
    doc = json.loads(good)
    g = json.dumps(doc["models"][0]["global"])
    cases = {
        "page size twice": good.replace('"global": {', '"global": {"page_size": 16, ', 1),
        "device twice": good.replace('"device_name":', '"device_name": "NVIDIA H100", "device_name":', 1),
        "top-level twice": good.rstrip().rstrip("}") + ', "schema_version": 1}',
        "bucket key twice": good.replace('"batch_size":', '"batch_size": 1, "batch_size":', 1),
        "models empty": json.dumps({**doc, "models": []}),
        "models one empty object": json.dumps({**doc, "models": [{}]}),
        "valid": good,
    }
    assert g
    for label, text in cases.items():
        f = d / "device_name=NVIDIA_H200.json"
        f.write_text(text)
        before = tree(d)
        res = run(["show", str(f), "--device", H200], d)
        t.judge("5 configs", f"show: {label}", res, before, tree(d), bad=label != "valid")
        # the plugin: one warning and the untuned fallback, never an exception
        os.environ[tc.FOLDER_ENV] = str(d)
        os.environ.pop(tc.STRICT_ENV, None)
        try:
            r = tc.resolve_tuned_config(H200)
            ok = (r.config is None and r.reason.startswith("ignored")) if label != "valid" else r.config is not None
            t.add("5 configs", f"plugin: {label}", None if ok else
                  ("silent accept" if label != "valid" else "valid refused") + f": {r.reason!r}")
        except Exception as e:  # noqa: BLE001
            t.add("5 configs", f"plugin: {label}", f"internal error: {type(e).__name__}: {e}")
        finally:
            os.environ.pop(tc.FOLDER_ENV, None)


# ---------------------------------------------------------------- kind 6: numbers and streams

def kind_numbers(t: Tally, w: Path, cpu_db: Path):
    d = w / "numbers"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    shutil.copy(ROOT / "configs" / "device_name=NVIDIA_H200.json", d / "h200.json")
    shutil.copy(cpu_db, d / "r.db")
    (d / "lens-sup.csv").write_text("context_len\n12\n²\n")
    (d / "lens-huge.csv").write_text("context_len\n12\n" + "9" * 5000 + "\n")
    (d / "lens-arabic.csv").write_text("٣٤\n")
    (d / "lens-fullwidth.csv").write_text("１２\n")
    (d / "mix-sup.csv").write_text("1,64,²\n")
    (d / "mix-huge.csv").write_text("1," + "6" * 5000 + ",1\n")
    cases = [["show", "h200.json", "--device", H200, "--lookup", "²,64"],
             ["show", "h200.json", "--device", H200, "--lookup", "1,٦٤"],
             ["show", "h200.json", "--device", H200, "--lookup", "1," + "9" * 5000],
             ["bench", "reference/torch/p¹⁶", "--device", "cpu", "--no-store", "--heads", "2"],
             ["bench", "reference/torch/p16/k=²", "--device", "cpu", "--no-store", "--heads", "2"],
             ["bench", "triton/triton/p16/num_kv_splits=٤", "--device", "cpu", "--no-store", "--heads", "2"],
             ["sweep", "--db", "n.db", *SWEEP, "--lengths", "lens-sup.csv"],
             ["sweep", "--db", "n.db", *SWEEP, "--lengths", "lens-huge.csv"],
             ["sweep", "--db", "n.db", *SWEEP, "--lengths", "lens-arabic.csv"],
             ["sweep", "--db", "n.db", *SWEEP, "--lengths", "lens-fullwidth.csv"],
             ["sweep", "--db", "n.db", *SWEEP, "--batches", "²"],
             ["sweep", "--db", "n.db", *SWEEP, "--contexts", "6⁴"],
             ["report", "--db", "r.db", "--mix", "mix-sup.csv"],
             ["report", "--db", "r.db", "--mix", "mix-huge.csv"],
             ["report", "--db", "r.db", "--run", "²"]]
    for args in cases:
        before = tree(d)
        res = run(args, d)
        t.judge("6 numbers", " ".join(a[:30] for a in args[:6]), res, before, tree(d))
    # streams: the console script in its own process
    for label, kw in (("stdout /dev/full", {"stdout": open("/dev/full", "w")}),
                      ("stdout closed", {"stdout": subprocess.DEVNULL, "close_stdout": True})):
        for args in (["report", "--db", "r.db"], ["show", "h200.json", "--device", H200]):
            if kw.get("close_stdout"):
                code = ("import os, sys; os.close(1); sys.path.insert(0, %r); "
                        "os.execv(%r, [%r, '-m', 'mla_tune'] + sys.argv[1:])"
                        % (str(ROOT / "tests"), PY, PY))
                r = subprocess.run([PY, "-c", code, *args], cwd=d, stderr=subprocess.PIPE, text=True,
                                   timeout=300, env=ENV, stdout=subprocess.DEVNULL)
            else:
                r = subprocess.run([PY, "-m", "mla_tune", *args], cwd=d, stderr=subprocess.PIPE,
                                   text=True, timeout=300, env=ENV, stdout=kw["stdout"])
            r.stdout = ""
            t.judge("6 numbers", f"{label}: {args[0]}", r, {}, {})


# ---------------------------------------------------------------- kind 7: faults

def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _fill(folder: Path) -> Path:
    filler = folder / "filler"
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
    except OSError:
        pass                    # full
    return filler


def kind_faults(t: Tally, w: Path, cpu_db: Path):
    """Every fault placed by an event (mla_tune.fault_points), never by a clock: a kill at each
    step of a sweep, a merge and an emit; a disk that fills up or turns read-only mid-sweep.
    Each case checks that its event happened before its fault, then that a rerun loses nothing."""
    from fault_support import fault_env, passed, start, strace_works, wait_stopped
    long = ["--batches", "1,2,4,8", "--contexts", "64,128", "--samples", "3", "--warmup", "1",
            "--isolation", "inline", "-q", "--no-emit", "--family", "sleepy"]
    full = 24                          # 8 buckets x 3 page sizes

    def event_seen(label, log, event):
        name, _, n = event.partition(":")
        if not any(e[:2] == (name, int(n or 1)) for e in passed(log)):
            t.add("7 faults", label, f"fault missed its event {event}: {passed(log)[-3:]}")
            return False
        return True

    def resumed(label, folder, db="x.db", expect=full):
        r = run_proc(["sweep", "--db", db, *long], folder)
        t.judge("7 faults", f"{label}: resumed", r, {}, {}, bad=False)
        if (folder / db).exists():
            n, distinct = _stored(folder / db)
            if n != distinct or distinct != expect:
                t.add("7 faults", f"{label}: stored once", f"lost trials: {n} rows, {distinct} distinct")

    # a kill -9 at each step of a sweep
    for event in ("db-created", "journal-written:1", "trial-prepared:2", "trial-stored:3"):
        d = w / f"kill-{event.replace(':', '-')}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        log = d.parent / f"{d.name}.log"
        p = start(["sweep", "--db", "x.db", *long], d, fault_env(event, "kill", log, ENV))
        try:
            p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            t.add("7 faults", f"kill at {event}", "hang")
            continue
        if p.returncode != -9:
            t.add("7 faults", f"kill at {event}", f"the fault never struck (exit {p.returncode})")
            continue
        if event_seen(f"kill at {event}", log, event):
            t.add("7 faults", f"kill at {event}", None)
            resumed(f"kill at {event}", d)
    # a kill mid-merge: the target as it was; merged again, complete
    d = w / "kill-merge"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    shutil.copy(cpu_db, d / "a.db")
    shutil.copy(GPU_DB, d / "t.db")
    before = _stored(d / "t.db")
    log = w / "kill-merge.log"
    p = start(["merge", "a.db", "--db", "t.db"], d, fault_env("merge-copied", "kill", log, ENV))
    p.communicate(timeout=300)
    if p.returncode == -9 and event_seen("kill mid-merge", log, "merge-copied"):
        t.add("7 faults", "kill mid-merge: target unchanged",
              None if _stored(d / "t.db") == before else "changed files (half a merge)")
        r = run_proc(["merge", "a.db", "--db", "t.db"], d)
        t.judge("7 faults", "kill mid-merge: merged again", r, {}, {}, bad=False)
        if _stored(d / "t.db")[0] != before[0] + _stored(cpu_db)[0]:
            t.add("7 faults", "kill mid-merge: merged again", f"lost trials: {_stored(d / 't.db')}")
    else:
        t.add("7 faults", "kill mid-merge", f"the fault never struck (exit {p.returncode})")
    # a kill mid-emit: the config written before is whole
    d = w / "kill-emit"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    shutil.copy(cpu_db, d / "x.db")
    emit = ["emit", "--db", "x.db", "--device", "cpu", "--configs-dir", "cfg"]
    r = run_proc(emit, d)
    t.judge("7 faults", "emit before the kill", r, {}, {}, bad=False)
    old = tree(d / "cfg")
    log = w / "kill-emit.log"
    p = start(emit, d, fault_env("emit-written", "kill", log, ENV))
    p.communicate(timeout=300)
    if p.returncode == -9 and event_seen("kill mid-emit", log, "emit-written"):
        now = {k: v for k, v in tree(d / "cfg").items() if not k.endswith(".tmp")}
        t.add("7 faults", "kill mid-emit: old config whole", None if now == old else "changed files")
        r = run_proc(emit, d)
        t.judge("7 faults", "kill mid-emit: emitted again", r, {}, {}, bad=False)
        if set(tree(d / "cfg")) != set(old):
            t.add("7 faults", "kill mid-emit: emitted again", f"left {sorted(tree(d / 'cfg'))}")
    else:
        t.add("7 faults", "kill mid-emit", f"the fault never struck (exit {p.returncode})")
    # a disk turning read-only mid-sweep: strace injects EROFS into every write to the folder's
    # files (a remount is refused while the sweep holds them open: EBUSY)
    why = strace_works()
    if why:
        print(f"read-only mid-sweep skipped: {why}", file=sys.stderr)
    else:
        d = w / "readonly"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        log = w / "readonly.log"
        p = start(["sweep", "--db", "x.db", *long], d, fault_env("trial-stored:3", "readonly", log, ENV))
        try:
            out, err = p.communicate(timeout=300)
            if event_seen("read-only mid-sweep", log, "trial-stored:3"):
                t.judge("7 faults", "read-only mid-sweep: the sweep",
                        subprocess.CompletedProcess(p.args, p.returncode, out, err), {}, {}, bad=True)
                resumed("read-only mid-sweep", d)
        except subprocess.TimeoutExpired:
            p.kill()
            t.add("7 faults", "read-only mid-sweep", "hang")
    # a stale .new file left by a kill during DB creation: the next sweep removes it
    stale = w / f".k.db.{2 ** 22 - 7}.deadbeef.new"
    stale.write_bytes(b"SQLite format 3\0")
    r = run(["sweep", "--db", "k.db", *SWEEP], w, timeout=240)
    t.judge("7 faults", "stale .new after a kill", r, {}, {}, bad=False)
    if stale.exists():
        t.add("7 faults", "stale .new after a kill: removed", "changed files (left behind)")
    # a full disk (a small tmpfs: root only): filled when the DB exists and after 3 trials
    mnt = w / "mnt"
    if os.geteuid() != 0 or not _mount_tmpfs(mnt, "400k"):
        print("full disk skipped: needs root for a tmpfs", file=sys.stderr)
        return
    try:
        for label, event in (("full at start", "db-created"), ("full mid-sweep", "trial-stored:3")):
            subprocess.run(["mount", "-o", "remount,size=400k", str(mnt)])
            for f in mnt.iterdir():
                f.unlink()
            log = w / f"{label}.log"
            p = start(["sweep", "--db", "x.db", *long], mnt, fault_env(event, "stop", log, ENV))
            if not wait_stopped(p) or not event_seen(label, log, event):
                t.add("7 faults", label, f"the sweep never stopped at {event} (exit {p.returncode})")
                p.communicate()
                continue
            filler = _fill(mnt)
            os.kill(p.pid, signal.SIGCONT)
            try:
                out, err = p.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                p.kill()
                t.add("7 faults", label, "hang")
                continue
            r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
            t.judge("7 faults", f"{label}: the sweep", r, {}, {}, bad=True)
            filler.unlink(missing_ok=True)
            subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)])
            resumed(label, mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


# ---------------------------------------------------------------- main

KINDS = {"1": kind_rows, "2": kind_journal, "3": kind_storage, "4": kind_merge, "5": kind_configs,
         "6": kind_numbers, "7": kind_faults}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args()
    import sweep_families
    sweep_families.register()
    w = Path(tempfile.mkdtemp(prefix="mla-integrity-"))
    try:
        res = run(["sweep", "--db", "cpu.db", *SWEEP], w, timeout=600)
        if res is None or res.code != 0:
            print("could not build the CPU DB:", res and res.output[-500:])
            return 1
        t = Tally()
        for k in args.kinds.split(","):
            t0 = time.monotonic()
            KINDS[k](t, w, w / "cpu.db")
            print(f"kind {k}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        cols = ["cases", "internal error", "silent accept", "changed files", "hang", "lost trials",
                "valid refused", "not one line", "fault missed its event"]
        print("| kind | " + " | ".join(cols) + " |")
        print("|" + "---|" * (len(cols) + 1))
        for kind in sorted(t.cases):
            counts = Counter(next((x for x in cols[1:] if p.startswith(x)), "other")
                             for k, _, p in t.failures if k == kind)
            print(f"| {kind} | {t.cases[kind]} | " + " | ".join(str(counts[x]) for x in cols[1:]) + " |")
        for kind, label, problem in t.failures:
            print(f"FAIL [{kind}] {label}: {problem}"[:400])
        return 1 if t.failures else 0
    finally:
        subprocess.run(["umount", "-l", str(w / "mnt")], capture_output=True)
        shutil.rmtree(w, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
