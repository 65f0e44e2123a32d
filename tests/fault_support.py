"""Faults placed by event (mla_tune.fault_points): run the console script in its own process with
a fault at a named point, and read back which points it passed. Used by the kill tests and by
bench/integrity_pass.py, so a fault hits its window on a fast machine and on a 2-core CI runner
alike: no fixed sleep, no polling of the file system."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from mla_tune import fault_points

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# the console script with the test-only kernel families (sleepy, faulty) registered
SCRIPT = ("import sys; sys.path.insert(0, %r); import sweep_families; sweep_families.register(); "
          "from mla_tune.cli import main; main()" % str(TESTS))


def fault_env(event: str, action: str = "kill", log: Path | None = None, base=None) -> dict:
    """The environment of a process whose fault strikes at `event` ("trial-stored:3")."""
    env = {**(os.environ if base is None else base), fault_points.AT_ENV: event,
           fault_points.DO_ENV: action, "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    if log is not None:
        env[fault_points.LOG_ENV] = str(log)
    return env


def start(args, cwd, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_to_fault(args, cwd, event: str, action: str = "kill", log: Path | None = None,
                 timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the CLI until its fault at `event` ends it (kill) or it exits; the completed process
    (returncode -9 when the fault struck)."""
    log = log or Path(cwd) / "fault.log"
    p = start(args, cwd, fault_env(event, action, log))
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def wait_stopped(p: subprocess.Popen, timeout: float = 240) -> bool:
    """Wait until `p` stops itself (action stop) or exits; True when it stopped. The process is
    left stopped (and unreaped) for the caller to inspect, then kill or continue."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(p.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            if os.WIFSTOPPED(status):
                return True
            p.returncode = os.waitstatus_to_exitcode(status)    # it ended: reaped here
            return False
        time.sleep(0.01)          # waiting on the process's state, not on a clock for the fault
    raise TimeoutError(f"{p.args[3:]} neither stopped nor ended in {timeout} s")


def passed(log: Path) -> list[tuple[str, int, int]]:
    """(event, count, pid) of every fault point the processes passed, in order."""
    if not Path(log).exists():
        return []
    out = []
    for line in Path(log).read_text().splitlines():
        event, n, pid = line.split()
        out.append((event, int(n), int(pid)))
    return out


def struck(log: Path) -> int | None:
    """The pid of the process the fault struck (None: it never struck)."""
    f = Path(f"{log}.fired")
    return int(f.read_text()) if f.exists() else None


def strace_works() -> str | None:
    """Why a readonly fault cannot be injected here (no strace, or ptrace refused), else None."""
    import shutil
    if shutil.which("strace") is None:
        return "strace is not installed (apt-get install strace)"
    r = subprocess.run(["strace", "-qq", "-o", os.devnull, "-e", "inject=write:error=EROFS",
                        sys.executable, "-c", "import os, sys\ntry:\n os.write(1, b'x')\n"
                        "except OSError as e:\n sys.exit(e.errno)"], capture_output=True)
    return None if r.returncode == 30 else f"strace cannot trace here: {r.stderr.decode()[-200:]}"
