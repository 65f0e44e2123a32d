"""Which trials a report or a tuned config covers: the filter, the device key, the selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from mla_tune.store.records import TrialRecord
from mla_tune.validate import InputError, check_int, check_name
from vllm_metax.core.device import METAX_NAME_PREFIXES, is_metax_name
from vllm_metax.core.profile import METAX, NVIDIA, get_profile

# runs.kind values, as stored
GPU_RUN_KIND = "gpu"
CPU_RUN_KIND = "cpu-reference"     # timings of the CPU torch reference, not of a GPU kernel


class SelectionError(ValueError):
    """No trial matches the selection; the message says what the DB holds instead."""


def device_key(name: str | None) -> str:
    """Device names compare as the tuned-config file names do: case-insensitive, spaces as _."""
    return (name or "").strip().replace(" ", "_").lower()


def run_profile(run: Mapping) -> str:
    """The target profile a run measured under (`vllm_metax.core.profile`): its record's, else
    (runs stored before profiles) the one its device implies: metax on a MetaX device."""
    name = run.get("profile")
    if isinstance(name, str) and name:
        return name
    return METAX if is_metax_name(str(run.get("device_name") or "")) else NVIDIA


def profile_clause(profile: str) -> tuple[str, list]:
    """SQL over ResultsStore.trials()'s aliases (r runs) selecting runs measured under `profile`,
    by `run_profile`'s rule: the run record's `profile`, else its device's."""
    metax_name = " or ".join("lower(trim(r.device_name)) like ?" for _ in METAX_NAME_PREFIXES)
    implied = f"case when {metax_name} then '{METAX}' else '{NVIDIA}' end"
    return (f"coalesce(json_extract(r.notes, '$.profile'), {implied}) = ?",
            [f"{p}%" for p in METAX_NAME_PREFIXES] + [profile])


@dataclass(frozen=True)
class TrialFilter:
    """Which trials a report (or an emitted config) covers; empty fields select everything."""

    device: str | None = None        # "NVIDIA H200" or "NVIDIA_H200"
    model: str | None = None         # model preset name as stored ("deepseek-v3")
    runs: tuple = ()                 # run ids
    profile: str | None = None       # the target profile the runs measured under

    def __post_init__(self):
        if self.device is not None:
            check_name("--device", self.device)
        if self.model is not None:
            check_name("--model", self.model)
        if self.profile is not None:
            try:
                get_profile(self.profile)
            except ValueError as e:
                raise InputError(f"--profile: {e}") from None
        for r in self.runs:
            check_int("run", r, "--run")

    def where(self) -> tuple[str, list]:
        """A WHERE clause over ResultsStore.trials()'s aliases (t trials, w workloads, r runs)."""
        clauses, args = [], []
        if self.device:
            clauses.append("replace(lower(trim(r.device_name)), ' ', '_') = ?")
            args.append(device_key(self.device))
        if self.model:
            clauses.append("lower(w.model) = ?")
            args.append(self.model.strip().lower())
        if self.runs:
            clauses.append(f"t.run_id in ({','.join('?' * len(self.runs))})")
            args += [int(r) for r in self.runs]
        if self.profile:
            clause, more = profile_clause(self.profile)
            clauses.append(clause)
            args += more
        return " and ".join(clauses) or "1=1", args

    def describe(self) -> str:
        parts = []
        if self.device:
            parts.append(f"device {self.device!r}")
        if self.model:
            parts.append(f"model {self.model!r}")
        if self.runs:
            parts.append("run" + ("s " if len(self.runs) > 1 else " ") + ", ".join(map(str, self.runs)))
        if self.profile:
            parts.append(f"profile {self.profile!r}")
        return ", ".join(parts) or "all trials"


def select_trials(store, flt: TrialFilter = TrialFilter()) -> list[TrialRecord]:
    """The filter's trials (`ResultsStore.records()`); SelectionError when none match."""
    records = store.records(*flt.where())
    if records:
        return records
    db = store.db
    if not db["trials"].count:
        raise SelectionError(f"{store.path} holds no trials yet (run `mla-tune sweep` first)")
    if not store.trial_count() and store.trial_count(prefill=True):
        raise SelectionError(f"no decode trials in {store.path} match {flt.describe()}: it holds "
                             "prefill trials only (`mla-tune prefill-sweep`), "
                             "a decode sweep is needed (`mla-tune sweep --db` this file, or "
                             "`mla-tune merge` it into the DB that holds one)")
    devices = sorted({r[0] for r in db.execute("select distinct device_name from runs r "
                                               "join trials t on t.run_id = r.id")})
    models = sorted({r[0] for r in db.execute("select distinct model from workloads")})
    runs = sorted({r[0] for r in db.execute("select distinct run_id from trials")})
    raise SelectionError(f"no trials in {store.path} match {flt.describe()}; it holds devices "
                         f"{', '.join(map(repr, devices))}; models {', '.join(models)}; "
                         f"runs {', '.join(map(str, runs))}")
