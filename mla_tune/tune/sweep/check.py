"""Every value and path of a sweep checked against its rule (mla_tune.validate) before the sweep
writes anything: no DB row, no journal, no config is made for a sweep that is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mla_tune import validate as v
from mla_tune.families import family_names
from mla_tune.store.sqlite_file import is_results_db
from mla_tune.tune.study_storage import check_rdb_url, is_rdb_url, storage_file
from mla_tune.tune.sweep.buckets import default_db, detect_device, journal_path_for
from mla_tune.tune.sweep.config import (SweepConfig, SweepError, SweepInputError, default_families,
                                        sweep_profile)
from mla_tune.tune.sweep.plan import resolve_families
from vllm_metax.core.choices import SPECS
from vllm_metax.core.profile import get_profile


def check_search_settings(config: SweepConfig) -> None:
    """The search and choice settings a live sweep and a replay share, each by its rule."""
    v.check_int("seed", config.seed, "--seed")
    v.check_int("grid_max", config.grid_max, "--grid-max")
    if config.max_trials is not None:
        v.check_int("trials", config.max_trials, "--trials")
    if config.patience is not None:
        v.check_int("patience", config.patience, "--patience")
    v.check_float("min_ratio", config.min_ratio, "--min-ratio")


def check_sweep_config(config: SweepConfig, families: bool = True) -> SweepConfig:
    """Every value and path of a live sweep checked against its rule (mla_tune.validate), the
    device defaults filled in (DB, emit); raises before the sweep writes anything: no DB row, no
    journal, no config. Returns the config with `device`, `db` and `emit` resolved.
    `families=False` leaves out whether any kernel family can run here (check_families: it
    imports the kernels' packages, FlashInfer and vLLM, seconds of the sweep's start-up)."""
    device = config.device or detect_device()
    db = Path(config.db) if config.db is not None else default_db(device)
    emit = config.emit if config.emit is not None else device.startswith("cuda")
    check_search_settings(config)
    if config.profile is not None:
        try:
            get_profile(config.profile)
        except ValueError as e:
            raise v.InputError(f"--profile: {e}") from None
    v.check_name("--name", config.name)
    v.check_float("timeout", config.timeout_s, "--timeout")
    v.check_float("time_budget", config.time_budget_s, "--time-budget")
    if config.settings is not None:
        v.check_int("samples", config.settings.samples, "--samples")
        v.check_int("warmup", config.settings.warmup, "--warmup")
    if len(config.buckets) > v.MAX_BUCKETS:
        raise v.InputError(f"{len(config.buckets)} buckets is more than one sweep takes "
                           f"({v.MAX_BUCKETS}); split it")
    if not config.buckets:
        raise v.InputError("no bucket to sweep")
    if config.families is not None:
        names = list(config.families)
        unknown = [n for n in names if n not in family_names()]
        if not names or unknown:
            raise SweepInputError(f"unknown kernel family {', '.join(map(repr, unknown or ['']))}; "
                                  f"known: {', '.join(family_names())}")
    check_page_sizes(config.page_sizes,
                     config.families or default_families(device, sweep_profile(config)))
    if config.mix is not None:
        config.mix.check_covers({(b.workload.batch_size, b.workload.context_len)
                                 for b in config.buckets}, "the sweep's buckets")
    journal = None
    if config.journal is not False and config.storage is None:
        journal = Path(config.journal) if config.journal else journal_path_for(db)
    check_sweep_paths(db, journal, config.storage, config.configs_dir if emit else None)
    v.output_file(db, "--db", own=is_results_db)
    check_storage(config)
    if journal is not None:
        v.output_file(journal, "--journal", own=v.is_optuna_journal)
    if emit:
        v.output_folder(config.configs_dir, "--configs-dir")
    config = replace(config, device=device, db=db, emit=emit)
    if families:
        check_families(config)
    return config


def check_page_sizes(page_sizes, families) -> None:
    """The sweep's page sizes, checked here only: each a KV block size the plugin serves
    (tuned_config.PAGE_SIZES), and one that a family of the sweep runs at (its spec's page rule,
    `vllm_metax.core.choices.SPECS`), so no page asked for is left out without a word. A family
    without a spec (the CPU reference, a test's) runs at any page."""
    if not page_sizes:
        raise v.InputError("no page size to sweep")
    for p in page_sizes:
        v.check_page_size(p, "--page-size")
    rules = {f: SPECS[f].page for f in families if f in SPECS}
    if len(rules) < len(families):
        return
    for p in page_sizes:
        if not any(rule.allows(p) for rule in rules.values()):
            raise v.InputError(f"--page-size {p}: no kernel family of this sweep runs at it ("
                               + "; ".join(f"{f}: page {rule}" for f, rule in rules.items()) + ")")


def check_sweep_paths(db, journal, storage, configs_dir) -> None:
    """The files a sweep writes are distinct files (validate.check_distinct_paths): the results
    DB, the optuna journal or a --storage's file (a sqlite:/// URL's included), the configs
    folder. A journal written over the results DB would be set aside as damaged with the DB's
    trials in it."""
    v.check_distinct_paths(("--db", db), ("--journal", journal),
                           ("--storage", storage_file(storage) if storage is not None else None),
                           ("--configs-dir", configs_dir))


def check_storage(config: SweepConfig) -> None:
    """--storage and --heartbeat by the rules --journal has: a journal file must be an optuna
    journal (or new, or empty) in a folder that can take it; an RDB URL must parse, and a
    SQLite one must name optuna's own DB (never a results DB or another file); a heartbeat is
    bounded and applies to an RDB storage only."""
    storage = config.storage
    if storage is not None:
        if not str(storage).strip():
            raise v.InputError("--storage: empty; name a journal file or an RDB URL "
                               "(postgresql://user@host/db)")
        if is_rdb_url(storage):
            check_rdb_url(str(storage))
        else:
            v.output_file(storage, "--storage", own=v.is_optuna_journal)
    if config.heartbeat_s is not None:
        v.check_int("heartbeat", config.heartbeat_s, "--heartbeat")
        if storage is None or not is_rdb_url(storage):
            raise v.InputError("--heartbeat applies to an RDB --storage only (postgresql://...); "
                               "a journal file's workers are watched by their pid")


def check_families(config: SweepConfig) -> tuple[dict, dict]:
    """resolve_families for `config` (device resolved); SweepError when no family can run."""
    backends, skipped = resolve_families(config.families, config.device, sweep_profile(config))
    if not backends:
        why = "; ".join(f"{f}: {r}" for f, r in skipped.items())
        raise SweepError(f"no kernel family can run on {config.device} ({why})")
    return backends, skipped

