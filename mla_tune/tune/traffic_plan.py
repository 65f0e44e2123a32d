"""A sweep planned from a server's recorded traffic (`mla-tune sweep --traffic`, `prefill-sweep
--traffic`): its buckets are the log2 cells (the lookup's grid, the default sweep's) that hold a
stated share of the recorded steps, and its weights are the recorded step counts.

    plan = decode_plan("traffic.db", share=0.99, model="deepseek-v3")
    plan.cells      [(batch, context, q_len)]   most steps first; on the default sweep's log2 grid,
                                                so buckets a sweep measured before are answered
                                                from the DB, as a resumed sweep does
    plan.tp_size    the TP size at which the model has the recorded heads per rank
    plan.mix        the weights (`WorkloadMix`, snapping like the lookup) choose and emit use
    plan.note       one line for people
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mla_tune.problem.prefill import prefill_workload
from mla_tune.problem.workload import ProblemError, WorkloadMix, model_preset
from mla_tune.store.traffic import DEFAULT_SHARE, ModelTraffic, TrafficError, load_traffic


@dataclass(frozen=True)
class TrafficPlan:
    """What a traffic file asks a sweep to measure and how to weigh it."""

    traffic: ModelTraffic
    tp_size: int
    share: float
    cells: list                    # decode: (batch, context, q_len); prefill: (causal, q, kv)
    covered: int                   # steps (plans) the cells hold
    total: int                     # steps (plans) recorded for the model key
    what: str = "decode steps"     # or "prefill plans"

    @property
    def mix(self) -> WorkloadMix:
        return self.traffic.mix()

    @property
    def note(self) -> str:
        pct = 100.0 * self.covered / self.total if self.total else 0.0
        return (f"traffic {self.traffic.path} ({self.traffic.label}, TP{self.tp_size}): "
                f"{len(self.cells)} log2 buckets hold {pct:.1f}% of its {self.total} {self.what} "
                f"(asked: {100 * self.share:g}%)")


def model_traffic(path: str | Path, model: str, tp_sizes: Sequence[int] | None) -> tuple[ModelTraffic, int]:
    """The recorded traffic of `model` (a preset) and the TP size it was served at: the one
    whose heads per rank were recorded (`tp_sizes`, when given, must hold it)."""
    dims = model_preset(model)
    traffic = load_traffic(path)
    candidates = [m for m in traffic.models if m.dims.kv_lora_rank == dims.kv_lora_rank
                  and dims.num_heads % m.dims.num_heads == 0]
    if tp_sizes:
        heads = {dims.num_heads // t for t in tp_sizes if dims.num_heads % t == 0}
        candidates = [m for m in candidates if m.dims.num_heads in heads]
    if len(candidates) != 1:
        have = "; ".join(m.label for m in traffic.models)
        tps = f" at --tp {', '.join(map(str, tp_sizes))}" if tp_sizes else ""
        if not candidates:
            raise TrafficError(f"{path}: no recorded traffic fits {model}{tps} "
                               f"({dims.num_heads} heads, kv_lora_rank {dims.kv_lora_rank}); "
                               f"recorded: {have}")
        raise TrafficError(f"{path}: traffic of several models fits {model} ({have}): name the "
                           "TP size with --tp")
    m = candidates[0]
    return m, dims.num_heads // m.dims.num_heads


def decode_plan(path: str | Path, share: float = DEFAULT_SHARE, model: str = "deepseek-v3",
                tp_sizes: Sequence[int] | None = None) -> TrafficPlan:
    """The decode buckets and weights of a recorded traffic (TrafficError / ProblemError for a
    file or model that does not fit)."""
    m, tp = model_traffic(path, model, tp_sizes)
    cells = m.decode_cells()
    if not cells:
        raise TrafficError(f"{path}: no decode step recorded for {m.label} (only prefill plans)")
    cover = m.covering(share)
    # a bucket's context holds its q_len (plan_buckets' rule); the lookup snaps either way
    chosen = [(b, max(c, _pow2_at_least(q)), q) for b, c, q in cover]
    return TrafficPlan(m, tp, share, list(dict.fromkeys(chosen)), sum(cells[k] for k in cover),
                       m.steps)


def prefill_plan(path: str | Path, share: float = DEFAULT_SHARE, model: str = "deepseek-v3",
                 tp_sizes: Sequence[int] | None = None) -> TrafficPlan:
    """The prefill buckets of a recorded traffic: (causal, query tokens, KV tokens per request)."""
    m, tp = model_traffic(path, model, tp_sizes)
    cells = m.prefill_cells()
    if not cells:
        raise TrafficError(f"{path}: no prefill plan recorded for {m.label} (only decode steps)")
    chosen = m.prefill_covering(share)
    return TrafficPlan(m, tp, share, chosen, sum(cells[k] for k in chosen), m.plans,
                       "prefill plans")


def prefill_workloads(plan: TrafficPlan, model: str, q_dtype: str = "bfloat16") -> list:
    """The prefill sweep's workloads of a prefill TrafficPlan (`prefill_workload` per cell)."""
    dims = model_preset(model)
    out = []
    for causal, q, kv in plan.cells:
        try:
            out.append(prefill_workload(dims, plan.tp_size, causal, q, kv, q_dtype=q_dtype))
        except ProblemError as e:
            raise TrafficError(f"{plan.traffic.path}: prefill bucket q{q} kv{kv}: {e}") from None
    return list(dict.fromkeys(out))


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


__all__ = ["TrafficPlan", "decode_plan", "model_traffic", "prefill_plan", "prefill_workloads"]
