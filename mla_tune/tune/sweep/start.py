"""What a GPU sweep starts before it plans, so that its start-up overlaps the planning: the
measuring worker, FlashInfer's JIT build and the ceilings probe (copy bandwidth and matmul rate,
measured in a child process for the run record)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from mla_tune.measure.jit_prebuild import start_prebuild
from mla_tune.measure.worker import make_runner
from mla_tune.tune.sweep.config import SweepConfig, default_families, sweep_profile


class CeilingsProbe:
    """Copy bandwidth and matmul rate of this GPU for the run record (roofline %), measured in a
    child process so this process never initialises CUDA before its workers fork. Started at
    once (`start`), so the child's interpreter and CUDA start overlap the worker's; `result`
    waits for it ({} on any failure), `close` ends it if never asked."""

    CODE = ("import json; from mla_tune.problem.roofline import measure_ceilings; "
            "c = measure_ceilings('cuda'); print(json.dumps({k: c[k] for k in ('copy_gbps', 'matmul_tflops')}))")

    def __init__(self, timeout: float = 180.0):
        self.timeout = timeout
        self.proc = None

    def start(self) -> "CeilingsProbe":
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", self.CODE], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def result(self) -> dict:
        if self.proc is None:
            return {}
        try:
            out, _ = self.proc.communicate(timeout=self.timeout)
            return json.loads(out.strip().splitlines()[-1]) if self.proc.returncode == 0 else {}
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            self.close()
            return {}
        finally:
            self.proc = None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def ceilings_in_subprocess(timeout: float = 180.0) -> dict:
    """CeilingsProbe, started and waited for: {} on failure."""
    return CeilingsProbe(timeout).start().result()


class EarlyStart:
    """What a GPU sweep starts before it plans, so that it overlaps the planning's imports
    (FlashInfer, vLLM: ~10 s on the H200): the measuring worker (in a thread: its fork server
    imports torch and the measuring code, then the worker imports the families' kernels), the
    ceilings probe and FlashInfer's background JIT build (jit_prebuild: its modules depend on
    the buckets' head dims and dtypes only, not on a plan). Nothing here writes user data; on
    the CPU, or with isolation inline, nothing starts."""

    def __init__(self, config: SweepConfig, settings):
        self.runner = self.ceilings = self.prebuild = None
        self.error: BaseException | None = None
        self._thread = None
        if not str(config.device).startswith("cuda"):
            return
        families = config.families or default_families(config.device, sweep_profile(config))
        self.runner = make_runner(settings, config.isolation, config.timeout_s, list(families))
        if "flashinfer" in families:
            self.prebuild = start_prebuild([b.workload for b in config.buckets])
        if getattr(self.runner, "isolated", False):
            self.ceilings = CeilingsProbe().start()
            self._thread = threading.Thread(target=self._start_worker, name="mla-tune-worker-start",
                                            daemon=True)
            self._thread.start()

    def _start_worker(self) -> None:
        try:
            self.runner.start()
        except BaseException as e:  # noqa: BLE001 - re-raised in the sweep's thread by wait()
            self.error = e

    def wait(self) -> float:
        """Wait for the worker to be up (re-raises its start's error); the seconds waited."""
        t0 = time.monotonic()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err
        return time.monotonic() - t0

    def close(self) -> None:
        """End what was started (the runner's worker and the probe; the sweep's own finally
        ends the JIT build with the Triton one)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.ceilings is not None:
            self.ceilings.close()
        if self.runner is not None:
            self.runner.close()

