"""Tuned-config files: a device's file name, reading one (bounded, UTF-8, plain JSON, validated)
and writing one atomically where the writer may."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from vllm_metax.core.tuned_config.parse import check_device_name, parse_tuned_config
from vllm_metax.core.tuned_config.schema import TunedConfig, TunedConfigError

MAX_CONFIG_BYTES = 64 << 20    # a tuned config is ~60 KB; anything near this is not one
MAX_JSON_DEPTH = 64


def config_filename(device_name: str) -> str:
    check_device_name(device_name)
    return f"device_name={device_name.strip().replace(' ', '_')}.json"


def read_text_file(path: str | os.PathLike, max_bytes: int, what: str = "file",
                   error: type = TunedConfigError) -> str:
    """The UTF-8 text of a regular file of at most max_bytes; anything else raises `error`."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise error(f"{p}: is a folder, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{p}: is not a regular file (a device, pipe or socket), not a {what}")
    if st.st_size > max_bytes:
        raise error(f"{p}: {st.st_size} bytes is too large for a {what} (at most {max_bytes})")
    try:
        with open(p, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror or e}") from None
    if len(raw) > max_bytes:
        raise error(f"{p}: too large for a {what} (at most {max_bytes} bytes)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text (byte {e.start}), so not a {what}") from None
    if "\x00" in text:
        raise error(f"{p}: holds NUL bytes, so not a {what}")
    return text


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def _json_depth_ok(text: str, limit: int) -> bool:
    """Whether JSON text nests at most `limit` levels (strings skipped; checked before parsing
    so that no depth can reach the decoder's or the renderers' recursion limits)."""
    depth = 0
    for m in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            if depth > limit:
                return False
        else:
            depth -= 1
    return True


def read_tuned_config(path: str | os.PathLike) -> TunedConfig:
    """Read and validate one file; any problem with it raises TunedConfigError, nothing else."""
    p = Path(path)
    text = read_text_file(p, MAX_CONFIG_BYTES, "tuned config")
    if not _json_depth_ok(text, MAX_JSON_DEPTH):
        raise TunedConfigError(f"{p}: JSON nested deeper than {MAX_JSON_DEPTH} levels, not a tuned config")
    try:
        data = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise TunedConfigError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (ValueError, RecursionError) as e:   # ints past Python's digit limit, NaN/Infinity
        raise TunedConfigError(f"{p}: not a tuned config ({str(e).splitlines()[0][:120]})") from None
    try:
        cfg = parse_tuned_config(data, str(p))
    except TunedConfigError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
        # a shape the checks above did not foresee is still the file's fault, not the reader's
        raise TunedConfigError(f"{p}: not a tuned config ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    cfg.path = str(p)
    return cfg


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list) -> dict:
    """json object_pairs_hook: an object naming one key twice is refused (json's default keeps
    the last, so `"page_size": 64, "page_size": 16` would silently read as 16)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k[:60]!r} appears twice in one object")
        out[k] = v
    return out


def creatable_folder(folder: str | os.PathLike, named: bool = True) -> str | None:
    """Why `folder` cannot be made or written into, or None. A folder the user named is made when
    its parent exists; missing folders above it only inside the working directory (never
    implicitly elsewhere, e.g. at the filesystem root). `named=False`: the folder is the parent of
    a named file, so it too is made only inside the working directory."""
    f = Path(folder)
    if f.exists() and not f.is_dir():
        return f"{f} exists and is not a folder"
    if f.is_dir():
        return None if os.access(f, os.W_OK | os.X_OK) else f"{f} is not writable"
    cwd = Path.cwd().resolve()
    target = f.resolve() if f.is_absolute() else (cwd / f).resolve()
    inside = cwd == target or cwd in target.parents
    if not inside and not (named and target.parent.is_dir()):
        return (f"folder {target.parent if named else target} does not exist and is outside the "
                "working directory: create it first (mla-tune makes missing folders only below the "
                "working directory)")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder, so {f} cannot be made"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent} is not writable"


def is_own_config(path: str | os.PathLike) -> bool:
    """Whether an existing file is a tuned config (what the writer may replace)."""
    try:
        data = json.loads(read_text_file(path, MAX_CONFIG_BYTES, "tuned config"))
    except (TunedConfigError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "schema_version" in data and "device_name" in data


def check_config_target(cfg_device: str, folder: str | os.PathLike) -> Path:
    """Where write_tuned_config would write, refused (TunedConfigError) when it must not: a folder
    it may not make, or a file there that is not a tuned config."""
    why = creatable_folder(folder)
    if why:
        raise TunedConfigError(why)
    path = Path(folder) / config_filename(cfg_device)
    if os.path.lexists(path) and (not path.is_file() or path.is_symlink() or not is_own_config(path)):
        raise TunedConfigError(f"{path} exists and is not a tuned config; left untouched "
                               "(move it away or write elsewhere)")
    return path


# A test's fault point between the temporary file and the rename: mla_tune.fault_points sets it
# while a fault may be placed at "emit-written"; None (nothing called) in normal use.
BEFORE_REPLACE = None


def write_tuned_config(cfg: TunedConfig, folder: str | os.PathLike) -> Path:
    """Write atomically to folder/device_name=<name>.json (validated by a round trip first)."""
    data = cfg.to_json()
    parse_tuned_config(json.loads(json.dumps(data)), "<new config>")
    path = check_config_target(cfg.device_name, folder)
    tmp = path.with_suffix(".json.tmp")
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        if BEFORE_REPLACE is not None:
            BEFORE_REPLACE(tmp)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise TunedConfigError(f"cannot write {path}: {e.strerror or e}") from None
    return path
