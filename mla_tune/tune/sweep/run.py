"""The sweep's entry point (`run_sweep`): every bucket searched in this process, or with `gpus`
in one worker process per GPU. The package's docstring maps its parts."""

from __future__ import annotations

from mla_tune.tune.sweep.check import check_sweep_config
from mla_tune.tune.sweep.config import SweepConfig
from mla_tune.tune.sweep.distributed import run_workers
from mla_tune.tune.sweep.in_process import run_in_process
from mla_tune.tune.sweep.outcome import SweepObserver, SweepOutcome


def run_sweep(config: SweepConfig, observer: SweepObserver | None = None) -> SweepOutcome:
    """Search every bucket, measuring what the store does not hold yet and committing each trial
    as its batch returns; then choose winners over the swept buckets' trials and emit the config.
    With `config.gpus`, one worker process per GPU shares the work (distributed.run_workers).
    Raises SweepError when no kernel family can run here, StoreError for a DB it must not touch."""
    if config.gpus:
        # the launcher seeds the shared studies (results DB, storage) before any worker checks
        # its inputs: every input checked here first, before anything is written
        check_sweep_config(config, families=False)
        return run_workers(config, list(config.gpus), observer)
    return run_in_process(config, observer)
