"""What `mla-tune sweep` is asked (SweepRequest: its flags as typed values), the one check of the
rules between them, and the SweepConfig a live sweep or a replay runs from it.

    SweepRequest(batches="1-8", page_size=(16, 64), ...).config()   -> SweepConfig (live sweep)
    SweepRequest(replay=Path("results.db")).replay_config()          -> SweepConfig (replay)

Each value is checked where its rule lives: the rules between flags here (`SweepRequest.check`),
the values and paths of the config it becomes in check.check_sweep_config (page sizes, samples,
files), once each."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Callable

from mla_tune.problem.workload import DTYPES, WorkloadMix, model_preset
from mla_tune.store.traffic import DEFAULT_SHARE
from mla_tune.tune.search import GRID_MAX, PATIENCE
from mla_tune.tune.sweep.buckets import (Bucket, default_db, default_space, detect_device,
                                         measure_settings, parse_duration, parse_sizes,
                                         plan_buckets, resolve_lengths)
from mla_tune.tune.sweep.config import HEARTBEAT_S, SweepConfig
from mla_tune.tune.sweep.distributed import parse_gpus
from mla_tune.tune.traffic_plan import TrafficPlan, decode_plan
from mla_tune.tune.verdict import MIN_RATIO
from mla_tune.validate import FLOAT, InputError, check_int, check_name

DEFAULT_MODEL = "deepseek-v3"
# flags that only a live sweep uses, and the one only a replay uses: given to the other, refused
LIVE_ONLY = ("db", "lengths", "q_dtype", "kv_dtype", "page_size", "family", "time_budget", "timeout",
             "samples", "warmup", "isolation", "remeasure", "configs_dir", "emit", "journal", "name")
REPLAY_ONLY = ("device_name",)


def flag(name: str) -> str:
    """A request field as its command-line flag: page_size -> --page-size."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class SweepRequest:
    """One `mla-tune sweep` command: each field is the flag of that name (None: not given, the
    device's default), as the CLI parsed it. `given`: the flags set on the command line (None:
    those that differ from their default, for a request built in code); `device`: where a live
    sweep measures (None: this machine's); `command`: the command line, recorded with the run."""

    db: Path | None = None
    model: str | None = None
    tp: tuple | None = None
    batches: str | None = None
    contexts: str | None = None
    q_len: tuple | None = None
    lengths: str | None = None
    q_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    page_size: tuple | None = None
    family: tuple | None = None
    profile: str | None = None
    mode: str = "auto"
    grid_max: int = GRID_MAX
    trials: int | None = None
    patience: int = PATIENCE
    time_budget: str | None = None
    timeout: float | None = None
    samples: int | None = None
    warmup: int | None = None
    isolation: str = "auto"
    remeasure: bool = False
    replay: Path | None = None
    device_name: str | None = None
    mix: Path | None = None
    traffic: Path | None = None
    traffic_share: float = DEFAULT_SHARE
    min_ratio: float = MIN_RATIO
    seed: int = 0
    name: str = "sweep"
    configs_dir: Path = Path("configs")
    emit: bool | None = None
    journal: Path | None = None
    gpus: str | None = None
    storage: str | None = None
    heartbeat: int = HEARTBEAT_S
    dry_run: bool = False
    device: str | None = None
    command: str = ""
    given: frozenset | None = None

    def __post_init__(self):
        for name in ("tp", "q_len", "page_size", "family"):
            # a repeatable flag: a tuple of its values, or None where it is not given at all
            object.__setattr__(self, name, tuple(getattr(self, name) or ()) or None)
        if self.given is None:
            object.__setattr__(self, "given", frozenset(
                f.name for f in fields(self)
                if f.name not in ("device", "command", "given") and getattr(self, f.name) != f.default))

    # ------------------------------------------------------------------ the check
    def check(self) -> None:
        """The rules between the flags (what does not apply to a replay or a live sweep, what
        excludes what, what needs what), each refused with one line (InputError); the values
        themselves are checked by their rules where they are used."""
        replay = self.replay is not None
        ignored = self._given(*(LIVE_ONLY if replay else REPLAY_ONLY))
        if ignored:
            what = "a replay (it measures and writes nothing)" if replay else "a live sweep"
            raise InputError(f"{', '.join(map(flag, ignored))} {'does' if len(ignored) == 1 else 'do'} "
                             f"not apply to {what}; {'drop --replay' if replay else 'add --replay DB'} "
                             "or the flag")
        if self.traffic is not None:
            clash = self._given("mix") + ([] if replay else self._given("batches", "contexts", "q_len"))
            if clash:
                raise InputError(f"--traffic decides the buckets and weights; drop "
                                 f"{', '.join(map(flag, clash))}")
            FLOAT["share"].check("--traffic-share", self.traffic_share)
        elif self._given("traffic_share"):
            raise InputError("--traffic-share applies only with --traffic FILE")
        if self.heartbeat < 1:
            raise InputError(f"--heartbeat must be at least 1 s, got {self.heartbeat}")
        if self.storage is not None and self.journal is not None:
            raise InputError("--storage and --journal exclude each other (a journal file is a --storage)")
        if self.gpu_list and replay:       # parsed (and refused if bad) whenever given
            raise InputError("--gpus measures; --replay measures nothing: use one of them")
        if self.dry_run and replay:
            raise InputError("--dry-run plans a live sweep; a --replay measures nothing already")
        if self.model is not None:
            check_name("--model", self.model)
        if replay:
            return
        for dt in (self.q_dtype, self.kv_dtype):
            if dt not in DTYPES:
                raise InputError(f"unsupported dtype {dt!r}; one of {', '.join(DTYPES)}")
        for q in self.q_len or ():
            check_int("q_len", q, "--q-len")
        for t in self.tp or ():
            check_int("tp", t, "--tp")
        if self._given("configs_dir", "emit"):
            cpu = not self.live_device.startswith("cuda")
            if self.emit and cpu and not self._given("configs_dir"):
                raise InputError("--emit without CUDA writes the CPU reference's config: name the "
                                 "folder with --configs-dir (the packaged configs/ are for serving "
                                 "devices)")
            if self._given("configs_dir") and not (self.emit if self.emit is not None else not cpu):
                raise InputError("--configs-dir applies only when the sweep writes a tuned config: "
                                 + ("add --emit (without CUDA none is written by default)"
                                    if cpu and self.emit is None else "drop --no-emit"))

    def _given(self, *names: str) -> list[str]:
        return [n for n in names if n in self.given]

    # ------------------------------------------------------------------ what it resolves to
    @cached_property
    def live_device(self) -> str:
        """Where a live sweep measures: `device`, else this machine's (torch: cuda or cpu)."""
        return self.device or detect_device()

    @cached_property
    def gpu_list(self) -> list[str] | None:
        """--gpus as the GPUs one worker each is started on (None without it)."""
        return parse_gpus(self.gpus) if self.gpus is not None else None

    @cached_property
    def traffic_plan(self) -> TrafficPlan | None:
        """--traffic's decode plan (its log2 cells and step weights; None without it), read once."""
        if self.traffic is None:
            return None
        return decode_plan(self.traffic, self.traffic_share, self.model or DEFAULT_MODEL, self.tp)

    def config(self) -> SweepConfig:
        """The live sweep's SweepConfig (checked first: `check`), this machine's defaults
        filling the gaps (DefaultSpace: buckets, page sizes, samples, budget; results DB:
        default_db; a tuned config emitted on a GPU only). Raises InputError, or a ValueError /
        ProblemError with one line, for anything it cannot use."""
        self.check()
        if self.replay is not None:
            raise InputError("a --replay request has no live sweep: use replay_config()")
        device = self.live_device
        d = default_space(device)
        samples = self.samples if self.samples is not None else d.samples
        budget = parse_duration(self.time_budget) if self.time_budget is not None else d.time_budget_s
        return SweepConfig(
            buckets=self.buckets(), page_sizes=self.page_size or d.page_sizes, device=device,
            db=self.db if self.db is not None else default_db(device),
            emit=self.emit if self.emit is not None else device.startswith("cuda"),
            settings=measure_settings(device, samples, self.warmup if self.warmup is not None else d.warmup),
            timeout_s=self.timeout if self.timeout is not None else d.timeout_s,
            time_budget_s=budget, **self._search_fields())

    def buckets(self) -> list[Bucket]:
        """The buckets a live sweep measures: --traffic's cells, else --batches x --contexts x
        --q-len (the device's defaults where not given) at each --tp, with --lengths (a
        distribution or a CSV trace); the default grid gets the device's ragged buckets too."""
        d = default_space(self.live_device)
        dims = model_preset(self.model or DEFAULT_MODEL)
        kind, trace = resolve_lengths(self.lengths) if self.lengths is not None else ("uniform", None)
        plan = self.traffic_plan
        tps = (plan.tp_size,) if plan is not None else self.tp or d.tp_sizes
        qs = tuple(sorted(set(self.q_len))) if self.q_len else (1,)
        dtypes = (self.q_dtype, self.kv_dtype)
        if plan is not None:
            return [bk for b, c, q in plan.cells
                    for bk in plan_buckets(dims, tps, [b], [c], [q], kind, *dtypes, trace)]
        buckets = plan_buckets(
            dims, tps, parse_sizes(self.batches, "batch") if self.batches is not None else d.batch_sizes,
            parse_sizes(self.contexts, "context") if self.contexts is not None else d.context_lens,
            qs, kind, *dtypes, trace)
        if self.lengths is None and self.batches is None and self.contexts is None:
            for extra_kind, extra_b, extra_c in d.ragged:
                buckets += plan_buckets(dims, tps, extra_b, extra_c, qs, extra_kind, *dtypes)
        return buckets

    def replay_config(self) -> SweepConfig:
        """A replay's SweepConfig (checked first: `check`): the search and choice settings;
        nothing is measured, stored or emitted, so no bucket, DB or storage is named."""
        self.check()
        return SweepConfig(buckets=[], **{**self._search_fields(), "emit": False, "journal": False,
                                          "storage": None})

    def replay_filter(self) -> Callable[[Bucket], bool]:
        """Which stored buckets a replay searches: the flags given narrow them; none given, all."""
        want_b = set(parse_sizes(self.batches, "batch")) if self.batches is not None else None
        want_c = set(parse_sizes(self.contexts, "context")) if self.contexts is not None else None
        model = self.model.lower() if self.model is not None else None

        def keep(b: Bucket) -> bool:
            w = b.workload
            return ((model is None or b.model == model) and (not self.tp or b.tp_size in self.tp)
                    and (want_b is None or w.batch_size in want_b)
                    and (want_c is None or w.context_len in want_c)
                    and (not self.q_len or w.q_len in self.q_len))

        return keep

    def _search_fields(self) -> dict:
        """The SweepConfig fields a live sweep and a replay take alike."""
        plan = self.traffic_plan
        mix = plan.mix if plan is not None else (WorkloadMix.from_file(str(self.mix)) if self.mix else None)
        return dict(families=self.family, profile=self.profile, mode=self.mode,
                    grid_max=self.grid_max, max_trials=self.trials, patience=self.patience or None,
                    seed=self.seed, isolation=self.isolation, remeasure=self.remeasure,
                    name=self.name, journal=self.journal, mix=mix, min_ratio=self.min_ratio,
                    configs_dir=self.configs_dir, storage=self.storage,
                    heartbeat_s=self.heartbeat if self._given("heartbeat") else None,
                    gpus=self.gpu_list, command=self.command)


__all__ = ["LIVE_ONLY", "REPLAY_ONLY", "SweepRequest", "flag"]
