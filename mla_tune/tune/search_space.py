"""A bucket's search space: the candidates its kernel families declare, after constraints, with
the family defaults, structured for optuna: a "kernel" (family/backend) choice, then per kernel
its page size and knobs, ordered values as integer indices so TPE can learn that neighbours
behave alike (`SearchSpace.suggest`). A combination the families never declared is no point."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from mla_tune.families.base import Candidate

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

