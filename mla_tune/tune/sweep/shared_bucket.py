"""One bucket's study in a shared optuna storage, as the work queue of several sweep workers:
every candidate measured once.

A bucket's study is the work queue, in optuna's own terms: its creator (study names are unique in
the storage, so exactly one process creates it) enqueues every candidate to measure (a grid's
whole space; for TPE the family defaults, the rest TPE proposes) as a WAITING trial with the
candidate key as a user attribute, then marks the study seeded. A worker claims a
trial by moving it from WAITING to RUNNING through the storage (`set_trial_state_values`, which
optuna's own `Study.ask` uses to pop enqueued trials: of two workers, one wins), so each trial is
measured by one worker. A claimed trial carries a heartbeat (RDBStorage) and the worker's host and
pid; a trial whose worker died is failed and enqueued again by optuna's
RetryHeartbeatStaleTrialCallback (the heartbeat for RDB storages; a dead pid on this host for a
journal file, which has no heartbeat), and another worker measures it. Each stored trial carries
its claim (`<study uid>|<candidate>`): a claim is stored once in a results DB, however many
workers answered it (a worker thought dead that was only slow), and `mla-tune merge` keeps it once.
A TPE bucket is optuna's distributed TPE: every worker asks the one study (constant liar on), and a
proposal whose candidate another live trial already holds is pruned as a duplicate (`take`).
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Sequence

from mla_tune.families.base import Candidate
from mla_tune.faults import process_alive
from mla_tune.tune.search import Evaluation
from mla_tune.tune.study_storage import quiet_optuna, retry_callback

SEED_WAIT_S = 60.0        # how long a worker waits for another process to finish seeding a study
# a study whose creator has not named itself this long after it was found: the creator died
# between creating it and naming itself (a kill at the journal's first write), not a slow one
# (naming follows creation at once)
UNNAMED_SEEDER_S = 10.0
HOST = socket.gethostname()


class Heartbeat:
    """One thread per worker that records a heartbeat for every trial the worker holds."""

    def __init__(self, storage, interval_s: float):
        self.storage, self.interval_s = storage, interval_s
        self.held: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def hold(self, trial_id: int) -> None:
        self.storage.record_heartbeat(trial_id)
        with self._lock:
            self.held.add(trial_id)
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="mla-tune-heartbeat", daemon=True)
            self._thread.start()

    def release(self, trial_id: int) -> None:
        with self._lock:
            self.held.discard(trial_id)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                ids = list(self.held)
            for tid in ids:
                try:
                    self.storage.record_heartbeat(tid)
                except Exception:  # noqa: BLE001 - a missed beat is retried; a dead storage shows elsewhere
                    pass

    def close(self) -> None:
        self._stop.set()


# ---------------------------------------------------------------- one bucket's shared study

@dataclass
class Claim:
    """A trial this worker holds: its storage id, number and candidate."""

    trial_id: int
    number: int
    candidate: object

    def key(self, study_uid: str) -> str:
        return f"{study_uid}|{self.candidate.key}"


@dataclass
class SharedBucket:
    """A bucket's study in a shared storage: seeded once with its candidates, claimed trial by
    trial. `grace_s`: a RUNNING trial with no worker recorded is stale after this long."""

    storage: object
    name: str
    space: object                       # search_space.SearchSpace
    heartbeat: Heartbeat | None = None
    grace_s: float = 30.0
    worker: str = field(default_factory=lambda: f"{HOST}:{os.getpid()}")
    study: object = None
    uid: str = ""
    created: bool = False               # this process created (and seeded) the study
    lost: set = field(default_factory=set)   # finished trials whose results-DB trial is gone
    mine: set = field(default_factory=set)   # trials this instance claimed or took

    def open(self, seed: Sequence, attrs: dict, wait_s: float = SEED_WAIT_S, sampler=None) -> bool:
        """Create the study and enqueue `seed` (True), or load the one another process created
        and wait until it is seeded (False); a creator that died while seeding is taken over.
        `sampler`: TPE's for a TPE bucket (a grid's trials are all enqueued)."""
        optuna = quiet_optuna()
        sampler = sampler or optuna.samplers.RandomSampler(seed=0)
        try:
            self.study = optuna.create_study(study_name=self.name, storage=self.storage,
                                             sampler=sampler, direction="minimize")
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            self.study = optuna.load_study(study_name=self.name, storage=self.storage, sampler=sampler)
            created = False
        # the study's own storage from here on: optuna wraps an RDBStorage in a cache that must
        # see every trial this process touches
        self.storage = self.study._storage
        if created:
            self.study.set_user_attr("uid", uuid.uuid4().hex)
            self.study.set_user_attr("seeding", self.worker)
            self._seed(seed, attrs)
        start = time.monotonic()
        end = start + wait_s
        while "seeded" not in self.study.user_attrs:
            seeder = self.study.user_attrs.get("seeding", "")
            host, _, pid = seeder.rpartition(":")
            if (seeder == self.worker or (host == HOST and pid.isascii() and pid.isdigit() and len(pid) < 10
                                          and not process_alive(int(pid)))
                    or (not seeder and time.monotonic() > start + min(wait_s, UNNAMED_SEEDER_S))
                    or time.monotonic() > end):
                # its creator died while enqueueing (a kill in the first moments of a sweep):
                # enqueue what is missing and go on
                self.study.set_user_attr("uid", self.study.user_attrs.get("uid") or uuid.uuid4().hex)
                self._seed(seed, attrs)
                break
            time.sleep(0.2)
        self.uid = self.study.user_attrs["uid"]
        return created

    def _seed(self, seed: Sequence, attrs: dict) -> None:
        have = {t.user_attrs.get("candidate") for t in self._trials()}
        for c in seed:
            if c.key not in have:
                self.study.enqueue_trial(self.space.params_of(c), user_attrs={"candidate": c.key},
                                         skip_if_exists=False)
        for k, v in attrs.items():
            self.study.set_user_attr(k, v)
        self.study.set_user_attr("seeded", len(seed))      # last: the others wait for it

    def recheck(self, stored) -> int:
        """The results DB is the record, the study a cache of it: a finished trial whose stored
        trial is gone from the DB (deleted, or the DB restored from an older copy) answers
        nothing. It is left out of `finished` and its candidate enqueued again, to be measured.
        `stored(ids)` -> {results-DB trial id: candidate key} of those still stored. Returns
        how many finished trials were lost."""
        from optuna.trial import TrialState
        done = [t for t in self._trials((TrialState.COMPLETE, TrialState.PRUNED))
                if t.user_attrs.get("candidate") and not t.user_attrs.get("duplicate")]
        ids = {t.user_attrs.get("results_trial_id") for t in done}
        have = stored(sorted(i for i in ids if type(i) is int))
        lost = [t for t in done if type(t.user_attrs.get("results_trial_id")) is int
                and have.get(t.user_attrs["results_trial_id"]) != t.user_attrs["candidate"]]
        self.lost = {t._trial_id for t in lost}
        kept = {t.user_attrs["candidate"] for t in done if t._trial_id not in self.lost}
        pending = {t.user_attrs.get("candidate")
                   for t in self._trials((TrialState.WAITING, TrialState.RUNNING))}
        for key in sorted({t.user_attrs["candidate"] for t in lost} - kept - pending):
            try:
                c = self.candidate(key)
            except ValueError:
                continue            # a key this version cannot parse: nothing to measure
            self.study.enqueue_trial(self.space.params_of(c), user_attrs={"candidate": key},
                                     skip_if_exists=False)
        return len(lost)

    def _trials(self, states=None):
        return self.storage.get_all_trials(self.study._study_id, deepcopy=False, states=states)

    def candidate(self, key: str):
        """The candidate a trial's key stands for (the declared one, else parsed)."""
        for c in self.space.candidates:
            if c.key == key:
                return c
        return Candidate.parse(key)

    def fail_stale(self) -> int:
        """Fail the RUNNING trials whose worker is gone and enqueue them again (optuna's heartbeat
        check for RDB storages; a dead pid on this host, or no worker recorded after grace_s, for
        any storage). The number failed here."""
        from optuna.storages import fail_stale_trials
        from optuna.trial import TrialState
        optuna = quiet_optuna()
        fail_stale_trials(self.study)
        failed = 0
        now = dt.datetime.now()
        for t in self._trials((TrialState.RUNNING,)):
            w = t.user_attrs.get("worker")
            if w:
                host, _, pid = w.rpartition(":")
                # this process's own worker name on a trial this instance never held: left by an
                # earlier sweep in this same process (a library caller's, a test's) that failed
                dead = (w == self.worker and t._trial_id not in self.mine) or (
                    host == HOST and pid.isascii() and pid.isdigit() and len(pid) < 10
                    and not process_alive(int(pid)))
            else:
                dead = t.datetime_start is not None and \
                    (now - t.datetime_start).total_seconds() > self.grace_s
            if not dead:
                continue
            try:
                if not self.storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue                      # another worker failed it first (and retried it)
            failed += 1
            retry_callback()(self.study, self.storage.get_trial(t._trial_id))
        return failed

    def claim(self, n: int) -> list[Claim]:
        """Up to `n` WAITING trials of one page size, in seeding order, now RUNNING and ours."""
        from optuna.trial import TrialState
        optuna = quiet_optuna()
        got: list[Claim] = []
        page = None
        for t in self._trials((TrialState.WAITING,)):
            if "candidate" not in t.user_attrs:
                continue    # a TPE search's own enqueued proposal: its `ask` takes it
            c = self.candidate(t.user_attrs["candidate"])
            if page is not None and c.page_size != page:
                break       # one claimed batch is one interleaved comparison on one KV layout
            try:
                if not self.storage.set_trial_state_values(t._trial_id, state=TrialState.RUNNING):
                    continue
            except optuna.exceptions.UpdateFinishedTrialError:
                continue
            if self.heartbeat is not None:
                self.heartbeat.hold(t._trial_id)
            self.mine.add(t._trial_id)
            self.storage.set_trial_user_attr(t._trial_id, "worker", self.worker)
            got.append(Claim(t._trial_id, t.number, c))
            page = c.page_size
            if len(got) >= n:
                break
        return got

    def finish(self, claim: Claim, ev) -> None:
        """Tell the study what the claim's candidate gave (a value, or pruned with its reason)."""
        import optuna
        from optuna.trial import TrialState
        try:
            trial = optuna.Trial(self.study, claim.trial_id)
            self.space.suggest(trial)             # records the enqueued parameters
            trial.set_user_attr("cached", ev.cached)
            if ev.trial_id is not None:
                trial.set_user_attr("results_trial_id", ev.trial_id)
            if ev.ok:
                self.study.tell(trial, ev.value)
            else:
                trial.set_user_attr("invalid_reason", ev.reason)
                self.study.tell(trial, state=TrialState.PRUNED)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
            pass   # failed as stale meanwhile: its retry is answered from the stored claim
        finally:
            if self.heartbeat is not None:
                self.heartbeat.release(claim.trial_id)

    def counts(self) -> dict:
        """Trials waiting for a worker (a candidate to measure) and trials being measured."""
        from optuna.trial import TrialState
        out = {"waiting": 0, "running": 0}
        for t in self._trials((TrialState.WAITING, TrialState.RUNNING)):
            if t.state == TrialState.RUNNING:
                out["running"] += 1
            elif "candidate" in t.user_attrs:
                out["waiting"] += 1
        return out

    # ------------------------------------------------------------ a TPE search's side
    def take(self, trial, candidate) -> bool:
        """Whether this worker measures `candidate` for `trial` (a TPE proposal it asked for):
        not when another live trial of the study holds the same candidate. The candidate is
        written to the trial before the others are read, so of two workers proposing one
        candidate at once at least one sees the other: it is never measured twice."""
        from optuna.trial import TrialState
        self.mine.add(trial._trial_id)
        self.storage.set_trial_user_attr(trial._trial_id, "candidate", candidate.key)
        self.storage.set_trial_user_attr(trial._trial_id, "worker", self.worker)
        if self.heartbeat is not None:
            self.heartbeat.hold(trial._trial_id)
        for t in self._trials((TrialState.WAITING, TrialState.RUNNING, TrialState.COMPLETE,
                               TrialState.PRUNED)):
            if t._trial_id != trial._trial_id and t.user_attrs.get("candidate") == candidate.key \
                    and not t.user_attrs.get("duplicate"):
                return False
        return True

    def release(self, trial) -> None:
        if self.heartbeat is not None:
            self.heartbeat.release(trial._trial_id)

    def known(self) -> dict:
        """candidate key -> Evaluation of what the study's workers finished (cached for us)."""
        return {k: Evaluation(self.candidate(k), v, True, reason, tid)
                for k, (v, reason, tid) in self.finished().items()}

    def claim_key(self, candidate) -> str:
        return f"{self.uid}|{candidate.key}"

    def finished(self) -> dict:
        """candidate key -> (value or None, invalid reason, results-DB trial id) of every
        candidate some worker finished."""
        from optuna.trial import TrialState
        out = {}
        for t in self._trials((TrialState.COMPLETE, TrialState.PRUNED)):
            key = t.user_attrs.get("candidate")
            if t._trial_id in self.lost:
                continue            # its stored trial is gone: not an answer (recheck)
            if key and key not in out and not t.user_attrs.get("duplicate"):
                out[key] = (t.value if t.state == TrialState.COMPLETE else None,
                            t.user_attrs.get("invalid_reason"), t.user_attrs.get("results_trial_id"))
        return out

