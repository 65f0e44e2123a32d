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
import random
import time
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from mla_tune.families.base import Candidate
from mla_tune.problem.defaults import DEFAULT_PAGE_SIZE
from mla_tune.tune.search_space import SearchSpace

# optuna is imported in the functions that search: the CLI imports this module, and
# `mla-tune --help` must not wait for it


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
