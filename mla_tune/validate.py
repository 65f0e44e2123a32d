"""Input rules, one per kind of value, shared by the CLI and the library.

The CLI declares the same ranges to typer (`**INT["batch"].typer`, `click.Path`), so a bad flag is
refused before anything runs; the library checks again at its boundary (`check_int("batch", v)`),
so a caller that skips the CLI gets the same one-line error. The tuned-config bounds (page sizes,
bucket dims, FlashInfer backends) are the schema's, `vllm_metax.core.tuned_config`, so the tuner never
measures or writes what the plugin would refuse to read.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vllm_metax.core import tuned_config as tc


class InputError(ValueError):
    """A value, file or path the user gave that cannot be used; the message says why (exit 2)."""


def _shown(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10 ** 15:
        return f"a {len(str(abs(v)))}-digit number"
    return repr(v)


@dataclass(frozen=True)
class IntRange:
    lo: int
    hi: int

    @property
    def typer(self) -> dict:
        """The same range as typer.Option keyword arguments. A bound no one types (an SQLite id's
        2**63 - 1) is left to check() so --help does not print it: `[x>=1]`."""
        return {"min": self.lo, "max": self.hi if self.hi < 2 ** 53 else None}

    def check(self, name: str, v) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"{name} must be an integer, got {_shown(v)}")
        if not self.lo <= v <= self.hi:
            raise InputError(f"{name} must be in {self.lo}..{self.hi}, got {_shown(v)}")
        return v


@dataclass(frozen=True)
class FloatRange:
    lo: float
    hi: float
    lo_open: bool = False       # (lo, hi] rather than [lo, hi]

    @property
    def typer(self) -> dict:
        # typer has no open bounds, and click lets NaN through any range: check() refuses both
        return {"min": self.lo, "max": self.hi}

    def check(self, name: str, v) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InputError(f"{name} must be a number, got {_shown(v)}")
        v = float(v)
        low_ok = v > self.lo if self.lo_open else v >= self.lo
        if not math.isfinite(v) or not low_ok or v > self.hi:
            lo = f"({self.lo:g}" if self.lo_open else f"[{self.lo:g}"
            raise InputError(f"{name} must be a finite number in {lo}, {self.hi:g}], got {v!r}")
        return v


INT = {
    "batch": IntRange(1, tc.MAX_BATCH),
    "context": IntRange(1, tc.MAX_CONTEXT),
    "q_len": IntRange(1, tc.MAX_Q_LEN),
    "heads": IntRange(1, tc.MAX_HEADS),
    "tp": IntRange(1, tc.MAX_HEADS),
    "samples": IntRange(2, 100_000),          # the significance test needs at least two
    "bench_samples": IntRange(1, 100_000),
    "warmup": IntRange(0, 1_000),
    "rounds": IntRange(1, 1_000),
    "plan_samples": IntRange(0, 100_000),
    "seed": IntRange(0, 2 ** 32 - 1),         # what optuna's samplers (numpy) accept
    "grid_max": IntRange(1, 1_000_000),
    "trials": IntRange(1, 1_000_000),
    "patience": IntRange(0, 1_000_000),
    "run": IntRange(1, 2 ** 63 - 1),          # SQLite integer ids
    "heartbeat": IntRange(1, 3600),           # seconds between a claimed trial's heartbeats
    "jobs": IntRange(1, 1024),                # compiler processes at once (prebuild)
}
FLOAT = {
    "timeout": FloatRange(0.0, 86_400.0, lo_open=True),       # seconds per candidate
    "min_ratio": FloatRange(1.0, 100.0),
    "weight": FloatRange(0.0, 1e12),
    "time_budget": FloatRange(0.0, 30 * 86_400.0),
    "share": FloatRange(0.0, 1.0, lo_open=True),      # of a recorded traffic's steps
}
MAX_KV_TOKENS = 1 << 26        # KV tokens in one bucket (77 GB of bf16 MLA cache): more cannot fit
MAX_BUCKETS = 10_000
MAX_LIST = 256                 # values in one size list
MAX_MIX_BYTES = 4 << 20
MAX_NAME = tc.MAX_NAME


def ascii_int(text: str, max_digits: int = 18) -> int | None:
    """The non-negative integer `text` spells in ASCII digits (at most `max_digits` of them), else
    None: str.isdigit() also accepts digits int() refuses ('²') and lengths past Python's int
    conversion limit."""
    t = text.strip() if isinstance(text, str) else ""
    if not t or len(t) > max_digits or not t.isascii() or not t.isdigit():
        return None
    return int(t)


def check_int(kind: str, v, name: str | None = None) -> int:
    return INT[kind].check(name or kind.replace("_", " "), v)


def check_float(kind: str, v, name: str | None = None) -> float:
    return FLOAT[kind].check(name or kind.replace("_", " "), v)


def check_page_size(v, name: str = "page size") -> int:
    try:
        return tc.check_page_size(v, name)
    except tc.TunedConfigError as e:
        raise InputError(str(e)) from None


def check_name(label: str, v) -> str:
    """A name (sweep label, model, device filter): 1..MAX_NAME printable characters."""
    if not isinstance(v, str) or not v.strip():
        raise InputError(f"{label} must not be empty")
    if len(v) > MAX_NAME or not v.isprintable():
        raise InputError(f"{label} must be 1-{MAX_NAME} printable characters, got {v[:60]!r}")
    return v


def check_kv_tokens(batch: int, context: int) -> None:
    if batch * context > MAX_KV_TOKENS:
        raise InputError(f"batch {batch} x context {context} = {batch * context} KV tokens in one "
                         f"step is more than {MAX_KV_TOKENS} (the KV cache would not fit)")


# ---------------------------------------------------------------- files and paths

def path_arg(text: str) -> Path:
    """typer parser for a path option: an empty string is no path (typer's Path would make it
    the current folder). What the path may be is checked by the rules below, where it is used."""
    if not str(text).strip():
        import typer
        raise typer.BadParameter("an empty string is not a path")
    return Path(text)


def PathOption(*args, **kw):
    """typer.Option for a path (empty refused, see path_arg)."""
    import typer
    kw.setdefault("metavar", "PATH")
    return typer.Option(*args, parser=path_arg, **kw)


def PathArgument(*args, **kw):
    import typer
    return typer.Argument(*args, parser=path_arg, **kw)


def input_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_MIX_BYTES) -> str:
    """The UTF-8 text of a regular input file (not a folder, device or pipe; bounded size)."""
    return tc.read_text_file(path, max_bytes, what, InputError)


_OWN_KINDS: dict = {}


def own_kind(description: str):
    """Decorator of an `own=` predicate of output_file: what it recognises, for the refusal."""
    def mark(predicate):
        _OWN_KINDS[predicate] = description
        return predicate
    return mark


def _starts_with(path: Path, magic: bytes) -> bool:
    if not Path(path).is_file():      # a FIFO would block the read
        return False
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


@own_kind('a PNG')
def is_png(path: Path) -> bool:
    return _starts_with(path, b"\x89PNG\r\n\x1a\n")


@own_kind('a SQLite file')
def is_sqlite(path: Path) -> bool:
    return _starts_with(path, b"SQLite format 3\x00")


@own_kind('an optuna journal')
def is_optuna_journal(path: Path) -> bool:
    """An optuna JournalFileStorage log: JSON lines, each an object with an op_code."""
    if not Path(path).is_file():
        return False
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 20)
        rec = json.loads(first.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(rec, dict) and "op_code" in rec


def output_file(path: str | os.PathLike, what: str, own: Callable[[Path], bool] | None = None,
                suffix: str | None = None) -> Path:
    """Where a command may write a file: not a folder or device; an existing file only when it
    is the tool's own output of that kind (`own`) or empty; its folder writable, and made only
    below the working directory. Checked before the command starts; nothing is written here."""
    p = Path(path)
    if not str(path).strip():
        raise InputError(f"{what}: empty path")
    if suffix and p.suffix.lower() != suffix:
        raise InputError(f"{what} {p} must end in {suffix}")
    if os.path.lexists(p):
        if p.is_symlink() and not p.exists():
            raise InputError(f"{what} {p} is a symbolic link to {os.readlink(p)}, which does not "
                             "exist; name the file itself (or remove the link): nothing is "
                             "created through it")
        if p.is_dir():
            raise InputError(f"{what} {p} is a folder; name a file")
        if not p.is_file():
            raise InputError(f"{what} {p} is not a regular file; left untouched")
        if p.stat().st_size and own is not None and not own(p):
            raise InputError(f"{what} {p} exists and is not {_own_text(own)}; left untouched "
                             "(move it away or pick another path)")
        if not os.access(p, os.W_OK):
            raise InputError(f"{what} {p} is not writable")
    why = tc.creatable_folder(p.parent if str(p.parent) else ".", named=False)
    if why:
        raise InputError(f"{what} {p}: {why}")
    return p


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: equal once symbolic links, `.`, `..` and the working
    directory are resolved (a file not made yet included), or one inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:          # one of them does not exist (yet): the real paths decided
        return False


def check_distinct_paths(*roles: tuple[str, str | os.PathLike | None]) -> None:
    """One path for one role: InputError when two roles (--db, --journal, --storage, a merge
    source and its target, --configs-dir) name the same file, however spelt (`./x.db`, a
    symbolic link, a hard link); `None` paths are not given. Checked before anything is written:
    a results DB written over as a journal, or merged into itself, loses what it held."""
    given = [(role, p) for role, p in roles if p is not None and str(p).strip()]
    for i, (role_a, a) in enumerate(given):
        for role_b, b in given[i + 1:]:
            if same_file(a, b):
                raise InputError(f"{role_a} {a} and {role_b} {b} are one file "
                                 f"({os.path.realpath(a)}): give each its own path; nothing was "
                                 "written")


def _own_text(own) -> str:
    return _OWN_KINDS.get(own, "this tool's output")


def output_folder(path: str | os.PathLike, what: str) -> Path:
    """A folder a command may write into (made if its parent exists or it lies below the
    working directory)."""
    if not str(path).strip():
        raise InputError(f"{what}: empty path")
    why = tc.creatable_folder(path, named=True)
    if why:
        raise InputError(f"{what}: {why}")
    return Path(path)


def make_parent(path: Path) -> None:
    """Create a validated output file's folder (only called after output_file approved it)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)


def packaged_configs() -> Path:
    """The folder the plugin ships and loads last: emitting there changes what vLLM serves with."""
    return tc.PACKAGED_FOLDER.resolve()


def is_packaged_configs(folder: str | os.PathLike) -> bool:
    try:
        return Path(folder).resolve() == packaged_configs()
    except OSError:
        return False
