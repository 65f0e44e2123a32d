"""The end of a sweep: the winners chosen over the swept buckets' trials (mla_tune.tune.choose)
and the tuned config written (mla_tune.tune.emit)."""

from __future__ import annotations

from pathlib import Path

from mla_tune.store.selection import profile_clause
from mla_tune.tune.choose import choose
from mla_tune.tune.emit import emit_config
from mla_tune.tune.sweep.config import SweepConfig
from mla_tune.tune.sweep.outcome import SweepOutcome


def finish_sweep(outcome: SweepOutcome, config: SweepConfig, store, device_name: str) -> None:
    """Choose winners over the trials of the outcome's buckets on this device (outcome.rows,
    outcome.choice) and, where the config says so, emit the tuned config (outcome.emitted or
    outcome.emit_note)."""
    plan = outcome.plan
    outcome.rows = rows_for(store, [p.workload_id for p in plan.buckets], device_name, plan.profile)
    outcome.choice = choose_winners(outcome.rows, config, device_name)
    if config.emit and outcome.choice is not None:
        outcome.emitted, outcome.emit_note = emit_tuned_config(outcome, config, store)
    elif outcome.choice is not None and plan.kind == "cpu-reference":
        outcome.emit_note = (f"no tuned config written: the CPU reference is not a serving "
                             f"device (--emit --configs-dir DIR writes one); the trials are "
                             f"in {config.db}")


def rows_for(store, workload_ids: list, device_name: str, profile: str = "") -> list:
    """The stored trial rows of these workloads on this device (measured under `profile`, where
    given)."""
    clause, more = profile_clause(profile) if profile else ("1=1", [])
    rows = []
    ids = sorted(set(i for i in workload_ids if i is not None))
    for k in range(0, len(ids), 500):
        chunk = ids[k:k + 500]
        rows += store.trials(f"t.workload_id in ({','.join('?' * len(chunk))}) and r.device_name = ? "
                             f"and {clause}", [*chunk, device_name, *more])
    return rows


def choose_winners(rows: list, config: SweepConfig, device_name: str):
    """choose.choose over `rows` with the config's mix and rules (None without rows)."""
    if not rows:
        return None
    return choose(rows, config.mix, device_name=device_name, p_threshold=config.p_threshold,
                  min_ratio=config.min_ratio)


def emit_tuned_config(outcome: SweepOutcome, config: SweepConfig, store=None) -> tuple[Path | None, str]:
    """Write the tuned config of `outcome.choice` through mla_tune.tune.emit.emit_config (the
    writer `mla-tune emit` uses); (path, "") or (None, why not)."""
    try:
        # config.emit is True here: for the CPU reference that was asked for explicitly
        path = emit_config(outcome.choice, config.configs_dir, store=store, mix=config.mix,
                           cpu_ok=True, profile=outcome.plan.profile or None)
    except Exception as e:  # noqa: BLE001 - the trials are stored; the config can be emitted later
        return None, (f"no tuned config written ({type(e).__name__}: {e}); the trials are stored: "
                      f"`mla-tune emit --db {config.db}` writes it later")
    return (Path(path) if path else None), ""


