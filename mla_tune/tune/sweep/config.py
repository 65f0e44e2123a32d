"""What a sweep is asked to do (SweepConfig), the families it runs by default, and its errors.

A SweepConfig is built from a command's flags by request.SweepRequest.config, checked by
check.check_sweep_config and run by run.run_sweep."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from mla_tune.problem.defaults import SWEEP_PAGE_SIZES
from mla_tune.problem.workload import WorkloadMix
from mla_tune.tune.search import GRID_MAX, PATIENCE, SearchPolicy
from mla_tune.tune.verdict import MIN_RATIO, P_THRESHOLD
from vllm_metax.core.profile import NVIDIA, PROFILES, Profile, target_profile

if TYPE_CHECKING:       # measure.trial imports torch: `mla-tune --help` must not wait for it
    from mla_tune.measure.trial import MeasureSettings

# A GPU sweep's default families are its profile's (`vllm_metax.core.profile.Profile.sweep_families`):
# on NVIDIA flashinfer, triton, split and fa3_mla (vLLM's FA3 MLA kernel, Hopper only: refused with
# its reason elsewhere; split and fa3_mla are served by FLASHINFER_MLA's decode in the buckets they
# win; flashmla opt-in), on MetaX flashmla first (the vendor's baseline), then flashinfer, triton
# and split.
GPU_FAMILIES = PROFILES[NVIDIA].sweep_families
CPU_FAMILIES = ("reference",)
HEARTBEAT_S = 10        # RDB storages: seconds between heartbeats of a claimed trial


def sweep_profile(config) -> Profile:
    """The target profile a sweep measures under: --profile, else the active one
    ($VLLM_METAX_PROFILE, else the device's)."""
    return target_profile(config.profile or None)


def default_families(device: str, profile: Profile) -> tuple:
    """The families a sweep measures when none is named: the profile's on a GPU, else the CPU
    reference."""
    return tuple(profile.sweep_families) if str(device).startswith("cuda") else CPU_FAMILIES


class SweepError(Exception):
    """A sweep that cannot start or cannot produce anything (the message says why)."""


class SweepInputError(SweepError, ValueError):
    """A sweep asked for something that does not exist (an unknown family, an empty replay DB)."""


@dataclass
class SweepConfig:
    """What to sweep and how. `families=None` picks by device (GPU: the profile's families; CPU:
    the reference); `time_budget_s=0` and `max_trials=None` mean no limit; `journal=None` puts the
    optuna study next to the DB (False: keep it in memory); `db=None` is default_db(device) and
    `emit=None` emits on a GPU only (the CPU reference is not a serving device)."""

    buckets: list
    db: Path | None = None               # None: default_db(device)
    families: Sequence[str] | None = None
    page_sizes: Sequence[int] = SWEEP_PAGE_SIZES
    device: str | None = None
    settings: MeasureSettings | None = None
    mode: str = "auto"
    grid_max: int = GRID_MAX
    max_trials: int | None = None
    patience: int | None = PATIENCE
    time_budget_s: float = 0.0
    batch: int = 32                      # candidates per worker round trip (one interleaved set)
    seed: int = 0
    timeout_s: float = 120.0
    isolation: str = "auto"
    remeasure: bool = False
    name: str = "sweep"
    journal: Path | bool | None = None
    mix: WorkloadMix | None = None
    min_ratio: float = MIN_RATIO
    p_threshold: float = P_THRESHOLD
    emit: bool | None = None             # None: on a GPU yes, for the CPU reference no
    configs_dir: Path = Path("configs")
    command: str = ""
    storage: str | None = None          # shared optuna storage: RDB URL or journal file (None: journal)
    heartbeat_s: int | None = None      # RDB storages: heartbeat of a claimed trial
    gpus: Sequence[str] | None = None   # one worker process per GPU (mla_tune.tune.sweep.distributed)
    worker_index: int = 0
    worker_count: int = 1
    role: str = "single"                # single | worker (measures only) | final (after workers)
    study_tag: str = ""                 # set once per --remeasure launch: fresh studies for it
    profile: str | None = None          # the target profile (vllm_metax.core.profile); None: active

    def policy(self, deadline: float | None) -> SearchPolicy:
        return SearchPolicy(self.mode, self.grid_max, self.max_trials, deadline, self.patience,
                            self.batch, seed=self.seed)

