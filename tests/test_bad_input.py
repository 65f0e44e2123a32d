"""Bad input over every command and over tuned-config files, as a new user would type it.

Every case goes through the console script's `main()` in this process and must end in exit 2 with
one clear line: no traceback, no "internal error", no exit 0 (a silent accept), and no change to
any file: a good results.db (checksummed), the working folder (every file hashed, nothing new)
and the packaged configs stay exactly as they were. Config files are also fuzzed with hypothesis:
whatever a file holds, the reader raises its own error or returns a config inside the schema's
ranges, and the plugin's lenient lookup never raises.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli_support import one_line, run_main
from mla_tune.tune.emit import emit_config
from mla_tune.store.results import ResultsStore
from results_fixture import H200, build_fixture_db
from vllm_metax.core import choices
from vllm_metax.core import tuned_config as tc

NUMBERS_BAD = ["0", "-1", "nan", "inf", "-inf", "1e400", "9" * 5000, "", "x", "1.5"]


def _tree(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            out[rel] = "special"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A working folder with a good results.db, a good config and mix, and every kind of bad file."""
    w = tmp_path_factory.mktemp("bad-input")
    build_fixture_db(w / "good.db")
    with ResultsStore(w / "good.db", create=False) as s:
        cfg_path = emit_config(s, w / "cfgs", device=H200)
    (w / "good.json").write_bytes(cfg_path.read_bytes())
    (w / "mix.csv").write_text("batch,context,weight\n1,1024,2\n8,4096,1\n")
    (w / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (w / "latin1.csv").write_bytes("1,1024,1\n# caf\xe9\n".encode("latin-1"))
    (w / "empty.txt").write_text("")
    (w / "folder").mkdir()
    (w / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (w / "hugeint.json").write_text('{"schema_version": ' + "9" * 10_000 + "}")
    (w / "nan.csv").write_text("1,1024,nan\n")
    (w / "negweight.csv").write_text("1,1024,-3\n")
    (w / "hugeint.csv").write_text("1," + "9" * 5000 + ",1\n")
    (w / "notswept.csv").write_text("3,777,1\n")
    (w / "zero.csv").write_text("1,1024,0\n")
    (w / "notes.db").write_text("my notes\n")
    sqlite3.connect(w / "empty-sqlite.db").execute("pragma user_version = 1").connection.close()
    foreign = sqlite3.connect(w / "foreign.db")
    foreign.execute("create table accounts (id int)")
    foreign.commit()
    foreign.close()
    (w / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    return w


def _cases(w: Path) -> list[list[str]]:
    db, good = str(w / "good.db"), str(w / "good.json")
    paths_bad_in = [str(w / "folder"), "/dev/zero", str(w / "missing.db"), str(w / "binary.bin"),
                    str(w / "notes.db"), str(w / "empty-sqlite.db"), str(w / "foreign.db"),
                    str(w / "empty.txt"), ""]
    cases: list[list[str]] = []
    # ---- report
    for p in paths_bad_in:
        cases.append(["report", "--db", p])
    for p in [db, str(w / "folder"), "/nonexistent-mla-tune-dir/x.png", str(w / "binary.bin"),
              "/dev/null", str(w / "foreign.db"), str(w / "sub" / "plot.txt"), ""]:
        cases.append(["report", "--db", db, "--plot", p])
    for v in ["0", "-1", "x", "9" * 5000, "99999999999999999999"]:
        cases.append(["report", "--db", db, "--run", v])
    for opt in ("--device", "--model"):
        cases += [["report", "--db", db, opt, ""], ["report", "--db", db, opt, "\x1b[31m"]]
    for m in ["binary.bin", "latin1.csv", "nan.csv", "negweight.csv", "hugeint.csv", "notswept.csv",
              "zero.csv", "folder", "missing.csv", "deep.json"]:
        cases.append(["report", "--db", db, "--mix", str(w / m)])
    cases.append(["report", "--db", db, "--mix", "/dev/zero"])
    cases.append(["report", "--db", db, "--format", "yaml"])
    # ---- emit (never into the working folder's files; --device names one of the fixture's)
    base = ["emit", "--db", db, "--device", H200]
    for p in paths_bad_in:
        cases.append(["emit", "--db", p, "--device", H200])
    for out in [str(w / "good.json"), "/nonexistent-mla-tune-dir/cfgs", "/dev/null", ""]:
        cases.append(base + ["--out", out])
    cases.append(["emit", "--db", db, "--device", H200, "--all-devices", "--out", str(w / "o")])
    cases.append(["emit", "--db", db, "--device", "../../etc", "--out", str(w / "o")])
    cases.append(base + ["--mix", str(w / "nan.csv"), "--out", str(w / "o")])
    cases.append(base + ["--run", "0", "--out", str(w / "o")])
    # ---- show
    for p in paths_bad_in + [str(w / "deep.json"), str(w / "hugeint.json"), str(w / "mix.csv")]:
        cases.append(["show", p])
    for lk in ["8", "0,1024", "1,2,3,4", "x,y", "9" * 5000 + ",1", "1,99999999999", "-1,1024", ""]:
        cases.append(["show", good, "--lookup", lk, "--device", H200])
    cases.append(["show", good, "--device", "../../x"])
    cases.append(["show", good, "--device", ""])
    cases.append(["show", good, "--format", "xml", "--device", H200])
    # ---- doctor
    for v in NUMBERS_BAD:
        cases.append(["doctor", "--tp", v])
    cases.append(["doctor", "--model", ""])
    cases.append(["doctor", "--format", "html"])
    # ---- bench (each refused before it measures)
    bench = ["bench", "reference/torch/p16", "--device", "cpu", "--db", str(w / "bench.db"),
             "--heads", "2"]
    for cand in ["reference/torch/p0", "reference/torch/p3", "reference/torch/p" + "9" * 40,
                 "flashinfer/fa9/p64", "triton/triton/p64/num_kv_splits=0", "triton/triton/p64",
                 "triton/triton/p64/num_kv_splits=" + "9" * 5000, "reference/torch/p16/k=v",
                 "nofamily/x/p16", "nonsense", "/", "reference//p16", "flashinfer/fa3/p-1",
                 "flashinfer/auto/p64/backend=fa3"]:
        cases.append(["bench", cand, "--device", "cpu", "--no-store", "--heads", "2"])
    for opt in ("--batch", "--context"):
        for v in ["0", "-1", "", ",", "1,,2", "x", "9" * 5000, "100000000"]:
            cases.append(bench + [opt, v])
    for opt in ("--heads", "--samples", "--rounds", "--warmup", "--plan-samples", "--q-len"):
        for v in ["-1", "nan", "x", "9" * 5000, "99999999"]:
            cases.append(bench + [opt, v])
    cases.append(bench + ["--batch", "65536", "--context", "4000000"])
    cases.append(["bench", "reference/torch/p16", "--device", "cpu", "--heads", "2", "--tp", "8",
                  "--no-store"])
    cases.append(["bench", "reference/torch/p16", "--device", "cpu", "--heads", "2", "--no-store",
                  "--db", str(w / "bench.db")])
    cases.append(bench + ["--device", "tpu"])
    cases.append(bench + ["--format", "xml"])      # csv and markdown are bench formats now (#38)
    for p in [str(w / "folder"), str(w / "notes.db"), str(w / "foreign.db"), "/dev/null",
              str(w / "empty-sqlite.db"), "/nonexistent-mla-tune-dir/r.db"]:
        cases.append(["bench", "reference/torch/p16", "--device", "cpu", "--heads", "2", "--db", p,
                      "--batch", "1", "--context", "16", "--samples", "2"])
    # ---- sweep (small CPU space; each refused before it writes anything)
    sweep = ["sweep", "--db", str(w / "new.db"), "--batches", "1", "--contexts", "64",
             "--samples", "3", "--warmup", "1", "--isolation", "inline", "-q", "--no-emit"]
    for opt in ("--seed", "--samples", "--warmup", "--timeout", "--min-ratio", "--grid-max",
                "--trials", "--patience", "--tp", "--q-len", "--page-size"):
        for v in NUMBERS_BAD:
            if v == "0" and opt in ("--patience", "--seed", "--warmup"):
                continue                          # good values: never stop early, seed 0, no warm-up
            if v == "1.5" and opt in ("--timeout", "--min-ratio"):
                continue
            cases.append(sweep + [opt, v])
    for v in ["3", "1024", "512", str(2 ** 40)]:
        cases.append(sweep + ["--page-size", v])
    for v in ["4294967296", "-5"]:
        cases.append(sweep + ["--seed", v])
    for opt in ("--batches", "--contexts"):
        for v in ["", "0", "-", "1-", "x", "9" * 5000, "1-99999999999", ",", "1,,4"]:
            cases.append(sweep + [opt, v])
    for opt, v in [("--time-budget", "x"), ("--time-budget", "9" * 400 + "h"), ("--name", ""),
                   ("--model", ""), ("--family", ""), ("--family", "nope"), ("--ragged", "zipff"),
                   ("--lengths", str(w / "folder")), ("--lengths", str(w / "binary.bin")),
                   ("--lengths", str(w / "nan.csv")),
                   ("--q-dtype", "fp8"), ("--mode", "fast"), ("--isolation", "threads"),
                   ("--device-name", "x")]:
        cases.append(sweep + [opt, v])
    for p in [str(w / "folder"), str(w / "notes.db"),
              str(w / "foreign.db"), str(w / "plot.png"), "/dev/null",
              "/nonexistent-mla-tune-dir/r.db"]:
        cases.append(sweep + ["--db", p])
    for p in [str(w / "folder"), db, str(w / "notes.db"), str(w / "binary.bin"), "/dev/null",
              "/nonexistent-mla-tune-dir/j.log"]:
        cases.append(sweep + ["--journal", p])
    for m in ["binary.bin", "nan.csv", "notswept.csv", "zero.csv", "hugeint.csv", "folder"]:
        cases.append(sweep + ["--mix", str(w / m)])
    cases.append(sweep + ["--emit"])                       # CPU config without a folder named
    cases.append(sweep + ["--configs-dir", str(w / "o")])  # ignored: --no-emit
    cases.append([a for a in sweep if a != "--no-emit"] + ["--configs-dir", str(w / "o")])
    cases.append(sweep + ["--emit", "--configs-dir", str(w / "good.json")])
    cases.append(sweep + ["--emit", "--configs-dir", "/nonexistent-mla-tune-dir/c"])
    for p in paths_bad_in:
        cases.append(["sweep", "--replay", p, "-q"])
    for extra in (["--db", str(w / "x.db")], ["--samples", "5"], ["--page-size", "16"],
                  ["--journal", str(w / "j.log")], ["--emit"], ["--mix", str(w / "notswept.csv")],
                  ["--seed", "-1"], ["--batches", "0"], ["--min-ratio", "nan"],
                  ["--trials", "0"], ["--model", ""], ["--tp", "0"]):
        cases.append(["sweep", "--replay", db, "-q", "--device-name", H200] + extra)
    # ---- the app itself
    cases += [["nosuchcommand"], ["report", "--bogus"], ["sweep", "--tp"]]
    return cases


def _signature(w: Path) -> dict:
    return {"tree": _tree(w), "packaged": _tree(tc.PACKAGED_FOLDER)}


def test_every_bad_input_is_one_clear_line_and_changes_nothing(world):
    before = start = _signature(world)
    db_sum = hashlib.sha256((world / "good.db").read_bytes()).hexdigest()
    problems = []
    cases = _cases(world)
    for args in cases:
        res = run_main(args, cwd=world)
        text = res.output
        why = None
        if res.exception is not None:
            why = f"traceback: {type(res.exception).__name__}: {res.exception}"
        elif "Traceback" in text or "internal error" in text:
            why = "internal error"
        elif res.code == 0:
            why = "accepted silently (exit 0)"
        elif res.code != 2:
            why = f"exit {res.code}"
        elif not one_line(res.stderr) or res.stdout.strip():
            why = "not one line on stderr"
        now = _signature(world)
        if now != before:
            changed = sorted(set(now["tree"].items()) ^ set(before["tree"].items()))
            why = (why or "") + f" changed files: {changed[:3]} packaged: {now['packaged'] != before['packaged']}"
            before = now            # report each change once, at the call that made it
        if why:
            problems.append(f"{args!r}: {why}: {text.strip()[:300]!r}")
    assert not problems, f"{len(problems)} of {len(cases)} bad inputs mishandled:\n" + "\n".join(problems)
    assert hashlib.sha256((world / "good.db").read_bytes()).hexdigest() == db_sum
    assert _signature(world) == start
    assert len(cases) > 300


def test_good_calls_still_work_and_reading_writes_nothing(world):
    before = _signature(world)
    db = str(world / "good.db")
    for args in (["report", "--db", db], ["report", "--db", db, "--full"],
                 ["report", "--db", db, "-f", "json"], ["report", "--db", db, "--mix", str(world / "mix.csv")],
                 ["show", str(world / "good.json"), "--device", H200, "--lookup", "8,4096"],
                 ["sweep", "--replay", db, "--device-name", H200, "-q"]):
        res = run_main(args, cwd=world)
        assert res.code == 0 and res.exception is None, (args, res.output[-500:])
    assert _signature(world) == before
    res = run_main(["report", "--db", db, "--plot", str(world / "plot.png")], cwd=world)
    assert res.code == 0 and (world / "plot.png").stat().st_size > 1000      # its own output


def test_summary_fits_on_a_screen_and_full_has_everything(world):
    db = str(world / "good.db")
    short = run_main(["report", "--db", db], cwd=world)
    full = run_main(["report", "--db", db, "--full"], cwd=world)
    assert short.code == full.code == 0
    assert "verdict" in short.stdout and "--full" in short.stdout
    assert len(short.stdout.splitlines()) < len(full.stdout.splitlines())
    assert "candidates per workload" in full.stdout and "candidates per workload" not in short.stdout


# ---------------------------------------------------------------- tuned-config files

def _check_inside_schema(cfg: tc.TunedConfig) -> None:
    """What a config the reader accepted must satisfy (independent of the reader's code paths)."""
    assert isinstance(cfg.device_name, str) and cfg.device_name.strip() and "/" not in cfg.device_name
    for m in cfg.models:
        assert m.page_size in tc.PAGE_SIZES
        assert 1 <= m.dims.num_heads <= tc.MAX_HEADS and m.dims.q_dtype in tc.DTYPES
        assert m.backend_order and set(m.backend_order) <= set(tc.ATTENTION_BACKENDS)
        assert m.buckets
        for b in m.buckets:
            assert all(type(x) is int for x in (b.batch_size, b.context_len, b.q_len))
            assert 1 <= b.batch_size <= tc.MAX_BATCH and 1 <= b.q_len <= b.context_len <= tc.MAX_CONTEXT
            for fam, c in b.families.items():
                assert fam in tc.FAMILIES
                if fam == "flashinfer":
                    assert c.params["backend"] in choices.FLASHINFER_BACKENDS
                else:
                    assert 1 <= c.params["num_kv_splits"] <= choices.MAX_KV_SPLITS


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            yield from _paths(v, prefix + (i,))


_LEAF = (st.none() | st.booleans() | st.integers(min_value=-(10 ** 40), max_value=10 ** 40)
         | st.floats(allow_nan=False) | st.text(max_size=12)
         | st.sampled_from([0, 1, 3, 64, 257, 2 ** 63, "64", "fa3", "auto", "FLASHINFER_MLA", "../x"]))
# a value put anywhere in a good config: a leaf, or a small list or object of leaves
_JSON = _LEAF | st.lists(_LEAF, max_size=3) | st.dictionaries(st.text(max_size=8), _LEAF, max_size=3)


@pytest.fixture(scope="module")
def good_doc(world):
    return json.loads((world / "good.json").read_text())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_config_is_refused_by_the_schema_or_inside_it(good_doc, tmp_path_factory, data):
    import copy
    doc = copy.deepcopy(good_doc)
    paths = list(_paths(doc))
    path = data.draw(st.sampled_from(paths))
    value = data.draw(_JSON)
    if not path:
        doc = value
    else:
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            parent.pop(path[-1])
        else:
            parent[path[-1]] = value
    d = tmp_path_factory.mktemp("fuzz")
    f = d / "device_name=NVIDIA_H200.json"
    f.write_text(json.dumps(doc))
    try:
        cfg = tc.read_tuned_config(f)
    except tc.TunedConfigError as e:
        assert str(e) and "\n" not in str(e).strip()
    else:
        _check_inside_schema(cfg)
        from mla_tune.views.show import render_config
        for fmt in ("table", "json", "csv", "markdown"):        # what `show` prints: never raises
            render_config(cfg, fmt, (8, 4096, 1))


RAW_FILES = {
    "binary": bytes(range(256)),
    "latin1": b'{"device_name": "caf\xe9"}',
    "bom": b"\xef\xbb\xbf{}",
    "deep": b"[" * 50_000 + b"]" * 50_000,
    "hugeint": b'{"schema_version": 1' + b"0" * 6000 + b"}",
    "nan": b'{"schema_version": NaN}',
    "empty": b"",
    "nul": b'{"a": "\x00"}',
}


@pytest.mark.parametrize("kind", [*RAW_FILES, "folder", "devzero"])
def test_plugin_warns_once_or_raises_strict_for_any_file(tmp_path, monkeypatch, kind):
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    target = tmp_path / tc.config_filename(H200)
    if kind == "folder":
        target.mkdir()
    elif kind == "devzero":
        os.symlink("/dev/zero", target)
    else:
        target.write_bytes(RAW_FILES[kind])
    monkeypatch.delenv(tc.STRICT_ENV, raising=False)
    res = tc.resolve_tuned_config(H200)
    assert res.config is None and res.reason.startswith("ignored") and str(target) in res.reason
    monkeypatch.setenv(tc.STRICT_ENV, "1")
    with pytest.raises(tc.TunedConfigError):
        tc.resolve_tuned_config(H200)
    res = run_main(["show", str(target), "--device", H200])
    assert res.code == 2 and res.exception is None and one_line(res.stderr), res.output


# ================================================================ integrity of what is read (#39)
#
# By kind, each case derived from a rule rather than listed: every stored column's rule, every
# way a schema version or a table can be wrong, a journal that disagrees with its DB, a storage
# flag, a merge source, a config object naming a key twice, a number in other digits, a fault.

import shutil
import sqlite3 as _sqlite3
import subprocess
import sys

from mla_tune.store import integrity
from mla_tune.store.results import StoreError

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DBS = [ROOT / "results.db", *sorted((ROOT / "tests" / "data").glob("*.db")),
               *sorted((ROOT / "bench" / "results").glob("*.db"))]
# one value that breaks each kind of rule (and is storable in SQLite as it is)
BREAKS = {"an integer id": "seven", "a positive integer": 0, "a non-negative integer": -1,
          "an integer or NULL": "x", "0, 1 or NULL": 2, "a finite number": "x",
          "a finite number >= 0": -1.5, "a finite number >= 0 or NULL": "slow",
          "a non-empty text": "  ", "a text or NULL": b"\x00\xff", "the id of a stored run": 10 ** 6,
          "the id of a stored workload": 10 ** 6, "the id of a stored trial": 10 ** 6,
          "ok or invalid": "maybe"}


def _break_value(rule):
    if rule.says in BREAKS:
        return BREAKS[rule.says]
    if rule.says.startswith("a JSON object"):
        return '{"num_kv_splits": [1]}'
    if rule.says.startswith("a JSON list"):
        return "[1, 2"
    if rule.says.startswith("a page size"):
        return 48
    if rule.says.startswith("NULL for an ok trial"):
        return "bogus"
    raise AssertionError(f"no breaking value for rule {rule.says!r}")


def _copy_with(src: Path, dst: Path, sql: str, args=()) -> Path:
    shutil.copy(src, dst)
    c = _sqlite3.connect(dst)
    c.execute(sql, list(args))
    c.commit()
    changed = c.total_changes
    c.close()
    assert changed, sql
    return dst


@pytest.fixture(scope="module")
def cpu_db(tmp_path_factory):
    """A small results DB written by a real CPU sweep (schema 4, ragged lengths stored)."""
    w = tmp_path_factory.mktemp("cpu-db")
    res = run_main(["sweep", "--db", "cpu.db", *_SWEEP], cwd=w)
    assert res.code == 0, res.output[-500:]
    return w / "cpu.db"


_SWEEP = ["--batches", "1,2", "--contexts", "64", "--samples", "3", "--warmup", "1",
          "--isolation", "inline", "-q", "--no-emit", "--family", "reference", "--ragged", "lognormal"]


@pytest.mark.parametrize("table,column", [(t, c) for t, rules in integrity.table_rules().items()
                                          for c in rules if c != "id"])   # an INTEGER PRIMARY KEY is one
def test_each_column_rule_refuses_a_breaking_row_naming_table_row_and_column(world, cpu_db, tmp_path,
                                                                              table, column):
    rule = integrity.table_rules()[table][column]
    src = cpu_db if column == "seq_lens" else world / "good.db"
    key = "rowid" if table == "samples" else "id"
    where = f"{key} = (select max({key}) from [{table}])"
    if column == "seq_lens":
        where = "ragged != 'uniform'"
    db = _copy_with(src, tmp_path / "x.db", f"update [{table}] set [{column}] = ? where {where}",
                    [_break_value(rule)])
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    with pytest.raises(StoreError) as e:
        ResultsStore(db, create=False)
    msg = str(e.value)
    assert f"table {table}" in msg and f"column {column}" in msg and str(db) in msg, msg
    assert "\n" not in msg
    with pytest.raises(StoreError):
        ResultsStore(db)                         # a sweep's (writable) open refuses it too
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.db"]     # no -wal/-shm left


@pytest.mark.parametrize("column", ["params", "page_size", "run_id"])
@pytest.mark.parametrize("command", ["report", "emit", "replay", "merge", "resume"])
def test_every_reader_refuses_a_damaged_row_in_one_line_and_changes_nothing(cpu_db, tmp_path,
                                                                            command, column):
    rule = integrity.table_rules()["trials"][column]
    _copy_with(cpu_db, tmp_path / "x.db", f"update trials set [{column}] = ? where id = 2",
               [_break_value(rule)])
    args = {"report": ["report", "--db", "x.db"],
            "emit": ["emit", "--db", "x.db", "--device", "cpu", "--out", "out"],
            "replay": ["sweep", "--replay", "x.db", "-q"],
            "merge": ["merge", "x.db", "--db", "merged.db"],
            "resume": ["sweep", "--db", "x.db", *_SWEEP]}[command]
    before = _tree(tmp_path)
    res = run_main(args, cwd=tmp_path)
    assert res.code == 2 and res.exception is None and one_line(res.stderr), res.output[-400:]
    assert "internal error" not in res.output and f"column {column}" in res.stderr
    assert _tree(tmp_path) == before


SCHEMA_DAMAGE = {
    "version negative": "update mla_tune_meta set value = '-1' where key = 'schema_version'",
    "version a word": "update mla_tune_meta set value = 'four' where key = 'schema_version'",
    "version 5000 digits": "update mla_tune_meta set value = '" + "9" * 5000 + "' where key = 'schema_version'",
    "version other digits": "update mla_tune_meta set value = '٤' where key = 'schema_version'",
    "version NULL": "update mla_tune_meta set value = NULL where key = 'schema_version'",
    "only the meta table": "drop table samples; drop table trials; drop table workloads; drop table runs",
    "samples re-declared TEXT": "create table s2 (trial_id INTEGER, metric TEXT, idx INTEGER, value TEXT); "
                                "insert into s2 select * from samples; drop table samples; "
                                "alter table s2 rename to samples",
    "a column dropped": "alter table trials drop column status",
}


@pytest.mark.parametrize("damage", SCHEMA_DAMAGE)
def test_a_damaged_schema_is_refused_by_the_store_and_by_merge(cpu_db, tmp_path, damage):
    db = tmp_path / "x.db"
    shutil.copy(cpu_db, db)
    c = _sqlite3.connect(db)
    c.executescript(SCHEMA_DAMAGE[damage])
    c.close()
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    for open_ in (lambda: ResultsStore(db, create=False), lambda: ResultsStore(db)):
        with pytest.raises(StoreError) as e:
            open_()
        assert "\n" not in str(e.value) and str(db) in str(e.value)
    res = run_main(["merge", "x.db", "--db", "t.db"], cwd=tmp_path)
    assert res.code == 2 and one_line(res.stderr) and not (tmp_path / "t.db").exists(), res.output
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.db"]


@pytest.mark.parametrize("db", SHIPPED_DBS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_db_is_read_through_the_validated_reader(db):
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    with ResultsStore(db, create=False) as store:
        records = store.records()
        prefill = store.records(prefill=True)
        integrity.check_rows(store.db.conn, db)
    assert records or prefill
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


# ---------------------------------------------------------------- journal and DB

def _stored(db: Path) -> tuple[int, int]:
    c = _sqlite3.connect(db)
    out = c.execute("select count(*), count(distinct workload_id || ' ' || candidate) from trials").fetchone()
    c.close()
    return out


def _resume_twice(folder: Path, expected: int) -> None:
    for _ in range(2):
        res = run_main(["sweep", "--db", "x.db", *_SWEEP], cwd=folder)
        assert res.code == 0 and res.exception is None, res.output[-500:]
        assert _stored(folder / "x.db") == (expected, expected)


def _journal_copy(cpu_db: Path, tmp_path: Path) -> Path:
    shutil.copy(cpu_db, tmp_path / "x.db")
    shutil.copy(cpu_db.with_name("cpu.optuna.log"), tmp_path / "x.optuna.log")
    return tmp_path / "x.optuna.log"


@pytest.mark.parametrize("where", [0.3, 0.7, 0.999])
def test_a_journal_cut_mid_line_is_resumed_from_and_stays_readable(cpu_db, tmp_path, where):
    journal = _journal_copy(cpu_db, tmp_path)
    data = journal.read_bytes()
    cut = int(len(data) * where)
    while data[cut - 1:cut] == b"\n":
        cut -= 1
    journal.write_bytes(data[:cut])
    _resume_twice(tmp_path, _stored(cpu_db)[1])
    assert journal.read_bytes().endswith(b"\n")


def test_a_journal_garbled_in_the_middle_is_set_aside_and_rebuilt(cpu_db, tmp_path):
    journal = _journal_copy(cpu_db, tmp_path)
    lines = journal.read_bytes().splitlines(keepends=True)
    lines[len(lines) // 2] = b'{"op_code": 5, "worker_id"\n'
    journal.write_bytes(b"".join(lines))
    _resume_twice(tmp_path, _stored(cpu_db)[1])
    assert (tmp_path / "x.optuna.log.damaged").read_bytes() == b"".join(lines)


@pytest.mark.parametrize("which", ["min", "max"])
def test_a_trial_deleted_from_the_db_is_measured_again_not_answered_by_the_journal(cpu_db, tmp_path,
                                                                                   which):
    _journal_copy(cpu_db, tmp_path)
    c = _sqlite3.connect(tmp_path / "x.db")
    tid, key = c.execute(f"select id, candidate from trials where id = (select {which}(id) from trials)").fetchone()
    c.execute("delete from samples where trial_id = ?", [tid])
    c.execute("delete from trials where id = ?", [tid])
    c.commit()
    c.close()
    res = run_main(["sweep", "--db", "x.db", *_SWEEP], cwd=tmp_path)
    assert res.code == 0 and "1 trials measured" in res.stdout, res.output[-400:]
    assert _stored(tmp_path / "x.db") == (_stored(cpu_db)[1],) * 2
    _resume_twice(tmp_path, _stored(cpu_db)[1])


def test_a_db_whose_runs_are_gone_is_refused_not_reported_empty(cpu_db, tmp_path):
    _journal_copy(cpu_db, tmp_path)
    _copy_with(cpu_db, tmp_path / "x.db", "delete from runs")
    for args in (["sweep", "--db", "x.db", *_SWEEP], ["report", "--db", "x.db"]):
        res = run_main(args, cwd=tmp_path)
        assert res.code == 2 and one_line(res.stderr) and "table trials" in res.stderr, res.output


# ---------------------------------------------------------------- storage flags

def test_storage_is_checked_as_journal_is(world, tmp_path):
    shutil.copy(world / "good.db", tmp_path / "results.db")
    (tmp_path / "notes.txt").write_text("my notes\n")
    _sqlite3.connect(tmp_path / "other.sqlite").execute("create table t (x)").connection.close()
    base = ["sweep", "--db", "new.db", *_SWEEP]
    cases = [["--storage", f] for f in ("notes.txt", "results.db", "other.sqlite", "", " ", "/dev/null",
                                        str(tmp_path))]
    cases += [["--storage", f"sqlite:///{tmp_path / f}"] for f in ("results.db", "other.sqlite", "notes.txt")]
    cases += [["--storage", "no such url://"], ["--heartbeat", "10"], ["--heartbeat", "0"],
              ["--heartbeat", str(10 ** 9)], ["--heartbeat", "5", "--storage", "j.log"]]
    cases += [["--gpus", g] for g in ("²", "0,²", "٣", "1" * 5000, "0,,1")]
    before = _tree(tmp_path)
    for extra in cases:
        res = run_main(base + extra, cwd=tmp_path)
        assert res.code == 2 and res.exception is None and one_line(res.stderr), (extra, res.output[-300:])
        assert "internal error" not in res.output
        assert _tree(tmp_path) == before, extra


# ---------------------------------------------------------------- merge sources

def test_merge_sources_are_read_immutable_and_checked_before_anything_is_written(world, cpu_db, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name, base in (("gpu.db", world / "good.db"), ("cpu.db", cpu_db)):
        shutil.copy(base, src / name)
        c = _sqlite3.connect(src / name)
        c.execute("pragma journal_mode=wal")
        c.close()
    shutil.copy(src / "gpu.db", src / "bad.db")
    c = _sqlite3.connect(src / "bad.db")
    c.execute("update samples set value = 'fast' where rowid = 3")
    c.commit()
    c.close()
    os.mkfifo(src / "fifo.db")
    before = _tree(src)
    for bad in ("bad.db", "fifo.db"):
        res = run_main(["merge", str(src / "gpu.db"), str(src / bad), "--db", str(tmp_path / "t.db")],
                       cwd=tmp_path)
        assert res.code == 2 and one_line(res.stderr), res.output
        assert not (tmp_path / "t.db").exists() and _tree(src) == before
    res = run_main(["merge", str(src / "gpu.db"), str(src / "cpu.db"), "--db", str(tmp_path / "t.db")],
                   cwd=tmp_path)
    assert res.code == 0, res.output
    assert _tree(src) == before                  # no -wal/-shm beside a WAL-mode source
    with ResultsStore(tmp_path / "t.db", create=False) as s:
        assert len(s.records()) == sum(len(ResultsStore(p, create=False).records())
                                       for p in (src / "gpu.db", src / "cpu.db"))


# ---------------------------------------------------------------- config files

def _objects(doc, path=()):
    if isinstance(doc, dict):
        yield path, doc
        for k, v in doc.items():
            yield from _objects(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:2]):
            yield from _objects(v, path + (i,))


def test_a_key_given_twice_in_any_object_of_a_config_is_refused(good_doc, tmp_path, monkeypatch):
    text = json.dumps(good_doc)
    objects = [p for p, o in _objects(good_doc) if o]
    assert len(objects) > 10
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path))
    monkeypatch.delenv(tc.STRICT_ENV, raising=False)
    f = tmp_path / tc.config_filename(H200)
    for path in objects:
        obj = good_doc
        for k in path:
            obj = obj[k]
        key = next(iter(obj))
        dup = json.dumps({key: obj[key]})[1:-1]
        marker = json.dumps(obj)
        assert marker in text
        f.write_text(text.replace(marker, "{" + dup + ", " + marker[1:], 1))
        with pytest.raises(tc.TunedConfigError, match="twice"):
            tc.read_tuned_config(f)
        tc.clear_cache()
        res = tc.resolve_tuned_config(H200)            # the plugin: a warning, the untuned path
        assert res.config is None and res.reason.startswith("ignored"), path


@pytest.mark.parametrize("models", [[], {}, None])
def test_a_config_without_model_entries_is_refused(good_doc, tmp_path, models):
    f = tmp_path / tc.config_filename(H200)
    f.write_text(json.dumps({**good_doc, "models": models}))
    with pytest.raises(tc.TunedConfigError, match="models"):
        tc.read_tuned_config(f)


# ---------------------------------------------------------------- numbers and streams

@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(categories=("Nd", "No")), min_size=1, max_size=8))
def test_only_ascii_digits_make_a_number(text):
    from mla_tune.validate import ascii_int
    if text.isascii():
        assert ascii_int(text) == int(text)
    else:
        assert ascii_int(text) is None
    assert ascii_int("7" * 5000) is None and ascii_int(" 42 ") == 42


def test_numbers_in_other_digits_are_refused_everywhere_they_are_typed_or_read(world, tmp_path):
    (tmp_path / "lens.csv").write_text("context_len\n12\n²\n")
    (tmp_path / "lens-huge.csv").write_text("12\n" + "9" * 5000 + "\n")
    good = str(world / "good.json")
    cases = [["show", good, "--device", H200, "--lookup", "²,64"],
             ["show", good, "--device", H200, "--lookup", "1,٦٤"],
             ["bench", "reference/torch/p¹⁶", "--device", "cpu", "--no-store", "--heads", "2"],
             ["bench", "triton/triton/p16/num_kv_splits=٤", "--device", "cpu", "--no-store", "--heads", "2"],
             ["sweep", "--db", "n.db", *_SWEEP, "--lengths", "lens.csv"],
             ["sweep", "--db", "n.db", *_SWEEP, "--lengths", "lens-huge.csv"]]
    before = _tree(tmp_path)
    for args in cases:
        res = run_main(args, cwd=tmp_path)
        assert res.code == 2 and res.exception is None and one_line(res.stderr), (args, res.output[-300:])
        assert _tree(tmp_path) == before


@pytest.mark.parametrize("stream", ["/dev/full", "closed"])
def test_an_output_that_cannot_be_written_is_one_line_and_a_failure(world, stream):
    args = [sys.executable, "-m", "mla_tune", "show", str(world / "good.json"), "--device", H200]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if stream == "closed":
        code = "import os, sys; os.close(1); os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
        r = subprocess.run([sys.executable, "-c", code, *args[1:]], stderr=subprocess.PIPE, text=True,
                           env=env, timeout=300)
    else:
        with open("/dev/full", "w") as full:
            r = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert r.returncode != 0 and one_line(r.stderr) and "internal error" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------- faults

def test_a_fault_mid_sweep_is_one_line_and_a_rerun_resumes_with_each_trial_once(tmp_path, monkeypatch):
    from mla_tune.store import results
    real = results.ResultsStore.add_trial
    calls = {"n": 0}
    errors = iter([_sqlite3.OperationalError("database or disk is full"),
                   PermissionError(13, "Permission denied", str(tmp_path / "x.optuna.log.lock"))])
    error = [next(errors)]

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise error[0]
        return real(self, *a, **k)

    monkeypatch.setattr(results.ResultsStore, "add_trial", failing)
    args = ["sweep", "--db", "x.db", *_SWEEP, "--contexts", "64,128"]
    for what in ("the disk is full", "permission denied"):
        calls["n"] = 0
        res = run_main(args, cwd=tmp_path)
        assert res.code == 1 and one_line(res.stderr) and res.exception is None, res.output[-400:]
        assert what in res.stderr and "rerun the same command to resume" in res.stderr
        error[0] = next(errors, None)
    monkeypatch.setattr(results.ResultsStore, "add_trial", real)
    res = run_main(args, cwd=tmp_path)
    assert res.code == 0, res.output[-400:]
    n, distinct = _stored(tmp_path / "x.db")
    assert n == distinct and distinct >= 6


def test_a_creation_killed_midway_leaves_no_temp_file_after_the_next_open(tmp_path):
    stale = tmp_path / f".x.db.{2 ** 22 - 3}.0badf00d.new"         # a pid that is not running
    stale.write_bytes(b"SQLite format 3\0")
    (tmp_path / (stale.name + "-wal")).write_bytes(b"")
    mine = tmp_path / f".x.db.{os.getpid()}.0badf00d.new"          # a live process's: kept
    mine.write_bytes(b"")
    ResultsStore(tmp_path / "x.db").close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [mine.name]
