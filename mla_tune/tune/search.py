"""How one bucket's candidates are searched, with optuna: every point when the space is small
(grid), TPE when it is large; by the space's size ("auto") or by flag.

The space is what the kernel families declare for the workload (their constraints applied), less
what further constraints drop, before anything runs. Optuna sees it structured, not as a flat
list: a "kernel" (family/backend) choice, then per kernel its page size and knobs, ordered values
as integer indices so TPE can learn that neighbours behave alike (`SearchSpace.suggest`). A
combination that the families never declared is pruned without being measured.

The family defaults are always evaluated first: every winner is judged against them. Candidates
are evaluated in batches through a callback (the sweep measures a batch interleaved in one worker;
the replay runner looks them up), and the search stops at the first of: space exhausted, trial
budget, wall-time deadline, or TPE patience (no improvement for N new trials). When TPE proposes
a point already evaluated, an unseen neighbour of it (one knob one step away) is evaluated
instead, or, with the neighbourhood exhausted, an unseen point at random. After TPE, each family's
best point is also measured at every other page size (the page size is a global choice).
"""

from __future__ import annotations

import math
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Sequence

from mla_tune.families.base import Candidate
from mla_tune.problem.defaults import DEFAULT_PAGE_SIZE



class SearchMode(str, Enum):
    """How a bucket's space is searched: every point, optuna TPE, or grid up to GRID_MAX points."""
    auto = "auto"
    grid = "grid"
    tpe = "tpe"


MODES = tuple(m.value for m in SearchMode)
GRID_MAX = 64            # auto: a space of at most this many points is searched exhaustively
TPE_BATCH = 4            # TPE proposals measured together (interleaved) per round
PATIENCE = 32            # TPE: stop after this many new trials without a 1% improvement
IMPROVEMENT = 0.01
JUMP_AFTER_PRUNED = 16   # TPE: after this many undeclared combinations in a row, jump to a random point


def tpe_trial_budget(space_size: int, grid_max: int = GRID_MAX) -> int:
    """The default number of trials TPE may spend on a space: a quarter of it, at least grid_max/2."""
    return min(space_size, max(grid_max // 2, math.ceil(space_size / 4)))


Constraint = Callable[[Candidate], "str | None"]   # a reason to drop the candidate, or None


@dataclass(frozen=True)
class _Axis:
    name: str              # optuna parameter name, "<kernel>:<knob>"
    values: tuple          # sorted
    ordinal: bool          # integer index (ordered numeric values) vs categorical


@dataclass
class SearchSpace:
    """A bucket's candidates after constraints, with the family defaults and the optuna structure."""

    candidates: list[Candidate]
    defaults: list[Candidate]
    dropped: list[tuple[Candidate, str]] = field(default_factory=list)
    _axes: dict = field(default_factory=dict, repr=False)
    _by_point: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, candidates: Sequence[Candidate], defaults: Sequence[Candidate] = (),
              constraints: Sequence[Constraint] = ()) -> "SearchSpace":
        """Deduplicate, apply `constraints` (each returns a reason to drop, or None), index."""
        seen: dict[str, Candidate] = {}
        for c in list(defaults) + list(candidates):
            seen.setdefault(c.key, c)
        kept, dropped = [], []
        for c in seen.values():
            why = next((r for r in (f(c) for f in constraints) if r), None)
            (dropped.append((c, why)) if why else kept.append(c))
        keys = {c.key for c in kept}
        space = cls(kept, [d for d in dict.fromkeys(defaults) if d.key in keys], dropped)
        space._index()
        return space

    def __len__(self) -> int:
        return len(self.candidates)

    @staticmethod
    def kernel_of(c: Candidate) -> str:
        return f"{c.family}/{c.backend}"

    def _index(self) -> None:
        per_kernel: dict[str, list[Candidate]] = {}
        for c in self.candidates:
            per_kernel.setdefault(self.kernel_of(c), []).append(c)
        self._axes = {}
        for k, cs in sorted(per_kernel.items()):
            axes = []
            knobs = sorted({n for c in cs for n in c.params})
            for knob in ["page_size"] + knobs:
                vals = {(c.page_size if knob == "page_size" else c.params.get(knob)) for c in cs}
                numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)
                ordered = tuple(sorted(vals)) if numeric else tuple(sorted(vals, key=repr))
                if len(ordered) > 1:
                    axes.append(_Axis(f"{k}:{knob}", ordered, numeric))
            self._axes[k] = self._independent(k, axes, cs)
        self._by_point = {self._point(c): c for c in self.candidates}

    @staticmethod
    def _independent(kernel: str, axes: list, cs: list[Candidate]) -> list:
        """Leave out axes the others determine (a label such as Triton's rule=vllm marker): they
        add no freedom, only combinations that do not exist. Categorical axes go first."""
        def value(c, ax):
            knob = ax.name.split(":", 1)[1]
            return c.page_size if knob == "page_size" else c.params.get(knob)

        keep = list(axes)
        for ax in sorted(axes, key=lambda a: (a.ordinal, a.name)):
            rest = [a for a in keep if a is not ax]
            if len({tuple(value(c, a) for a in rest) for c in cs}) == len(cs):
                keep = rest
        return keep

    def _point(self, c: Candidate) -> tuple:
        k = self.kernel_of(c)
        vals = []
        for ax in self._axes.get(k, []):
            knob = ax.name.split(":", 1)[1]
            vals.append(c.page_size if knob == "page_size" else c.params.get(knob))
        return (k, tuple(vals))

    def neighbours(self, c: Candidate) -> list[Candidate]:
        """Declared candidates of c's kernel one step away on one axis (the next or previous value
        of an ordered knob, any other value of a categorical one)."""
        k, vals = self._point(c)
        out = []
        for i, ax in enumerate(self._axes.get(k, [])):
            j = ax.values.index(vals[i])
            others = [j - 1, j + 1] if ax.ordinal else [x for x in range(len(ax.values)) if x != j]
            for x in others:
                if 0 <= x < len(ax.values):
                    n = self._by_point.get((k, vals[:i] + (ax.values[x],) + vals[i + 1:]))
                    if n is not None:
                        out.append(n)
        return out

    @property
    def kernels(self) -> list[str]:
        return sorted(self._axes)

    def params_of(self, c: Candidate) -> dict:
        """The optuna parameters that stand for `c` (for enqueueing it)."""
        k, vals = self._point(c)
        out = {"kernel": k} if len(self._axes) > 1 else {}
        for ax, v in zip(self._axes[k], vals):
            out[ax.name] = ax.values.index(v) if ax.ordinal else v
        return out

    def suggest(self, trial) -> Candidate | None:
        """Ask `trial` for a point; the declared candidate there, or None (a dropped combination)."""
        kernels = self.kernels
        k = trial.suggest_categorical("kernel", kernels) if len(kernels) > 1 else kernels[0]
        vals = []
        for ax in self._axes[k]:
            if ax.ordinal:
                vals.append(ax.values[trial.suggest_int(ax.name, 0, len(ax.values) - 1)])
            else:
                vals.append(trial.suggest_categorical(ax.name, list(ax.values)))
        return self._by_point.get((k, tuple(vals)))

    def grid_order(self, by_page: bool = True, first_page: int | None = None) -> list[Candidate]:
        """Every candidate, each family default first: grouped by page size (defaults leading
        their group, so one interleaved batch compares a default with its rivals on one KV
        layout; `first_page`'s group first, so a grid cut by the time budget still has it), or,
        with `by_page=False`, all defaults before everything else."""
        defaults = [d for d in self.defaults]
        rest = sorted((c for c in self.candidates if c not in defaults),
                      key=lambda c: (c.page_size != first_page, c.page_size, c.key))
        if not by_page:
            return defaults + rest
        pages = sorted({c.page_size for c in self.candidates}, key=lambda p: (p != first_page, p))
        return [c for p in pages for c in [d for d in defaults if d.page_size == p]
                + [c for c in rest if c.page_size == p]]


@dataclass(frozen=True)
class Evaluation:
    """One evaluated candidate: its median time (None when invalid) and where it came from."""

    candidate: Candidate
    value: float | None
    cached: bool = False           # answered from earlier measurements, not measured now
    reason: str | None = None      # invalid_reason when value is None
    trial_id: int | None = None

    @property
    def ok(self) -> bool:
        return self.value is not None


@dataclass
class SearchPolicy:
    """How to search: mode, budgets and the sampler seed.

    `max_trials` caps the candidates evaluated per bucket (None: the whole space for the grid,
    `tpe_trial_budget` for TPE); `deadline` is a time.monotonic() value (the sweep may move it
    on, by first-use JIT time); `patience` applies to TPE only; `batch` is the largest set
    measured together (grid batches also never mix page sizes: each batch is one interleaved
    comparison on one KV layout); the grid measures `first_page` (the default KV block size)
    before other page sizes.
    """

    mode: str = "auto"
    grid_max: int = GRID_MAX
    max_trials: int | None = None
    deadline: float | None = None
    patience: int | None = PATIENCE
    batch: int = 16
    tpe_batch: int = TPE_BATCH
    seed: int = 0
    first_page: int | None = DEFAULT_PAGE_SIZE   # the grid measures this page size's group first

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"search mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    def resolve_mode(self, space_size: int) -> str:
        if self.mode != "auto":
            return self.mode
        return "grid" if space_size <= self.grid_max else "tpe"

    def budget(self, space_size: int, mode: str) -> int:
        if self.max_trials:
            return min(self.max_trials, space_size)
        return space_size if mode == "grid" else tpe_trial_budget(space_size, self.grid_max)


@dataclass
class SearchOutcome:
    """What one bucket's search did, in evaluation order."""

    mode: str
    space_size: int
    budget: int
    evaluations: list[Evaluation] = field(default_factory=list)
    stopped: str = "complete"
    proposals: int = 0             # optuna trials asked (repeats and pruned combinations included)

    @property
    def best(self) -> Evaluation | None:
        ok = [e for e in self.evaluations if e.ok]
        return min(ok, key=lambda e: e.value) if ok else None

    @property
    def measured(self) -> int:
        return sum(not e.cached for e in self.evaluations)

    def trials_to_reach(self, key: str) -> int | None:
        """How many evaluations it took until candidate `key` was evaluated (1-based), or None."""
        for i, e in enumerate(self.evaluations, 1):
            if e.candidate.key == key:
                return i
        return None


def open_study(name: str, storage=None, sampler=None, fresh: bool = True):
    """An optuna study for one bucket (minimise microseconds); `fresh` replaces an older one."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if fresh and storage is not None:
        try:
            optuna.delete_study(study_name=name, storage=storage)
        except KeyError:
            pass
    return optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                               direction="minimize", load_if_exists=not fresh)


def journal_storage(path):
    """Optuna's JournalStorage on a file: readable by `optuna-dashboard <path>`, safe to share
    between processes (optuna's SQLite storage locks under parallel use). Appends are not
    fsync'ed (optuna's file backend syncs every one: ~9 per grid trial, milliseconds each):
    what a process wrote survives its kill -9 in the page cache, so resume and dead-worker
    recovery read it; only an OS crash or a full disk can cut the tail, a torn last line that
    optuna's reader skips and the next append cuts away (`_cut_torn_tail`), and every
    measurement is in results.db, which SQLite syncs itself.

    The journal is a cache of what the results DB holds: one optuna cannot read (a line garbled
    or cut in the middle) is set aside as `<path>.damaged` and a new one started, whose studies
    the sweep seeds again and answers from the DB (nothing measured is lost or measured twice)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend
    backend = _unsynced(JournalFileBackend)
    try:
        return JournalStorage(backend(str(path)))
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever optuna's replay of a damaged log raises
        aside = set_aside_damaged_journal(path, e)
    storage = JournalStorage(backend(str(path)))
    storage.rebuilt = aside           # where the damaged journal went (the sweep says so)
    return storage


def set_aside_damaged_journal(path, error: Exception):
    """Rename an unreadable journal to `<path>.damaged[.N]` under its lock (workers opening it at
    once set it aside once), unless another process has done so already; the new name or None."""
    from pathlib import Path
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock
    from optuna.storages.journal._file import get_lock_file
    p = Path(path)
    with get_lock_file(JournalFileSymlinkLock(str(p))):      # the lock optuna's appends take
        try:
            JournalStorage(JournalFileBackend(str(p)))
            return None                                 # another worker set it aside first
        except OSError:
            raise
        except Exception:  # noqa: BLE001 - still damaged
            pass
        aside, n = p.with_name(p.name + ".damaged"), 0
        while aside.exists():
            n += 1
            aside = p.with_name(f"{p.name}.damaged.{n}")
        os.rename(p, aside)
    return aside


def _cut_torn_tail(path) -> None:
    """Cut a journal's last line if it lacks its newline (an append cut short by an OS crash or
    a full disk): optuna's reader skips it, but an append after it would glue the next record
    to it, and every later read would fail there. Called under the journal's lock."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        if not end:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        pos, cut = end, 0
        while pos > 0:
            step = min(1 << 16, pos)
            pos -= step
            f.seek(pos)
            i = f.read(step).rfind(b"\n")
            if i >= 0:
                cut = pos + i + 1
                break
        f.truncate(cut)


def _unsynced(backend_cls):
    """JournalFileBackend whose append_logs is optuna's, less the fsync (same lock, same format)."""
    import json
    try:
        from optuna.storages.journal._file import get_lock_file
    except ImportError:
        return backend_cls

    class UnsyncedJournalFileBackend(backend_cls):
        def append_logs(self, logs):
            if not hasattr(self, "_lock") or not hasattr(self, "_file_path"):
                return super().append_logs(logs)
            with get_lock_file(self._lock):
                _cut_torn_tail(self._file_path)
                text = "\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n"
                with open(self._file_path, "ab") as f:
                    f.write(text.encode("utf-8"))
                    f.flush()

    return UnsyncedJournalFileBackend


def tpe_sampler(seed: int, n: int):
    import optuna
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, group=True, constant_liar=True,
            n_startup_trials=max(4, min(10, n // 8)))


EvaluateBatch = Callable[[list[Candidate]], list[Evaluation]]


def search(space: SearchSpace, evaluate: EvaluateBatch, policy: SearchPolicy,
           study_name: str = "bucket", storage=None, shared=None) -> SearchOutcome:
    """Search one bucket; `evaluate(candidates)` returns one Evaluation per candidate, in order.

    The optuna study `study_name` in `storage` (None: in memory) is replaced by this search's.
    With `shared` (a distributed.SharedBucket, its study open with the TPE sampler), the search
    joins that study instead: what other workers finished counts as evaluated, and a candidate
    another worker holds is not measured here (`shared.take`).
    """
    import optuna

    mode = policy.resolve_mode(len(space))
    out = SearchOutcome(mode, len(space), policy.budget(len(space), mode))
    if not space.candidates:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if shared is not None:
            study = shared.study
        else:
            sampler = (tpe_sampler(policy.seed, len(space)) if mode == "tpe"
                       else optuna.samplers.RandomSampler(seed=policy.seed))
            study = open_study(study_name, storage, sampler)
            study.set_user_attr("mode", mode)
            study.set_user_attr("space_size", len(space))
        run = _Run(space, evaluate, policy, study, out, shared)
        run.grid() if mode == "grid" else run.tpe()
    return out


class _Run:
    """One bucket's search in progress: the study, what has been evaluated, the outcome."""

    def __init__(self, space: SearchSpace, evaluate: EvaluateBatch, policy: SearchPolicy, study,
                 out: SearchOutcome, shared=None):
        self.space, self.evaluate, self.policy, self.study, self.out = space, evaluate, policy, study, out
        self.shared = shared
        self.seen: dict[str, Evaluation] = dict(shared.known()) if shared is not None else {}
        self.rng = random.Random(policy.seed)

    def time_left(self) -> bool:
        return self.policy.deadline is None or time.monotonic() < self.policy.deadline

    def ask(self, fixed: Candidate | None = None):
        """An optuna trial and the candidate it stands for (`fixed`: that one, enqueued)."""
        if fixed is not None:
            self.study.enqueue_trial(self.space.params_of(fixed), skip_if_exists=False)
        t = self.study.ask()
        self.out.proposals += 1
        return t, self.space.suggest(t) or fixed

    def tell(self, trial, ev: Evaluation) -> None:
        from optuna.trial import TrialState
        trial.set_user_attr("candidate", ev.candidate.key)
        trial.set_user_attr("cached", ev.cached)
        if ev.trial_id is not None:     # the stored trial it stands for (SharedBucket.recheck)
            trial.set_user_attr("results_trial_id", ev.trial_id)
        if ev.ok:
            self.study.tell(trial, ev.value)
        else:
            trial.set_user_attr("invalid_reason", ev.reason)
            self.study.tell(trial, state=TrialState.PRUNED)   # TPE ranks it below every valid point

    def run(self, pairs: list) -> list[Evaluation]:
        """Evaluate the new candidates among (trial, candidate) pairs; tell every trial."""
        if self.shared is not None:
            return self._run_shared(pairs)
        fresh = list({c.key: c for _, c in pairs if c.key not in self.seen}.values())
        evs = self._keep(self.evaluate(fresh) if fresh else [], len(fresh))
        for trial, c in pairs:
            self.tell(trial, self.seen[c.key])
        return evs

    def _keep(self, evs: list[Evaluation], asked: int) -> list[Evaluation]:
        """Remember evaluate()'s answers, one per candidate asked, for later trials and the outcome."""
        if len(evs) != asked:
            raise RuntimeError("evaluate() must return one Evaluation per candidate")
        for ev in evs:
            self.seen[ev.candidate.key] = ev
            self.out.evaluations.append(ev)
        return evs

    def _run_shared(self, pairs: list) -> list[Evaluation]:
        """run() in a study other workers share: their results first, then what is new and not
        held by another worker; a trial whose candidate another worker measures right now is
        pruned as a duplicate."""
        from optuna.trial import TrialState
        for key, ev in self.shared.known().items():
            self.seen.setdefault(key, ev)
        mine: dict[str, tuple] = {}
        for trial, c in pairs:
            if c.key not in self.seen and c.key not in mine and self.shared.take(trial, c):
                mine[c.key] = (trial, c)
        cands = [c for _, c in mine.values()]
        evs = self._keep(self.evaluate(cands, [self.shared.claim_key(c) for c in cands]) if cands else [],
                         len(cands))
        for trial, c in pairs:
            try:
                if c.key in self.seen:
                    self.tell(trial, self.seen[c.key])
                else:
                    trial.set_user_attr("duplicate", True)
                    self.study.tell(trial, state=TrialState.PRUNED)
            except (ValueError, RuntimeError):
                pass    # failed as stale meanwhile (a slow worker): its retry is answered by the claim
            finally:
                self.shared.release(trial)
        if pairs and not cands:
            time.sleep(0.2)     # everything proposed is being measured elsewhere: let it finish
        return evs

    def grid(self) -> None:
        """Every candidate in grid_order, a batch per page size; a cut grid keeps the defaults
        (the baseline) before anything else."""
        space, out = self.space, self.out
        order = space.grid_order(by_page=out.budget >= len(space),
                                 first_page=self.policy.first_page)[:out.budget]
        i = 0
        while i < len(order):
            if not self.time_left():
                out.stopped = "time budget"
                return
            page, batch = order[i].page_size, []
            while i < len(order) and len(batch) < self.policy.batch and order[i].page_size == page:
                batch.append(order[i])
                i += 1
            self.run([self.ask(c) for c in batch])
        out.stopped = "complete" if out.budget >= len(space) else "trial budget"

    def tpe(self) -> None:
        """The defaults, then TPE proposals in batches of policy.tpe_batch, then page twins."""
        from optuna.trial import TrialState
        space, out, policy, seen = self.space, self.out, self.policy, self.seen
        if self.shared is None:     # a shared study was seeded with them by its creator
            for d in space.defaults[:out.budget]:
                self.study.enqueue_trial(space.params_of(d), skip_if_exists=False)
        best, since_best, pruned = math.inf, 0, 0
        while True:
            unseen = len(space) - len(seen)
            if not unseen:
                out.stopped = "complete"
                break
            if len(seen) >= out.budget:
                out.stopped = "trial budget"
                break
            if not self.time_left():
                out.stopped = "time budget"
                break
            if policy.patience and since_best >= policy.patience:
                out.stopped = "patience"
                break
            want = min(max(policy.tpe_batch, len(space.defaults) - len(seen)),
                       out.budget - len(seen), unseen)
            pairs, new = [], set()
            while len(new) < want:
                t, c = self.ask()
                if c is None:                     # a combination no family declared
                    t.set_user_attr("constraint", "combination not declared by the family")
                    self.study.tell(t, state=TrialState.PRUNED)
                    pruned += 1
                    if pruned >= JUMP_AFTER_PRUNED:
                        pruned = 0
                        self._enqueue_any(new)
                    continue
                pruned = 0
                if c.key in seen or c.key in new:
                    # TPE exploits a region it likes: try an unseen neighbour of the point, or
                    # anywhere unseen once the neighbourhood is exhausted
                    if c.key in seen:
                        self.tell(t, seen[c.key])
                    else:
                        pairs.append((t, c))      # told when its batch has been measured
                    near = [n for n in space.neighbours(c) if n.key not in seen and n.key not in new]
                    if near:
                        self.study.enqueue_trial(space.params_of(self.rng.choice(near)),
                                                 skip_if_exists=False)
                    else:
                        self._enqueue_any(new)
                    continue
                pairs.append((t, c))
                new.add(c.key)
            for ev in self.run(pairs):
                if ev.ok and ev.value < best * (1 - IMPROVEMENT):
                    best, since_best = ev.value, 0
                else:
                    since_best += 1
        # the page size is chosen once for all buckets, so each family's best point must also be
        # known at every page size, or the global choice would compare pages nobody measured
        twins = [c for c in _page_twins(space, out.evaluations) if c.key not in seen]
        if twins and self.time_left():
            self.run([self.ask(c) for c in twins])

    def _enqueue_any(self, taken: set) -> None:
        unseen = [c for c in self.space.candidates if c.key not in self.seen and c.key not in taken]
        if unseen:
            self.study.enqueue_trial(self.space.params_of(self.rng.choice(unseen)), skip_if_exists=False)


def _page_twins(space: SearchSpace, evaluations: list[Evaluation]) -> list[Candidate]:
    """Each family's best evaluated candidate at every other page size the space offers."""
    best: dict[str, Evaluation] = {}
    for e in evaluations:
        f = e.candidate.family
        if e.ok and (f not in best or e.value < best[f].value):
            best[f] = e
    out = []
    for e in best.values():
        c = e.candidate
        for other in space.candidates:
            if other.family == c.family and other.backend == c.backend and other.params == c.params \
                    and other.page_size != c.page_size:
                out.append(other)
    return out
