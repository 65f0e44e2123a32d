"""The sweep: every bucket's candidates searched and measured, each trial stored, winners chosen,
the tuned config emitted. Its parts, a module each (this package imports none of them, so that
the CLI can read `config` without loading torch):

    run.py            run_sweep(config, observer): the entry point (in process, or one worker per GPU)
    buckets.py        plan_buckets(...) -> [Bucket]; the device's default space; flag parsers
    config.py         SweepConfig: what to measure and how; SweepError, SweepInputError
    request.py        SweepRequest: the command's flags, their one check, the SweepConfig they make
    check.py          check_sweep_config(config): every input checked before anything is written
    plan.py           plan_sweep(config, store) -> SweepPlan: families, spaces, modes, budgets
    start.py          EarlyStart, CeilingsProbe: what starts before planning
    measure.py        Measurer: answers candidates from the store or measures and commits them
    in_process.py     run_in_process(config, observer): plan, search, choose, emit in this process
    finish.py         choose winners over the swept trials, emit the tuned config
    outcome.py        SweepObserver (events), BucketOutcome, SweepOutcome
    shared.py         buckets as studies in a shared optuna storage (several workers)
    shared_bucket.py  SharedBucket: one bucket's study in that storage, claimed trial by trial
    distributed.py    run_workers(config, gpus): one worker process per GPU, then a final pass
    replay.py         replay_sweep(db, config): the same search over stored measurements

Without CUDA the sweep measures the torch reference on the CPU (plan.CPU_REFERENCE_NOTE says
why); its numbers test the pipeline, not a kernel. The library prints nothing: progress goes to a
SweepObserver (the CLI's draws a rich progress bar).
"""
