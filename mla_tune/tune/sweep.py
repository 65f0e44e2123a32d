"""The sweep's entry point: every bucket searched in this process, or with `gpus` in one worker
process per GPU. The sweep's parts, each in its own module:

    buckets.py        plan_buckets(...) -> [Bucket]; the device's default space; flag parsers
    sweep_config.py   SweepConfig: what to measure and how; SweepError, SweepInputError
    sweep_flags.py    build_config(**flags) -> SweepConfig; estimate_note(plan)
    sweep_check.py    check_sweep_config(config): every input checked before anything is written
    sweep_plan.py     plan_sweep(config, store) -> SweepPlan: families, spaces, modes, budgets
    sweep_start.py    EarlyStart, CeilingsProbe: what starts before planning
    sweep_measure.py  Measurer: answers candidates from the store or measures and commits them
    sweep_shared.py   buckets as studies in a shared optuna storage (several workers)
    sweep_run.py      run_in_process(config, observer): plan, search, choose, emit in this process
    sweep_finish.py   choose winners over the swept trials, emit the tuned config
    sweep_outcome.py  SweepObserver (events), BucketOutcome, SweepOutcome
    replay.py         replay_sweep(db, config): the same search over stored measurements
    distributed.py    run_workers(config, gpus): one worker process per GPU, then a final pass

Without CUDA the sweep measures the torch reference on the CPU (sweep_plan.CPU_REFERENCE_NOTE
says why); its numbers test the pipeline, not a kernel. The library prints nothing: progress goes
to a SweepObserver (the CLI's draws a rich progress bar).
"""

from __future__ import annotations

from mla_tune.tune.sweep_config import SweepConfig
from mla_tune.tune.sweep_outcome import SweepObserver, SweepOutcome
from mla_tune.tune.sweep_run import run_in_process


def run_sweep(config: SweepConfig, observer: SweepObserver | None = None) -> SweepOutcome:
    """Search every bucket, measuring what the store does not hold yet and committing each trial
    as its batch returns; then choose winners over the swept buckets' trials and emit the config.
    With `config.gpus`, one worker process per GPU shares the work (distributed.run_workers).
    Raises SweepError when no kernel family can run here, StoreError for a DB it must not touch."""
    if config.gpus:
        from mla_tune.tune.distributed import run_workers
        from mla_tune.tune.sweep_check import check_sweep_config
        # the launcher seeds the shared studies (results DB, storage) before any worker checks
        # its inputs: every input checked here first, before anything is written
        check_sweep_config(config, families=False)
        return run_workers(config, list(config.gpus), observer)
    return run_in_process(config, observer)
