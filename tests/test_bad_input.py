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
from vllm_metax import tuned_config as tc

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
                    assert c.params["backend"] in tc.FLASHINFER_BACKENDS
                else:
                    assert 1 <= c.params["num_kv_splits"] <= tc.MAX_KV_SPLITS


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
