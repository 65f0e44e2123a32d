"""A bad-input pass over the installed `mla-tune` console script, as a new user would run it: every
call a separate process, in a scratch folder holding a copy of the shipped results.db and tuned
config. Counts tracebacks, internal errors, silent accepts (exit 0 on bad input), other exit
codes and changed files (every file of the scratch folder and of the packaged configs hashed
around each call), and runs the plugin's config lookup (lenient and strict) over bad config files.

    python bench/bad_input_pass.py        # prints a summary and the failures; exit 1 if any
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
H200 = "NVIDIA H200"


def tree(root: Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            out[str(p.relative_to(root))] = "special"
        elif p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p.relative_to(root))] = "dir"
    return out


def scratch() -> Path:
    w = Path(tempfile.mkdtemp(prefix="mla-bad-"))
    shutil.copy(ROOT / "results.db", w / "results.db")
    shutil.copy(ROOT / "configs" / "device_name=NVIDIA_H200.json", w / "h200.json")
    (w / "dir").mkdir()
    (w / "dir.png").mkdir()
    (w / "bin").write_bytes(os.urandom(3000))
    (w / "utf16.csv").write_text("1,1024,1\n", encoding="utf-16")
    (w / "crlf-bad.csv").write_bytes(b"1,1024,1\r\n2,2048\r\n")
    (w / "extra-col.csv").write_text("1,1024,1,7\n")
    (w / "neg.csv").write_text("-4,1024,1\n")
    (w / "inf.csv").write_text("1,1024,Infinity\n")
    (w / "unswept.csv").write_text("1,1024,1\n3,1000,5\n")
    (w / "all-zero.csv").write_text("1,1024,0\n2,2048,0\n")
    (w / "big.csv").write_text("1,1024,1\n" * 600_000)
    (w / "journal.log").write_text("this is my journal, not optuna's\n")
    (w / "report.png").write_text("not a png\n")
    sqlite3.connect(w / "blank.sqlite").execute("create table t (x)").connection.close()
    # one file under other names (#52): links to a DB-to-be and to results.db, a hard link, and a
    # link to a file that does not exist
    os.symlink("x.db", w / "link-x.db")
    os.symlink("results.db", w / "link-results.db")
    os.link(w / "results.db", w / "hard-results.db")
    (w / "elsewhere").mkdir()
    os.symlink("elsewhere/t.db", w / "dangling.db")
    doc = json.loads((w / "h200.json").read_text())
    bad_cfgs = {
        "page0": lambda d: d["models"][0]["global"].__setitem__("page_size", 0),
        "page-huge": lambda d: d["models"][0]["global"].__setitem__("page_size", 10 ** 30),
        "page-str": lambda d: d["models"][0]["global"].__setitem__("page_size", "64"),
        "page-48": lambda d: d["models"][0]["global"].__setitem__("page_size", 48),
        "heads-str": lambda d: d["models"][0]["dims"].__setitem__("num_heads", "128"),
        "heads-neg": lambda d: d["models"][0]["dims"].__setitem__("num_heads", -8),
        "device-num": lambda d: d.__setitem__("device_name", 7),
        "device-path": lambda d: d.__setitem__("device_name", "../../etc/passwd"),
        "no-buckets": lambda d: d["models"][0].__setitem__("buckets", []),
        "bucket-huge": lambda d: d["models"][0]["buckets"][0].__setitem__("batch_size", 10 ** 9),
        "bucket-float": lambda d: d["models"][0]["buckets"][0].__setitem__("context_len", 1024.0),
        "fi-unknown": lambda d: d["models"][0]["buckets"][0]["families"]["flashinfer"].__setitem__(
            "params", {"backend": "fa7"}),
        "tr-splits0": lambda d: d["models"][0]["buckets"][0]["families"]["triton"]["params"].__setitem__(
            "num_kv_splits", 0),
        "tr-extra": lambda d: d["models"][0]["buckets"][0]["families"]["triton"]["params"].__setitem__(
            "warp", 4),
        "order-dup": lambda d: d["models"][0]["global"].__setitem__("backend_order", ["TRITON_MLA"] * 2),
        "order-empty": lambda d: d["models"][0]["global"].__setitem__("backend_order", []),
        "time-neg": lambda d: d["models"][0]["buckets"][0]["families"]["flashinfer"].__setitem__("time_us", -1),
        "sig-str": lambda d: d["models"][0]["buckets"][0]["families"]["flashinfer"].__setitem__("significant", "yes"),
        "dtype": lambda d: d["models"][0]["dims"].__setitem__("q_dtype", "int4"),
        "models-dict": lambda d: d.__setitem__("models", {}),
        "version-bool": lambda d: d.__setitem__("schema_version", True),
    }
    for name, mutate in bad_cfgs.items():
        d = json.loads(json.dumps(doc))
        mutate(d)
        (w / f"cfg-{name}.json").write_text(json.dumps(d))
    (w / "cfg-deep.json").write_text("{\"a\":" * 30_000 + "1" + "}" * 30_000)
    (w / "cfg-bigint.json").write_text('{"schema_version": 1, "x": ' + "7" * 20_000 + "}")
    (w / "cfg-nan.json").write_text(json.dumps(doc).replace('"sm_count": 132', '"sm_count": NaN'))
    (w / "cfg-binary.json").write_bytes(os.urandom(500))
    (w / "cfg-latin1.json").write_bytes(json.dumps(doc).replace("NVIDIA", "NV\u00cfDIA").encode("latin-1"))
    return w


def cases(w: Path) -> list[list[str]]:
    db = "results.db"
    c: list[list[str]] = []
    # report
    for p in ["dir", "bin", "blank.sqlite", "/dev/zero", "/dev/null", "nope.db", "h200.json", "utf16.csv"]:
        c.append(["report", "--db", p])
    for p in [db, "dir", "dir.png", "report.png", "h200.json", "/no/such/dir/p.png", "/proc/p.png",
              "plot", "plot.PNG.db", "sub/deeper/../p.txt"]:
        c.append(["report", "--db", db, "--plot", p])
    for m in ["utf16.csv", "crlf-bad.csv", "extra-col.csv", "neg.csv", "inf.csv", "unswept.csv",
              "all-zero.csv", "big.csv", "bin", "dir", "/dev/zero"]:
        c.append(["report", "--db", db, "--mix", m])
    for v in ["0", "-3", "1e3", "18446744073709551616", "abc"]:
        c.append(["report", "--db", db, "--run", v])
    c += [["report", "--db", db, "--device", " "], ["report", "--db", db, "--model", "\t"],
          ["report", "--db", db, "-f", "TABLE2"], ["report", "--db", db, "--full", "--full=no"]]
    # emit
    for out in ["h200.json", "/no/such/dir/configs", "/dev/null", "bin"]:
        c.append(["emit", "--db", db, "--configs-dir", out])
    for m in ["neg.csv", "unswept.csv", "inf.csv"]:
        c.append(["emit", "--db", db, "--configs-dir", "o", "--mix", m])
    c += [["emit", "--db", db, "--configs-dir", "o", "--device", "MetaX C500"],
          ["emit", "--db", db, "--configs-dir", "o", "--model", ""],
          ["emit", "--db", db, "--configs-dir", "o", "--run", "0"],
          ["emit", "--db", "blank.sqlite", "--configs-dir", "o"],
          ["emit", "--db", db, "--configs-dir", "o", "--all-devices", "--device", H200]]
    # show: every bad config
    for f in sorted(x.name for x in w.glob("cfg-*.json")):
        c.append(["show", f, "--device", H200])
    for lk in ["0,0", "1,1,0", "1,1,99999", "1.5,2", "1,2,", ",", "4294967296,1"]:
        c.append(["show", "h200.json", "--device", H200, "--lookup", lk])
    c += [["show", "dir"], ["show", "/dev/zero"], ["show", "h200.json", "--device", "a/b"],
          ["show", "h200.json", "--device", "MetaX C500"]]
    # doctor
    c += [["doctor", "--tp", "0"], ["doctor", "--tp", "100000"], ["doctor", "--model", " "],
          ["doctor", "--model", "gpt-9"], ["doctor", "-f", "pdf"]]
    # bench
    b = ["bench", "--device", "cpu", "--heads", "2", "--no-store"]
    for cand in ["reference/torch/p5", "reference/torch/p512", "reference/torch/p0",
                 "flashinfer/auto/p64/backend=fa3", "triton/triton/p16/num_kv_splits=257",
                 "triton/triton/p16/num_kv_splits=abc", "triton/fa3/p16/num_kv_splits=4",
                 "reference/cuda/p16", "a/b/c/d", "reference/torch/p16/=", "reference/torch/16"]:
        c.append(b[:1] + [cand] + b[1:])
    r = ["bench", "reference/torch/p16", "--device", "cpu", "--heads", "2", "--no-store"]
    for opt, v in [("--batch", "0"), ("--batch", "1,-2"), ("--batch", "70000"), ("--context", ""),
                   ("--context", "1Q"), ("--q-len", "0"), ("--q-len", "2000"), ("--samples", "0"),
                   ("--rounds", "0"), ("--warmup", "1000000"), ("--plan-samples", "-1"),
                   ("--heads", "0"), ("--heads", "5000"), ("--ragged", ""), ("--format", "xml"),
                   ("--device", "gpu"), ("--tp", "2"), ("--context", "1-0"), ("--context", "4K-1K")]:
        c.append(r + [opt, v])
    c.append(["bench", "reference/torch/p16", "--device", "cpu", "--heads", "2", "--batch", "4096",
              "--context", "100000", "--no-store"])
    c.append(["bench", "reference/torch/p16", "--device", "cpu", "--heads", "2", "--db", "blank.sqlite"])
    c.append(["bench", "reference/torch/p16", "--device", "cpu", "--heads", "2", "--db", "bin"])
    c.append(["bench", "reference/torch/p16", "--device", "cpu", "--heads", "2", "--no-store",
              "--samples", "4", "--rounds", "5"])
    c.append(["bench", "reference/torch/p16", "--device", "cuda", "--heads", "2", "--no-store"])
    # sweep (each would write results-cpu.db / a journal if it were accepted)
    s = ["sweep", "-q", "--batches", "1", "--contexts", "64", "--samples", "3", "--warmup", "1",
         "--isolation", "inline"]
    for opt, v in [("--seed", "-1"), ("--seed", str(2 ** 32)), ("--seed", "1e9"), ("--warmup", "-1"),
                   ("--warmup", "100000000"), ("--samples", "2000000"), ("--timeout", "0"),
                   ("--timeout", "nan"), ("--timeout", "-inf"), ("--timeout", "1e309"),
                   ("--min-ratio", "nan"), ("--min-ratio", "inf"), ("--min-ratio", "0.99"),
                   ("--grid-max", "0"), ("--trials", "0"), ("--patience", "-1"), ("--tp", "0"),
                   ("--tp", "3"), ("--tp", "99999"), ("--q-len", "0"), ("--q-len", "65"),
                   ("--page-size", "0"), ("--page-size", "-16"), ("--page-size", "24"),
                   ("--page-size", "1024"), ("--page-size", "1" + "0" * 30), ("--batches", ""),
                   ("--batches", "1-0"), ("--batches", "128-1"), ("--batches", "1-10M"),
                   ("--contexts", "0-64"), ("--contexts", "64,"), ("--contexts", "4G"),
                   ("--time-budget", "-5"), ("--time-budget", "5y"), ("--time-budget", "1e9h"),
                   ("--name", ""), ("--name", "a\nb"), ("--model", " "), ("--family", ""),
                   ("--ragged", "UNIFORM"), ("--kv-dtype", "float32"), ("--mode", "Grid"),
                   ("--device-name", H200), ("--db", "bin"),
                   ("--db", "blank.sqlite"), ("--db", "dir"), ("--db", "h200.json"),
                   ("--journal", "journal.log"), ("--journal", "results.db"), ("--journal", "dir"),
                   ("--journal", "/no/such/dir/j.log"), ("--mix", "unswept.csv"),
                   ("--mix", "neg.csv"), ("--mix", "big.csv"), ("--emit", None),
                   ("--configs-dir", "bin"), ("--configs-dir", "c"), ("--no-emit --configs-dir", "c"),
                   ("--emit --configs-dir", "/no/such/dir/c"), ("--emit --configs-dir", "bin")]:
        args = s + opt.split() + ([] if v is None else [v])
        c.append(args)
    for extra in (["--samples", "4"], ["--db", "x.db"], ["--no-emit"], ["--journal", "j.log"],
                  ["--family", "reference"], ["--time-budget", "9m"], ["--remeasure"],
                  ["--mix", "unswept.csv"], ["--page-size", "16"], ["--device-name", "cpu"],
                  ["--batches", "0"], ["--seed", "-1"], ["--min-ratio", "nan"], ["--trials", "0"],
                  ["--model", ""], ["--contexts", "1K-"], ["--configs-dir", "c"]):
        c.append(["sweep", "--replay", db, "-q"] + extra)
    for p in ["bin", "dir", "blank.sqlite", "nope.db", "/dev/zero"]:
        c.append(["sweep", "--replay", p, "-q"])
    # one file for two roles, however spelt; a dangling link (#52): refused, nothing written
    n = ["--no-emit"]
    for roles in (["--db", "x.db", "--journal", "x.db"], ["--db", "x.db", "--storage", "x.db"],
                  ["--db", "x.db", "--storage", "sqlite:///x.db"],
                  ["--db", "x.db", "--storage", f"sqlite:///{w / 'x.db'}"],
                  ["--db", "./x.db", "--journal", "x.db"], ["--db", "x.db", "--journal", "link-x.db"],
                  ["--db", "x.db", "--journal", "dir/../x.db"],
                  ["--db", db, "--journal", "hard-results.db"], ["--db", db, "--storage", "link-results.db"],
                  ["--db", "x.db", "--emit", "--configs-dir", "x.db"],
                  ["--db", "x.db", "--gpus", "0,1", "--storage", "./x.db"],
                  ["--db", "dangling.db"], ["--db", "x.db", "--journal", "dangling.db"]):
        c.append(s + roles + ([] if "--emit" in roles else n))
    c += [["merge", db, "--db", db], ["merge", "./" + db, "--db", db], ["merge", db, "--db", "link-results.db"],
          ["merge", "hard-results.db", "--db", str(w / db)], ["merge", db, "--db", "dangling.db"],
          ["emit", "--db", db, "--configs-dir", "./" + db], ["report", "--db", db, "--plot", "link-results.db"]]
    c += [["sweep", "--bogus"], ["sweep", "--tp"], ["frobnicate"], ["report", "extra-arg"]]
    return c


def run_one(args, w: Path, exe: str):
    r = subprocess.run([exe, *args], cwd=w, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "120"})
    return r.returncode, r.stdout, r.stderr


PLUGIN_SNIPPET = r"""
import logging, sys, os, json
from vllm_metax.core import tuned_config as tc
logging.basicConfig(level=logging.WARNING, format="%(message)s")
name = "NVIDIA H200"
try:
    cfg = tc.load_tuned_config(name)
    lenient = "ok" if cfg is None else "LOADED"
except BaseException as e:
    lenient = f"RAISED {type(e).__name__}"
tc.clear_cache()
os.environ[tc.STRICT_ENV] = "1"
try:
    tc.load_tuned_config(name)
    strict = "NOT RAISED"
except tc.TunedConfigError:
    strict = "ok"
except BaseException as e:
    strict = f"RAISED {type(e).__name__}"
print(json.dumps([lenient, strict]))
"""


def plugin_pass(w: Path) -> list[str]:
    """Each bad config as the device's file in $VLLM_METAX_MLA_CONFIG_FOLDER: one warning and
    no config (lenient), TunedConfigError (strict)."""
    bad = []
    files = sorted(w.glob("cfg-*.json"))
    extra = {"folder": None, "devzero": "/dev/zero"}
    for item in [*files, *extra]:
        folder = Path(tempfile.mkdtemp(prefix="mla-cfg-"))
        target = folder / "device_name=NVIDIA_H200.json"
        if item == "folder":
            target.mkdir()
        elif item == "devzero":
            os.symlink("/dev/zero", target)
        else:
            shutil.copy(item, target)
        env = {**os.environ, "VLLM_METAX_MLA_CONFIG_FOLDER": str(folder),
               "VLLM_METAX_MLA_PACKAGED_FOLDER": str(folder / "none")}
        env.pop("VLLM_METAX_MLA_CONFIG_STRICT", None)
        r = subprocess.run([sys.executable, "-c", PLUGIN_SNIPPET], capture_output=True, text=True,
                           env=env, timeout=60)
        label = item if isinstance(item, str) else item.name
        try:
            lenient, strict = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            bad.append(f"plugin {label}: no answer ({r.stderr.strip()[-200:]})")
            continue
        warnings = [ln for ln in r.stderr.splitlines() if "vllm_metax MLA" in ln]
        if lenient != "ok" or strict != "ok" or len(warnings) != 1 or "Traceback" in r.stderr:
            bad.append(f"plugin {label}: lenient {lenient}, strict {strict}, "
                       f"{len(warnings)} warning(s) {r.stderr.strip()[-200:]!r}")
        shutil.rmtree(folder)
    return bad, len(files) + len(extra)


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()
    exe = shutil.which("mla-tune") or sys.exit("mla-tune is not installed")
    w = scratch()
    packaged = ROOT / "configs"
    base, base_pk = tree(w), tree(packaged)
    shipped = {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest()
               for p in ("results.db", "results.optuna.log", "configs/device_name=NVIDIA_H200.json")}
    cs = cases(w)
    counts = {"tracebacks": 0, "internal errors": 0, "silent accepts": 0, "other exit codes": 0,
              "not one line": 0, "changed files": 0}
    failures = []
    for args_ in cs:           # one at a time: the file check must see each call alone
        code, out, err = run_one(args_, w, exe)
        text = out + err
        why = []
        if "Traceback" in text:
            counts["tracebacks"] += 1
            why.append("traceback")
        if "internal error" in text:
            counts["internal errors"] += 1
            why.append("internal error")
        if code == 0:
            counts["silent accepts"] += 1
            why.append("exit 0")
        elif code != 2 and not why:
            counts["other exit codes"] += 1
            why.append(f"exit {code}")
        if code == 2 and len(err.strip().splitlines()) != 1:
            counts["not one line"] += 1
            why.append("not one line")
        now = tree(w)
        if now != base or tree(packaged) != base_pk:
            counts["changed files"] += 1
            diff = sorted(set(now.items()) ^ set(base.items()))
            why.append(f"changed {diff[:2]}")
            base = now
            base_pk = tree(packaged)
        if why:
            failures.append(f"{' '.join(args_)[:160]}: {', '.join(why)}: {text.strip()[-200:]!r}")
    plugin_bad, n_plugin = plugin_pass(w)
    after = {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in shipped}
    print(f"{len(cs)} CLI calls, {n_plugin} plugin config files")
    for k, v in counts.items():
        print(f"  {k}: {v}")
    print(f"  plugin problems: {len(plugin_bad)}")
    print(f"  shipped files unchanged: {after == shipped}")
    for f in failures + plugin_bad:
        print("FAIL", f)
    shutil.rmtree(w)
    return 1 if failures or plugin_bad or after != shipped else 0


if __name__ == "__main__":
    sys.exit(main())
