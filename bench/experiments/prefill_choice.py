"""Is the MLA prefill backend (fa2 / fa3) or vLLM's chunked-prefill workspace size a real choice on
this GPU? Measured through the plugin's own vllm-free prefill op (`MLAPrefillKernel`, the code the
served model runs), DeepSeek-V3 shapes (q/k head dim 192 = 128 nope + 64 rope, v 128, bf16,
softmax scale 1/sqrt(192)) at 128 heads (TP1) and 16 heads (TP8).

    source .carry/device-env.sh && VLLM_METAX_FORCE=1 python3 bench/experiments/prefill_choice.py --out DIR
    python3 bench/experiments/prefill_choice.py --analyze DIR/prefill_choice.json   # re-decide from the samples

1. backend: every value the device accepts (of --backends, default fa2,fa3) on (a) new-token
   causal prefill, ragged batches of 256..8K tokens (one request; four requests of different
   lengths), and (b) one context chunk (non-causal, LSE returned) of q new tokens against 1K..64K
   context tokens. Timed as CUDA-graph replays with events inside the graph and a cold L2
   (mla_tune.measure.timing.KernelTimer), backends interleaved round by round.
2. workspace: continuing a prompt over L cached tokens (8K, 32K, 128K) with q new tokens, the
   context cut into chunks exactly as vLLM 0.33.0 cuts it for a workspace of W rows
   (`context_chunk_lens`), for W around vLLM's default (`vllm_default_workspace_rows`: 64K for
   DeepSeek-V3): per chunk one non-causal attention (+ LSE to natural log, as the plugin's prefill
   backend does) and the LSE merge vLLM's MLA layer runs (`merge_attn_states`, which on an
   out-of-tree platform is vLLM's Triton kernel), then the final merge against the new tokens.
   Timed both as graph replays (GPU work) and as eager launches (how vLLM runs prefill), all
   (backend, W) configurations interleaved. Plus the memory each W costs.

Correctness gates every timed value: on fresh random inputs each output is poisoned, then checked
against a float32 reference on sampled rows (and fa2 against fa3, every W against one chunk); a
value that fails is reported and never wins. "Beyond noise" (`beats`) means the median ratio is at
least 1.05 AND the samples separate: a one-sided Mann-Whitney p < 0.002 where scipy is installed
(mla_tune.tune.verdict.compare, the tuner's rule), otherwise the slower value's first quartile above the
faster one's third quartile. Verdicts (`choice_verdict`): "real choice" only when no single value is
within noise of the best at every shape. Writes DIR/prefill_choice.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.shape_run import add_shape_run_options, ints, read_earlier_run  # noqa: E402
from mla_tune.measure.sampling import sample_in_rounds  # noqa: E402
from mla_tune.tune.verdict import MIN_RATIO, P_THRESHOLD  # noqa: E402
from mla_tune.problem.workload import model_preset  # noqa: E402

NAME = "prefill_choice"
V3 = model_preset("deepseek-v3")
QK_DIM = V3.qk_nope_head_dim + V3.qk_rope_head_dim          # 192
V_DIM = V3.v_head_dim                                        # 128
SOFTMAX_SCALE = QK_DIM ** -0.5                               # 1/sqrt(192), without YaRN's mscale^2
TP_SIZES = (1, 8)                                            # 128 and 16 heads per rank
NEW_TOKEN_TOTALS = (256, 1024, 2048, 8192)
RAGGED_WEIGHTS = (1, 3, 4, 8)       # four requests of 1/16, 3/16, 4/16 and 8/16 of the batch's tokens
CHUNK_Q_LENS = (256, 2048)
CHUNK_KV_LENS = (1024, 4096, 16384, 65536)
CONTINUE_CONTEXTS = (131072, 32768, 8192)   # largest first: it is the one a time budget must not lose
CONTINUE_Q_LENS = (2048, 256)
WORKSPACE_ROWS = (16384, 32768, 65536, 131072)
BLOCK_SIZE = 64                     # vLLM's KV block for MLA: context chunks split on block boundaries
VLLM_WORKSPACE_CAP = 64 * 1024      # vLLM 0.33.0's cap in determine_chunked_prefill_workspace_size
V3_MAX_MODEL_LEN = 163840           # DeepSeek-V3's max_position_embeddings (vLLM's default max_model_len)
V3_MAX_NUM_SEQS = 256
REL_TOL = 2e-2                      # bf16 operands: |out - ref| / |ref| lands near 1e-3..1e-2
LSE_TOL = 2e-2                      # natural-log LSE, absolute
LN2 = math.log(2.0)
NEW_TOKENS, CONTEXT_CHUNK = "new_tokens", "context_chunk"
LOG: list[str] = []


def say(msg: str = "") -> None:
    print(msg, flush=True)
    LOG.append(msg)


# ================================================================ pure: shapes, vLLM's rules, memory

@dataclass(frozen=True)
class PrefillShape:
    """One prefill attention call: per-request query and key lengths. New tokens are causal with
    kv_lens == q_lens; a context chunk is non-causal (each request's queries see all its keys)."""

    kind: str
    heads: int
    q_lens: tuple
    kv_lens: tuple

    @property
    def causal(self) -> bool:
        return self.kind == NEW_TOKENS

    @property
    def label(self) -> str:
        q = "+".join(map(str, self.q_lens))
        if self.causal:
            return f"new H{self.heads} T{sum(self.q_lens)} ({len(self.q_lens)} req: {q})"
        return f"ctx H{self.heads} q{q} kv{'+'.join(map(str, self.kv_lens))}"

    def flops(self, qk_dim: int = QK_DIM, v_dim: int = V_DIM) -> int:
        """Multiply-adds x 2 of QK^T and PV over the pairs the mask keeps."""
        if self.causal:
            pairs = sum(q * (q + 1) // 2 for q in self.q_lens)
        else:
            pairs = sum(q * k for q, k in zip(self.q_lens, self.kv_lens))
        return 2 * pairs * self.heads * (qk_dim + v_dim)


def heads_per_rank(tp_sizes=TP_SIZES) -> tuple:
    return tuple(V3.heads_per_rank(tp) for tp in tp_sizes)


def ragged_lengths(total: int, weights=RAGGED_WEIGHTS) -> tuple:
    """`total` tokens split into len(weights) requests in proportion to `weights` (the last takes
    the rounding); every length positive."""
    s = sum(weights)
    lens = [max(1, total * w // s) for w in weights[:-1]]
    lens.append(total - sum(lens))
    if min(lens) < 1:
        raise ValueError(f"cannot split {total} tokens into {len(weights)} requests")
    return tuple(lens)


def new_token_shapes(heads=None, totals=NEW_TOKEN_TOTALS, weights=RAGGED_WEIGHTS) -> list:
    """Causal new-token prefill: per heads and total, one request and a ragged batch."""
    out = []
    for h in heads or heads_per_rank():
        for t in totals:
            out.append(PrefillShape(NEW_TOKENS, h, (t,), (t,)))
            lens = ragged_lengths(t, weights)
            out.append(PrefillShape(NEW_TOKENS, h, lens, lens))
    return out


def context_chunk_shapes(heads=None, q_lens=CHUNK_Q_LENS, kv_lens=CHUNK_KV_LENS) -> list:
    """Non-causal context-chunk attention: one request's q new tokens against a kv-token chunk."""
    return [PrefillShape(CONTEXT_CHUNK, h, (q,), (kv,))
            for h in heads or heads_per_rank() for q in q_lens for kv in kv_lens]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def vllm_default_workspace_rows(max_model_len: int, max_num_seqs: int, block_size: int,
                                dcp_size: int = 1, cp_interleave: int = 1) -> int:
    """vLLM 0.33.0's `MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size`: 8 full
    requests or 4 blocks per sequence, capped at 64K rows, rounded up to the block (lcm with the
    DCP interleave under decode context parallelism)."""
    rows = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), VLLM_WORKSPACE_CAP)
    align = block_size if dcp_size <= 1 else math.lcm(block_size, dcp_size * cp_interleave)
    return _round_up(max(rows, align), align)


def context_chunk_lens(context_len: int, workspace_rows: int, block_size: int = BLOCK_SIZE) -> list:
    """The context chunks vLLM 0.33.0 (`plan_mla_context_chunks`, no DCP) cuts one request's cached
    context into: whole while it fits the workspace, else split at the largest block-aligned length
    that fits and is shorter than what remains."""
    if context_len <= 0:
        return []
    max_chunk = workspace_rows // block_size * block_size
    if max_chunk <= 0:
        raise ValueError(f"workspace of {workspace_rows} rows is smaller than a {block_size}-row block")
    out, remaining = [], context_len
    while remaining > workspace_rows:
        split = min(max_chunk, (remaining - 1) // block_size * block_size)
        out.append(split)
        remaining -= split
    out.append(remaining)
    return out


def workspace_bytes(rows: int, kv_lora_rank: int = V3.kv_lora_rank, rope_dim: int = V3.qk_rope_head_dim,
                    dtype_bytes: int = 2, dcp_size: int = 1) -> int:
    """The gather workspace vLLM's MLA metadata builder allocates once (not per layer):
    [rows (+ rows/DCP under DCP), kv_lora_rank + rope] in the prefill q dtype."""
    total = rows + rows // dcp_size if dcp_size > 1 else rows
    return total * (kv_lora_rank + rope_dim) * dtype_bytes


def upprojected_kv_bytes(rows: int, heads: int, nope_dim: int = V3.qk_nope_head_dim,
                         v_dim: int = V_DIM, dtype_bytes: int = 2) -> int:
    """One chunk's kv_b_proj output [rows, heads, nope + v]: what vLLM's profile run reserves
    (`torch.empty((chunked_prefill_workspace_size, heads, nope + v))`) so the KV cache leaves room."""
    return rows * heads * (nope_dim + v_dim) * dtype_bytes


def chunk_k_bytes(rows: int, heads: int, qk_dim: int = QK_DIM, dtype_bytes: int = 2) -> int:
    """One chunk's concatenated k [rows, heads, nope + rope] (`_concat_k_nope_k_pe`), alive beside
    the up-projection during the chunk's attention; the profile run does not reserve it."""
    return rows * heads * qk_dim * dtype_bytes


# ================================================================ pure: beyond noise, verdicts

def quartiles(samples) -> tuple:
    v = sorted(samples)
    if len(v) < 2:
        return v[0], v[0], v[0]
    q = statistics.quantiles(v, n=4, method="inclusive")
    return q[0], statistics.median(v), q[2]


def scipy_compare():
    """mla_tune.tune.verdict.compare (one-sided Mann-Whitney + ratio) where scipy is installed, else None."""
    try:
        import scipy  # noqa: F401

        from mla_tune.tune.verdict import compare
        return compare
    except ImportError:
        return None


@dataclass(frozen=True)
class Comparison:
    beats: bool          # fast is faster than slow beyond noise
    ratio: float         # median(slow) / median(fast)
    p: float | None      # Mann-Whitney p (None under the quartile rule)
    rule: str            # "mann-whitney" | "quartiles"


def beats(fast, slow, min_ratio: float = MIN_RATIO, p_threshold: float = P_THRESHOLD,
          compare=None) -> Comparison:
    """Is `fast` faster than `slow` beyond noise: median ratio >= min_ratio and the samples
    separate (Mann-Whitney p < p_threshold through `compare`, else slow's Q1 > fast's Q3)."""
    ratio = statistics.median(slow) / statistics.median(fast)
    if compare is not None:
        sig, p, _ = compare(slow, fast, p_threshold, min_ratio)
        return Comparison(bool(sig), ratio, p, "mann-whitney")
    if len(fast) < 2 or len(slow) < 2:
        return Comparison(False, ratio, None, "quartiles")
    return Comparison(ratio >= min_ratio and quartiles(slow)[0] > quartiles(fast)[2], ratio, None,
                      "quartiles")


def _order(v):
    """Sort key: numbers (workspace rows) numerically, names (backends) alphabetically."""
    return (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))


def _gmean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _span(xs, fmt="{:.2f}") -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}..{fmt.format(hi)}"


def shape_best(samples: dict, compare=None, min_ratio: float = MIN_RATIO) -> dict:
    """For one shape ({value: samples}): the fastest value by median, the values it does not beat
    beyond noise (the best set, the fastest included), and median(value) / median(fastest)."""
    med = {v: statistics.median(s) for v, s in samples.items()}
    best = min(med, key=lambda v: (med[v], _order(v)))
    best_set = {best} | {v for v in samples if v != best
                         and not beats(samples[best], samples[v], min_ratio, compare=compare).beats}
    return {"best": best, "best_set": best_set, "ratio": {v: med[v] / med[best] for v in med}}


def choice_verdict(shapes: list, default=None, compare=None, min_ratio: float = MIN_RATIO,
                   name: str = "value") -> dict:
    """Is `name` a real choice over these shapes? `shapes`: [{"label", "samples": {value: [us]}}],
    only values valid at that shape. Real choice when no value measured at every shape is within
    noise of the best at all of them; otherwise the never-beaten value (the default if it is one,
    else the fastest by geomean) and by how much it beats each other value."""
    shapes = [s for s in shapes if len(s["samples"]) >= 1]
    everywhere = set.intersection(*(set(s["samples"]) for s in shapes)) if shapes else set()
    values = sorted({v for s in shapes for v in s["samples"]}, key=_order)
    out = {"name": name, "n_shapes": len(shapes), "values": values, "default": default,
           "rule": "mann-whitney" if compare else "quartiles", "min_ratio": min_ratio}
    if not shapes or len(everywhere) < 2:
        only = ", ".join(map(str, sorted(everywhere, key=_order))) or "nothing"
        out.update(kind="not a choice", text=f"not a choice: only {only} measured at every shape")
        return out
    per = []
    for s in shapes:
        b = shape_best({v: s["samples"][v] for v in everywhere}, compare, min_ratio)
        per.append({"label": s["label"], **b})
    never_beaten = set.intersection(*(p["best_set"] for p in per))
    wins = {v: [p["label"] for p in per if p["best_set"] == {v}] for v in everywhere}
    out["per_shape"] = [{"label": p["label"], "best": p["best"], "best_set": sorted(p["best_set"], key=_order),
                         "ratio": p["ratio"]} for p in per]
    out["never_beaten"] = sorted(never_beaten, key=_order)
    out["sole_winner_at"] = {str(v): w for v, w in wins.items() if w}
    if not never_beaten:
        parts = []
        for v in sorted(everywhere, key=_order):
            won = [p for p in per if p["best"] == v and v in p["best_set"] and len(p["best_set"]) < len(everywhere)]
            if won:
                gains = [min(r for u, r in p["ratio"].items() if u not in p["best_set"]) for p in won]
                parts.append(f"{name} {v} best at {len(won)}/{len(per)} shapes (beats the rest by >= {_span(gains)}x)")
        out.update(kind="real choice", text="real choice: no single value is within noise of the best "
                                             "everywhere; " + "; ".join(parts))
        return out

    def gm(v):
        return _gmean([p["ratio"][v] for p in per])

    winner = default if default in never_beaten else min(never_beaten, key=lambda v: (gm(v), _order(v)))
    out["winner"] = winner
    clauses, everywhere_by = [], []
    for v in sorted(everywhere - {winner}, key=_order):
        rel = [p["ratio"][v] / p["ratio"][winner] for p in per]      # time(v) / time(winner)
        beaten = [p for p in per if v not in p["best_set"] and winner in p["best_set"]]
        if v in never_beaten:
            clauses.append(f"{name} {v} is within noise too ({v}/{winner} time {_span(rel)})")
        elif len(beaten) == len(per):
            everywhere_by.append((v, rel))
        else:
            clauses.append(f"beats {name} {v} beyond noise at {len(beaten)}/{len(per)} shapes "
                           f"({v}/{winner} time {_span(rel)} over all shapes)")
    if everywhere_by and not clauses:
        by = "; ".join(f"{v}/{winner} time {_span(rel)}" for v, rel in everywhere_by)
        text = f"not a choice: {name} {winner} wins everywhere ({by})"
    else:
        head = f"not a choice: {name} {winner} is within noise of the best at every shape"
        tail = [f"beats {name} {v} everywhere ({v}/{winner} time {_span(rel)})" for v, rel in everywhere_by]
        text = head + ("; " + "; ".join(tail + clauses) if tail + clauses else "")
    out.update(kind="not a choice", text=text)
    return out


# ================================================================ reference and the chunked pass

def reference_rows(q_rows, segments, scale: float, head_block: int = 16):
    """float32 attention of q_rows [R, H, Dqk] over key segments [(k [n, H, Dqk], v [n, H, Dv],
    visible [R] keys of k each row sees)]: (out [R, H, Dv], lse [R, H] natural log)."""
    import torch
    R, H, _ = q_rows.shape
    dv = segments[0][1].shape[-1]
    out = torch.empty(R, H, dv, dtype=torch.float32, device=q_rows.device)
    lse = torch.empty(R, H, dtype=torch.float32, device=q_rows.device)
    for h0 in range(0, H, head_block):
        h1 = min(H, h0 + head_block)
        qq = q_rows[:, h0:h1].float()
        scores = []
        for k, _v, visible in segments:
            s = torch.einsum("rhd,nhd->hrn", qq, k[:, h0:h1].float()) * scale
            hidden = torch.arange(k.shape[0], device=k.device)[None, :] >= visible.to(k.device)[:, None]
            scores.append(s.masked_fill(hidden[None], -math.inf))
        s = torch.cat(scores, -1)
        lg = torch.logsumexp(s, -1)                       # [h, R]
        p = torch.exp(s - lg[..., None])
        o, off = 0, 0
        for (k, v, _visible), sc in zip(segments, scores):
            n = sc.shape[-1]
            o = o + torch.einsum("hrn,nhd->rhd", p[..., off:off + n], v[:, h0:h1].float())
            off += n
        out[:, h0:h1] = o
        lse[:, h0:h1] = lg.T
    return out, lse


def rel_err(x, ref) -> float:
    import torch
    x = x.float()
    if not torch.isfinite(x).all():
        return math.inf
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def torch_merge(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                **_unused) -> None:
    """The LSE merge of two partial attentions ([T, H, D] outputs, [H, T] natural-log LSEs) in
    torch, as vLLM's merge_attn_states computes it; output may alias prefix_output."""
    import torch
    p, s = prefix_lse.float(), suffix_lse.float()
    p = torch.where(torch.isposinf(p), torch.full_like(p, -math.inf), p)
    s = torch.where(torch.isposinf(s), torch.full_like(s, -math.inf), s)
    m = torch.maximum(p, s)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    pe, se = torch.exp(p - m_safe), torch.exp(s - m_safe)
    tot = pe + se
    w_p = (pe / tot).nan_to_num(0.0).T.unsqueeze(-1)
    w_s = (se / tot).nan_to_num(0.0).T.unsqueeze(-1)
    merged = prefix_output.float() * w_p + suffix_output.float() * w_s
    output.copy_(merged.to(output.dtype))
    if output_lse is not None:
        output_lse.copy_(torch.log(tot) + m)


def load_merge(device: str):
    """(merge function, what it is): vLLM's Triton merge_attn_states, which vLLM's merge dispatches
    to on an out-of-tree platform (is_cuda() is False there), else the torch merge."""
    if device.startswith("cuda"):
        try:
            from vllm.v1.attention.ops.triton_merge_attn_states import merge_attn_states
            return merge_attn_states, "vllm.v1.attention.ops.triton_merge_attn_states.merge_attn_states"
        except Exception as e:  # noqa: BLE001 - a missing vllm is a fallback, and said so
            return torch_merge, f"torch merge (vLLM's Triton merge not importable: {type(e).__name__}: {e})"
    return torch_merge, "torch merge (no CUDA)"


def context_pass(kernels, chunk_lens, q, ctx_k, ctx_v, suffix_o, suffix_lse, final, merge):
    """One layer's chunked-context attention as vLLM 0.33.0's MLA layer runs it for one request:
    per chunk the backend's non-causal run with its LSE converted to natural log [H, T]
    (FlashInferMLAPrefillBackend.run_prefill_context_chunk), the first chunk copied into the
    running partial and every later one merged into it (accumulate_mla_context_chunk; a single
    chunk is used as is), then the merge with the new tokens' partial into `final` (forward_mha)."""
    import torch
    output = output_lse = None
    start = 0
    for i, (kernel, n) in enumerate(zip(kernels, chunk_lens)):
        o, lse2 = kernel.run(q, ctx_k[start:start + n], ctx_v[start:start + n], return_lse=True)
        lse = lse2.transpose(0, 1) * LN2
        start += n
        if len(chunk_lens) == 1:
            output, output_lse = o, lse
        elif i == 0:
            output = torch.empty_like(o)
            output_lse = torch.empty((lse.shape[0], q.shape[0]), dtype=lse.dtype, device=lse.device)
            output.copy_(o)
            output_lse.copy_(lse)
        else:
            merge(output=output, output_lse=output_lse, prefix_output=output, prefix_lse=output_lse,
                  suffix_output=o, suffix_lse=lse)
    merge(output=final, prefix_output=output, prefix_lse=output_lse, suffix_output=suffix_o,
          suffix_lse=suffix_lse)
    return final


# ================================================================ measuring

@dataclass
class Settings:
    device: str = "cuda"
    backends: tuple = ("fa2", "fa3")
    heads: tuple = field(default_factory=heads_per_rank)
    new_token_totals: tuple = NEW_TOKEN_TOTALS
    chunk_q_lens: tuple = CHUNK_Q_LENS
    chunk_kv_lens: tuple = CHUNK_KV_LENS
    continue_contexts: tuple = CONTINUE_CONTEXTS
    continue_q_lens: tuple = CONTINUE_Q_LENS
    workspace_rows: tuple = WORKSPACE_ROWS
    block_size: int = BLOCK_SIZE
    modes: tuple = ("graph", "eager")
    samples: int = 20
    rounds: int = 5
    warmup: int = 2
    plan_samples: int = 5
    check_rows: int = 8
    budget_s: float = 170.0
    seed: int = 0
    parts: tuple = ("backend", "workspace")


def _indptr(lens, device="cpu"):
    import torch
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(list(lens), dtype=torch.int32), 0)
    return out.to(device)


def _sync(device):
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _gen(device, seed):
    import torch
    return torch.Generator(device=device).manual_seed(seed)


def mla_kv(n: int, heads: int, device, seed: int):
    """(k [n, H, 192] contiguous, v [n, H, 128] strided) laid out as vLLM's MLA layer hands them
    to the prefill backend: k = cat(k_nope, k_pe broadcast over heads), v a view of kv_b_proj's
    [n, H, nope + v] output."""
    import torch
    g = _gen(device, seed)
    kv_nope = torch.randn(n, heads, V3.qk_nope_head_dim + V_DIM, generator=g, device=device,
                          dtype=torch.bfloat16)
    k_pe = torch.randn(n, 1, V3.qk_rope_head_dim, generator=g, device=device, dtype=torch.bfloat16)
    k = torch.cat([kv_nope[..., :V3.qk_nope_head_dim], k_pe.expand(-1, heads, -1)], dim=-1)
    return k, kv_nope[..., V3.qk_nope_head_dim:]


def mla_q(n: int, heads: int, device, seed: int):
    import torch
    return torch.randn(n, heads, QK_DIM, generator=_gen(device, seed), device=device, dtype=torch.bfloat16)


def _check_rows(q_lens, max_rows: int, seed: int) -> list:
    """Rows to check against the reference: each request's first and last query, then spread."""
    import random
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    rows = set()
    for a, b in zip(starts, starts[1:]):
        rows.update((a, b - 1))
    rng = random.Random(seed)
    total = starts[-1]
    while len(rows) < min(max_rows, total):
        rows.add(rng.randrange(total))
    return sorted(rows)[:max(max_rows, 2 * len(q_lens))]


def _shape_reference(shape: PrefillShape, q, k, v, rows, scale):
    """float32 reference for the given global query rows of a prefill shape."""
    import torch
    q_starts, kv_starts = [0], [0]
    for a, b in zip(shape.q_lens, shape.kv_lens):
        q_starts.append(q_starts[-1] + a)
        kv_starts.append(kv_starts[-1] + b)
    outs, lses = [], []
    for j in range(len(shape.q_lens)):
        mine = [r for r in rows if q_starts[j] <= r < q_starts[j + 1]]
        if not mine:
            continue
        kk = k[kv_starts[j]:kv_starts[j + 1]]
        vv = v[kv_starts[j]:kv_starts[j + 1]]
        if shape.causal:
            vis = [shape.kv_lens[j] - shape.q_lens[j] + (r - q_starts[j]) + 1 for r in mine]
        else:
            vis = [shape.kv_lens[j]] * len(mine)
        o, l = reference_rows(q[mine], [(kk, vv, torch.tensor(vis))], scale)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _timer_cls(runs_per_graph: int):
    from mla_tune.measure.timing import KernelTimer
    return type("PrefillTimer", (KernelTimer,), {"RUNS_PER_GRAPH": max(1, runs_per_graph)})


def _sample_interleaved(timers: dict, settings: Settings) -> tuple[dict, dict]:
    """Every timer's samples, `rounds` rounds each taking a slice of every timer, the order rotated
    by one per round (drift spreads over all; the sweep's `sample_in_rounds`); a timer that fails
    keeps its error."""
    res, errors = sample_in_rounds(timers, settings.samples, settings.rounds)
    return res, {k: f"{type(e).__name__}: {e}" for k, e in errors.items()}


def _stats(samples) -> dict:
    if not samples:
        return {"median_us": None}
    q1, med, q3 = quartiles(samples)
    return {"median_us": med, "q1_us": q1, "q3_us": q3, "spread": (q3 - q1) / med if med else None}


def probe_backends(settings: Settings) -> dict:
    """Which backend values plan and run here (causal and non-causal), with the first call's
    time (FlashInfer's JIT compile and module load happen there)."""
    import torch

    from vllm_metax.ops.flashinfer_mla import BackendRefused, make_workspace
    from vllm_metax.ops.flashinfer_prefill import MLAPrefillKernel
    dev, h = settings.device, min(settings.heads)
    out = {}
    for b in settings.backends:
        t0 = time.perf_counter()
        try:
            kern = MLAPrefillKernel(make_workspace(dev), b)
            for causal, (ql, kl) in ((True, (16, 16)), (False, (16, 48))):
                kern.plan(_indptr([ql]), _indptr([kl]), h, QK_DIM, V_DIM, causal, SOFTMAX_SCALE,
                          torch.bfloat16, torch.bfloat16)
                k, v = mla_kv(kl, h, dev, 1)
                kern.run(mla_q(ql, h, dev, 2), k, v, return_lse=not causal)
            _sync(dev)
            out[b] = {"status": "ok", "first_call_s": time.perf_counter() - t0}
        except BackendRefused as e:
            out[b] = {"status": "refused", "reason": e.reason[:400]}
        except Exception as e:  # noqa: BLE001 - a backend that cannot run here is data
            out[b] = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:400]}"}
        say(f"  backend {b}: {out[b]['status']}"
            + (f" (first plan+run {out[b]['first_call_s']:.1f} s, JIT included)" if out[b]["status"] == "ok"
               else f": {out[b]['reason']}"))
    return out


def measure_backend_shape(shape: PrefillShape, backends: list, settings: Settings, index: int = 0) -> dict:
    """Part 1 for one shape: correctness of every backend on fresh inputs, then interleaved timing."""
    import torch

    from mla_tune.families.base import Prepared
    from vllm_metax.ops.flashinfer_mla import BackendRefused, make_workspace
    from vllm_metax.ops.flashinfer_prefill import MLAPrefillKernel
    dev, H = settings.device, shape.heads
    causal = shape.causal
    # the plugin plans new tokens from host index pointers, context chunks from vLLM's device ones
    qo = _indptr(shape.q_lens, "cpu" if causal else dev)
    kvp = _indptr(shape.kv_lens, "cpu" if causal else dev)
    row = {"part": "backend", "kind": shape.kind, "heads": H, "q_lens": list(shape.q_lens),
           "kv_lens": list(shape.kv_lens), "causal": causal, "label": shape.label,
           "flops": shape.flops(), "results": {}}
    kernels = {}
    for b in backends:
        try:
            kern = MLAPrefillKernel(make_workspace(dev), b)
            kern.plan(qo, kvp, H, QK_DIM, V_DIM, causal, SOFTMAX_SCALE, torch.bfloat16, torch.bfloat16)
            kernels[b] = kern
        except BackendRefused as e:
            row["results"][b] = {"status": "refused", "reason": e.reason[:400]}
        except Exception as e:  # noqa: BLE001
            row["results"][b] = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:400]}"}

    # correctness on fresh inputs, outputs poisoned first
    seed = settings.seed + 1000 + 10 * index
    q = mla_q(sum(shape.q_lens), H, dev, seed)
    k, v = mla_kv(sum(shape.kv_lens), H, dev, seed + 1)
    rows = _check_rows(shape.q_lens, settings.check_rows, seed)
    ref_o, ref_l = _shape_reference(shape, q, k, v, rows, SOFTMAX_SCALE)
    got = {}
    for b, kern in list(kernels.items()):
        out = torch.full((q.shape[0], H, V_DIM), float("nan"), dtype=torch.bfloat16, device=dev)
        try:
            r = kern.run(q, k, v, out=out, return_lse=not causal)
            o, lse = (r if not causal else (r, None))
            _sync(dev)
            err = rel_err(o[rows], ref_o)
            lerr = float((lse[rows].float() * LN2 - ref_l).abs().max()) if lse is not None else None
            written = bool(torch.isfinite(o).all())
            ok = written and err < REL_TOL and (lerr is None or lerr < LSE_TOL)
            row["results"][b] = {"status": "ok" if ok else "wrong", "rel_err": err, "lse_err": lerr,
                                 "all_written": written}
            got[b] = (o, lse)
            if not ok:
                kernels.pop(b)
        except Exception as e:  # noqa: BLE001
            row["results"][b] = {"status": "error", "reason": f"{type(e).__name__}: {str(e)[:400]}"}
            kernels.pop(b)
    if len(got) >= 2:
        names = sorted(got)
        a, c = got[names[0]], got[names[1]]
        row["max_abs_diff"] = {"pair": names[:2], "out": float((a[0].float() - c[0].float()).abs().max())}
        if a[1] is not None:
            row["max_abs_diff"]["lse_ln"] = float(((a[1] - c[1]).float() * LN2).abs().max())
    del q, k, v, got

    # timing: one input set per shape, every backend on it, interleaved
    q = mla_q(sum(shape.q_lens), H, dev, settings.seed)
    k, v = mla_kv(sum(shape.kv_lens), H, dev, settings.seed + 1)
    timer_cls = _timer_cls(math.ceil(settings.samples / max(settings.rounds, 1)))
    timers = {}
    for b, kern in kernels.items():
        out = torch.empty((q.shape[0], H, V_DIM), dtype=torch.bfloat16, device=dev)
        prepared = Prepared(
            run=lambda kern=kern, out=out: kern.run(q, k, v, out=out, return_lse=not causal),
            plan=lambda kern=kern: kern.plan(qo, kvp, H, QK_DIM, V_DIM, causal, SOFTMAX_SCALE,
                                             torch.bfloat16, torch.bfloat16),
            out=out)
        try:
            timers[b] = timer_cls(prepared, dev, settings.warmup, settings.plan_samples)
        except Exception as e:  # noqa: BLE001
            row["results"][b].update(status="error", reason=f"timer: {type(e).__name__}: {str(e)[:400]}")
    samples, errors = _sample_interleaved(timers, settings)
    for b, t in timers.items():
        res = row["results"][b]
        if b in errors:
            res.update(status="error", reason=errors[b])
        res.update(method=t.method, note=t.note, samples_us=samples[b], **_stats(samples[b]),
                   plan_us_median=statistics.median(t.plan_us) if t.plan_us else None)
        t.close()
    return row


def measure_continuation(heads: int, context_len: int, q_len: int, backends: list,
                         settings: Settings, merge) -> list:
    """Part 2 for one (heads, L, q): every (backend, W) chunked context pass checked against a
    float32 reference and against the single-chunk pass, then timed interleaved per mode."""
    import torch

    from mla_tune.families.base import Prepared
    from vllm_metax.ops.flashinfer_mla import make_workspace
    from vllm_metax.ops.flashinfer_prefill import MLAPrefillKernel
    dev, H = settings.device, heads
    bf16 = torch.bfloat16

    def inputs(seed):
        q = mla_q(q_len, H, dev, seed)
        ctx_k, ctx_v = mla_kv(context_len, H, dev, seed + 1)
        new_k, new_v = mla_kv(q_len, H, dev, seed + 2)
        return q, ctx_k, ctx_v, new_k, new_v

    configs, rows = {}, []
    for b in backends:
        suffix_kernel = MLAPrefillKernel(make_workspace(dev), b)
        suffix_kernel.plan(_indptr([q_len]), _indptr([q_len]), H, QK_DIM, V_DIM, True,
                           SOFTMAX_SCALE, bf16, bf16)
        for w in settings.workspace_rows:
            chunks = context_chunk_lens(context_len, w, settings.block_size)
            ws = make_workspace(dev)        # one per config, shared by its chunk plans (as the plugin)
            kernels, plans = [], []
            for n in chunks:
                kern = MLAPrefillKernel(ws, b)
                qo, kvp = _indptr([q_len], dev), _indptr([n], dev)
                plan = (lambda kern=kern, qo=qo, kvp=kvp: kern.plan(
                    qo, kvp, H, QK_DIM, V_DIM, False, SOFTMAX_SCALE, bf16, bf16))
                plan()
                kernels.append(kern)
                plans.append(plan)
            configs[(b, w)] = {"suffix": suffix_kernel, "chunks": chunks, "kernels": kernels, "plans": plans}
            rows.append({"part": "workspace", "heads": H, "context_len": context_len, "q_len": q_len,
                         "backend": b, "workspace_rows": w, "n_chunks": len(chunks),
                         "chunk_lens": chunks, "results": {}})

    def run_pass(cfg, data, final):
        q, ctx_k, ctx_v, new_k, new_v, suffix = data
        return context_pass(cfg["kernels"], cfg["chunks"], q, ctx_k, ctx_v, suffix[cfg["suffix"]][0],
                            suffix[cfg["suffix"]][1], final, merge)

    def with_suffix(data):
        q, _, _, new_k, new_v = data
        suffix = {}
        for cfg in configs.values():
            kern = cfg["suffix"]
            if kern not in suffix:
                o, lse2 = kern.run(q, new_k, new_v, return_lse=True)
                suffix[kern] = (o, lse2.transpose(0, 1) * LN2)
        return (*data, suffix)

    # correctness on fresh inputs: float32 reference over context + causal new tokens, and every
    # W against the one-chunk pass of its backend
    data = with_suffix(inputs(settings.seed + 7000 + context_len + q_len))
    q, ctx_k, ctx_v, new_k, new_v, _ = data
    check = _check_rows([q_len], settings.check_rows, settings.seed)
    vis_ctx = torch.full((len(check),), context_len)
    vis_new = torch.tensor([r + 1 for r in check])
    ref_o, _ = reference_rows(q[check], [(ctx_k, ctx_v, vis_ctx), (new_k, new_v, vis_new)], SOFTMAX_SCALE)
    finals = {}
    for row in rows:
        key = (row["backend"], row["workspace_rows"])
        final = torch.full((q_len, H, V_DIM), float("nan"), dtype=bf16, device=dev)
        try:
            run_pass(configs[key], data, final)
            _sync(dev)
            finals[key] = final
            err = rel_err(final[check], ref_o)
            row["check"] = {"rel_err": err, "all_written": bool(torch.isfinite(final).all())}
        except Exception as e:  # noqa: BLE001
            row["check"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    for row in rows:
        key = (row["backend"], row["workspace_rows"])
        one = next((k for k in finals if k[0] == key[0] and len(configs[k]["chunks"]) == 1), None)
        if key in finals and one is not None:
            row["check"]["rel_diff_vs_one_chunk"] = rel_err(finals[key], finals[one].float())
        c = row["check"]
        c["ok"] = bool("error" not in c and c["all_written"] and c["rel_err"] < REL_TOL
                       and c.get("rel_diff_vs_one_chunk", 0.0) < REL_TOL)
    del data, q, ctx_k, ctx_v, new_k, new_v, finals

    data = with_suffix(inputs(settings.seed))
    good = [r for r in rows if r["check"]["ok"]]
    for mode in settings.modes:
        timer_cls = _timer_cls(math.ceil(settings.samples / max(settings.rounds, 1)))
        timers = {}
        for row in good:
            key = (row["backend"], row["workspace_rows"])
            cfg = configs[key]
            final = torch.empty((q_len, H, V_DIM), dtype=bf16, device=dev)
            prepared = Prepared(run=lambda cfg=cfg, final=final: run_pass(cfg, data, final),
                                plan=lambda cfg=cfg: [p() for p in cfg["plans"]], out=final)
            try:
                timers[key] = timer_cls(prepared, dev, settings.warmup, settings.plan_samples,
                                        use_graph=(mode == "graph"))
            except Exception as e:  # noqa: BLE001
                row["results"][mode] = {"status": "error", "reason": f"timer: {type(e).__name__}: {str(e)[:400]}"}
        samples, errors = _sample_interleaved(timers, settings)
        for row in good:
            key = (row["backend"], row["workspace_rows"])
            if key not in timers:
                continue
            t = timers[key]
            note = t.note if mode == "graph" else "events around eager launches, as vLLM runs prefill"
            row["results"][mode] = {"status": "error" if key in errors else "ok",
                                    "reason": errors.get(key), "method": t.method, "note": note,
                                    "samples_us": samples[key], **_stats(samples[key]),
                                    "plan_us_median": statistics.median(t.plan_us) if t.plan_us else None}
            t.close()
        del timers
    for row in rows:
        if not row["check"]["ok"]:
            for mode in settings.modes:
                row["results"][mode] = {"status": "wrong" if "error" not in row["check"] else "error",
                                        "reason": row["check"].get("error", "failed the correctness check")}
    return rows


def memory_table(settings: Settings, default_rows: int) -> list:
    rows = sorted(set(settings.workspace_rows) | {default_rows})
    return [{"workspace_rows": w, "is_vllm_default": w == default_rows, "workspace_bytes": workspace_bytes(w),
             "per_heads": {str(h): {"upprojected_kv_bytes": upprojected_kv_bytes(w, h),
                                    "chunk_k_bytes": chunk_k_bytes(w, h)} for h in settings.heads}}
            for w in rows]


def measure(settings: Settings, command: str = "") -> dict:
    import torch

    from mla_tune.measure.environment import capture_environment
    from vllm_metax.ops.device_backends import device_flashinfer_backends
    t_start = time.perf_counter()
    dev = settings.device
    env = capture_environment("gpu" if dev.startswith("cuda") else "cpu-reference", command)
    fb = device_flashinfer_backends()
    default_rows = vllm_default_workspace_rows(V3_MAX_MODEL_LEN, V3_MAX_NUM_SEQS, settings.block_size)
    merge, merge_name = load_merge(dev)
    say(f"device {env['device_name']} (capability {env.get('capability')}), torch {env['torch']}, "
        f"flashinfer {env['flashinfer']}, vllm {env['vllm']}")
    say(f"plugin's prefill default here: {fb.default} (allowed {', '.join(fb.allowed)}); "
        f"vLLM's default workspace for DeepSeek-V3: {default_rows} rows; merge: {merge_name}")
    doc = {"environment": env, "settings": asdict(settings), "served_default_backend": fb.default,
           "served_allowed_backends": list(fb.allowed), "vllm_default_workspace_rows": default_rows,
           "merge": merge_name, "softmax_scale": SOFTMAX_SCALE, "dims": {
               "qk_nope": V3.qk_nope_head_dim, "qk_rope": V3.qk_rope_head_dim, "v": V_DIM,
               "kv_lora_rank": V3.kv_lora_rank, "dtype": "bfloat16"},
           "thresholds": {"min_ratio": MIN_RATIO, "p_threshold": P_THRESHOLD, "rel_tol": REL_TOL,
                          "lse_tol": LSE_TOL},
           "memory": memory_table(settings, default_rows), "rows": [], "skipped": [], "log": LOG}
    say("== backends")
    doc["availability"] = probe_backends(settings)
    ok = [b for b, a in doc["availability"].items() if a["status"] == "ok"]

    def over_budget(label):
        if time.perf_counter() - t_start > settings.budget_s:
            doc["skipped"].append(label)
            return True
        return False

    def measured(label, i, n, measure, *args):
        """measure(*args), or None when it raised (then skipped, its traceback shown)."""
        try:
            return measure(*args)
        except Exception as e:  # noqa: BLE001 - a shape that cannot be set up is data too
            say(f"[{i + 1}/{n}] {label}: FAILED {type(e).__name__}: {e}")
            doc["skipped"].append(label)
            traceback.print_exc()
            return None
        finally:
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()

    if "backend" in settings.parts and ok:
        shapes = new_token_shapes(settings.heads, settings.new_token_totals) + \
            context_chunk_shapes(settings.heads, settings.chunk_q_lens, settings.chunk_kv_lens)
        say(f"== part 1: {len(shapes)} shapes x {', '.join(ok)}")
        for i, shape in enumerate(shapes):
            if over_budget(shape.label):
                continue
            t0 = time.perf_counter()
            row = measured(shape.label, i, len(shapes), measure_backend_shape, shape, ok, settings, i)
            if row is None:
                continue
            doc["rows"].append(row)
            cells = "  ".join(f"{b} {_fmt_us(r.get('median_us'))}" + ("" if r["status"] == "ok" else f" [{r['status']}]")
                              for b, r in sorted(row["results"].items()))
            say(f"[{i + 1}/{len(shapes)}] {shape.label}: {cells}  ({time.perf_counter() - t0:.1f}s)")
    if "workspace" in settings.parts and ok:
        groups = [(h, L, q) for h in settings.heads for L in settings.continue_contexts
                  for q in settings.continue_q_lens]
        say(f"== part 2: {len(groups)} continuations x {', '.join(ok)} x W {settings.workspace_rows}")
        for i, (h, L, q) in enumerate(groups):
            label = f"continue H{h} L{L} q{q}"
            if over_budget(label):
                continue
            t0 = time.perf_counter()
            rows = measured(label, i, len(groups), measure_continuation, h, L, q, ok, settings, merge)
            if rows is None:
                continue
            doc["rows"].extend(rows)
            cells = "  ".join(f"{r['backend']}/W{_fmt_rows(r['workspace_rows'])}:{r['n_chunks']}ch "
                              f"{_fmt_us(r['results'].get('graph', r['results'].get(settings.modes[0], {})).get('median_us'))}"
                              for r in rows)
            say(f"[{i + 1}/{len(groups)}] {label}: {cells}  ({time.perf_counter() - t0:.1f}s)")
    doc["wall_s"] = time.perf_counter() - t_start
    return doc


# ================================================================ analysis and rendering

def _fmt_rows(w: int) -> str:
    return f"{w // 1024}K" if w % 1024 == 0 else str(w)


def _fmt_us(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:.2f}ms" if x >= 1000 else f"{x:.1f}us"


def backend_shapes(doc: dict, kind: str | None = None) -> list:
    """Part 1 rows as choice_verdict shapes: {label, samples: {backend: us}} of the valid backends."""
    out = []
    for r in doc["rows"]:
        if r["part"] != "backend" or (kind and r["kind"] != kind):
            continue
        s = {b: x["samples_us"] for b, x in r["results"].items()
             if x.get("status") == "ok" and len(x.get("samples_us") or []) >= 2}
        out.append({"label": r["label"], "samples": s})
    return out


def workspace_shapes(doc: dict, mode: str, backend: str | None = None) -> list:
    """Part 2 rows grouped per (heads, L, q, backend): {label, samples: {W: us}}."""
    groups: dict = {}
    for r in doc["rows"]:
        if r["part"] != "workspace" or (backend and r["backend"] != backend):
            continue
        x = r["results"].get(mode, {})
        key = (r["heads"], r["context_len"], r["q_len"], r["backend"])
        g = groups.setdefault(key, {"label": f"H{key[0]} L{key[1]} q{key[2]} {key[3]}", "samples": {}})
        if x.get("status") == "ok" and len(x.get("samples_us") or []) >= 2:
            g["samples"][r["workspace_rows"]] = x["samples_us"]
    return list(groups.values())


def summarize(doc: dict, compare=None) -> dict:
    default_b = doc.get("served_default_backend")
    default_w = doc.get("vllm_default_workspace_rows")
    s = {"backend": {"all": choice_verdict(backend_shapes(doc), default_b, compare, name="backend")},
         "workspace": {}}
    for kind in (NEW_TOKENS, CONTEXT_CHUNK):
        sh = backend_shapes(doc, kind)
        if sh:
            s["backend"][kind] = choice_verdict(sh, default_b, compare, name="backend")
    # per timing mode and backend: W is chosen for the backend a server plans with
    ws_backends = sorted({r["backend"] for r in doc["rows"] if r["part"] == "workspace"},
                         key=lambda b: (b != default_b, b))
    for mode in doc["settings"].get("modes", ()):
        for b in ws_backends:
            sh = workspace_shapes(doc, mode, b)
            if sh:
                v = choice_verdict(sh, default_w, compare, name="W")
                # the cheapest W that is never beyond noise slower than the best: memory it frees
                nb = [w for w in v.get("never_beaten", []) if isinstance(w, int)]
                v["smallest_never_beaten"] = min(nb) if nb else None
                s["workspace"][f"{mode}/{b}"] = v
    # A/A control: W values that give the same chunk list are the same computation
    aa = []
    for mode in doc["settings"].get("modes", ()):
        for r in doc["rows"]:
            if r["part"] != "workspace" or r["n_chunks"] != 1:
                continue
            x = r["results"].get(mode, {})
            if x.get("status") == "ok":
                aa.append((mode, r["heads"], r["context_len"], r["q_len"], r["backend"], x["median_us"]))
    same: dict = {}
    for mode, h, L, q, b, med in aa:
        same.setdefault((mode, h, L, q, b), []).append(med)
    spreads = [max(v) / min(v) for v in same.values() if len(v) >= 2]
    s["aa_control"] = {"n_groups": len(spreads), "max_ratio": max(spreads) if spreads else None,
                       "median_ratio": statistics.median(spreads) if spreads else None}
    errs = [x.get("rel_err") for r in doc["rows"] if r["part"] == "backend" for x in r["results"].values()
            if x.get("rel_err") is not None]
    diffs = [r["max_abs_diff"]["out"] for r in doc["rows"] if r.get("max_abs_diff")]
    werrs = [r["check"].get("rel_err") for r in doc["rows"] if r["part"] == "workspace" and "check" in r]
    s["correctness"] = {"backend_max_rel_err": max(errs) if errs else None,
                        "backend_max_abs_diff_out": max(diffs) if diffs else None,
                        "workspace_max_rel_err": max([e for e in werrs if e is not None], default=None),
                        "wrong": [f"{r.get('label') or r['heads']}: {b}" for r in doc["rows"]
                                  for b, x in r.get("results", {}).items() if x.get("status") == "wrong"]}
    return s


def render(doc: dict, summ: dict) -> str:
    env = doc.get("environment", {})
    th = doc.get("thresholds", {})
    rule = next((v["rule"] for v in [summ["backend"]["all"]]), "quartiles")
    noise = ("one-sided Mann-Whitney p < {p} and median ratio >= {r}" if rule == "mann-whitney"
             else "median ratio >= {r} and the slower one's Q1 above the faster one's Q3 (scipy absent)"
             ).format(p=th.get("p_threshold"), r=th.get("min_ratio"))
    L = [f"# MLA prefill: backend and chunked-prefill workspace on {env.get('device_name')}", "",
         f"torch {env.get('torch')}, flashinfer {env.get('flashinfer')}, vllm {env.get('vllm')}; "
         f"DeepSeek-V3 dims (qk 192 = 128 + 64, v 128, bf16, scale 1/sqrt(192)); through "
         f"vllm_metax.ops.flashinfer_prefill.MLAPrefillKernel. Served default here: "
         f"{doc.get('served_default_backend')}; vLLM's default workspace: "
         f"{doc.get('vllm_default_workspace_rows')} rows. Merge: {doc.get('merge')}.",
         f"Beyond noise = {noise}. Times are medians of {doc['settings'].get('samples')} samples "
         f"(IQR/median in brackets).", "", "## Verdicts", ""]
    b = summ["backend"]
    L.append(f"* **Prefill backend** (all {b['all']['n_shapes']} shapes): {b['all']['text']}")
    for kind in (NEW_TOKENS, CONTEXT_CHUNK):
        if kind in b:
            L.append(f"  * {kind}: {b[kind]['text']}")
    for key, v in summ["workspace"].items():
        L.append(f"* **Workspace size** ({key.replace('/', ', ')}, {v['n_shapes']} continuations): {v['text']}"
                 + (f"; smallest W never beyond noise slower: {v['smallest_never_beaten']}"
                    if v.get("smallest_never_beaten") else ""))
    aa = summ["aa_control"]
    if aa["n_groups"]:
        L.append(f"* A/A control (W values giving the same single chunk, {aa['n_groups']} groups): "
                 f"max/min median {aa['median_ratio']:.3f} median, {aa['max_ratio']:.3f} worst")
    c = summ["correctness"]
    L.append(f"* Correctness: backend rel err <= {_f(c['backend_max_rel_err'], '{:.1e}')}, fa2-vs-fa3 "
             f"max |diff| {_f(c['backend_max_abs_diff_out'], '{:.1e}')}, chunked passes rel err <= "
             f"{_f(c['workspace_max_rel_err'], '{:.1e}')}" + (f"; WRONG: {', '.join(c['wrong'])}" if c["wrong"] else ""))
    if doc.get("skipped"):
        L.append(f"* Not measured (budget or failure): {', '.join(doc['skipped'])}")

    backs = sorted({k for r in doc["rows"] if r["part"] == "backend" for k in r["results"]})
    if backs:
        L += ["", "## 1. Backend per shape", "",
              "| shape | TFLOP | " + " | ".join(backs) + " | ratio | best set | max abs diff |",
              "|---|---|" + "---|" * len(backs) + "---|---|---|"]
        per = {p["label"]: p for p in b["all"].get("per_shape", [])}
        for r in doc["rows"]:
            if r["part"] != "backend":
                continue
            cells = []
            for k in backs:
                x = r["results"].get(k, {})
                if x.get("status") == "ok" and x.get("median_us"):
                    cells.append(f"{_fmt_us(x['median_us'])} [{x['spread']:.2f}] {r['flops'] / x['median_us'] / 1e6:.0f}TF/s")
                else:
                    cells.append(x.get("status", "-"))
            p = per.get(r["label"])
            ratio = "-"
            if p and len(backs) == 2 and all(k in p["ratio"] for k in backs):
                ratio = f"{backs[0]}/{backs[1]} {p['ratio'][backs[0]] / p['ratio'][backs[1]]:.2f}"
            best = ",".join(map(str, p["best_set"])) if p else "-"
            d = r.get("max_abs_diff", {}).get("out")
            L.append(f"| {r['label']} | {r['flops'] / 1e12:.3f} | " + " | ".join(cells)
                     + f" | {ratio} | {best} | {_f(d, '{:.1e}')} |")

    ws = sorted({r["workspace_rows"] for r in doc["rows"] if r["part"] == "workspace"})
    if ws:
        for mode in doc["settings"].get("modes", ()):
            L += ["", f"## 2. Context pass per workspace size ({mode})", "",
                  "| H | L | q | backend | " + " | ".join(f"W={w} (chunks)" for w in ws) + " | best set |",
                  "|---|---|---|---|" + "---|" * len(ws) + "---|"]
            per = {p["label"]: p for k, v in summ["workspace"].items() if k.startswith(mode + "/")
                   for p in v.get("per_shape", [])}
            groups: dict = {}
            for r in doc["rows"]:
                if r["part"] == "workspace":
                    groups.setdefault((r["heads"], r["context_len"], r["q_len"], r["backend"]), {})[r["workspace_rows"]] = r
            for (h, Lc, q, bk), byw in groups.items():
                cells = []
                for w in ws:
                    r = byw.get(w)
                    x = r["results"].get(mode, {}) if r else {}
                    cells.append(f"{_fmt_us(x.get('median_us'))} ({r['n_chunks']})" if x.get("status") == "ok"
                                 else (x.get("status", "-") if r else "-"))
                p = per.get(f"H{h} L{Lc} q{q} {bk}")
                L.append(f"| {h} | {Lc} | {q} | {bk} | " + " | ".join(cells) + " | "
                         + (",".join(map(str, p["best_set"])) if p else "-") + " |")
    if doc.get("memory"):
        hs = list(doc["memory"][0]["per_heads"])
        L += ["", "## Memory per workspace size W", "",
              "gather workspace: allocated once per metadata builder, W x (512 + 64) x 2 B; up-projection: "
              "one chunk's kv_b_proj output W x H x 256 x 2 B, reserved by vLLM's profile run; k: one "
              "chunk's concatenated k W x H x 192 x 2 B, alive beside it and not reserved.", "",
              "| W | workspace | " + " | ".join(f"up-proj H{h} | k H{h}" for h in hs) + " |",
              "|---|---|" + "---|---|" * len(hs)]
        for m in doc["memory"]:
            L.append(f"| {m['workspace_rows']}{' (vLLM default)' if m['is_vllm_default'] else ''} | "
                     f"{m['workspace_bytes'] / 2**20:.0f} MiB | " + " | ".join(
                         f"{m['per_heads'][h]['upprojected_kv_bytes'] / 2**30:.2f} GiB | "
                         f"{m['per_heads'][h]['chunk_k_bytes'] / 2**30:.2f} GiB" for h in hs) + " |")
    av = doc.get("availability", {})
    if av:
        L += ["", "Backends: " + "; ".join(
            f"{b} {a['status']}" + (f" (first call {a['first_call_s']:.1f} s)" if a.get("first_call_s") else "")
            + (f": {a['reason']}" if a.get("reason") else "") for b, a in av.items())]
    if doc.get("wall_s"):
        L.append(f"Wall time of the measurement: {doc['wall_s']:.0f} s.")
    return "\n".join(L) + "\n"


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results", help="folder for prefill_choice.{json,md}")
    ap.add_argument("--backends", default="fa2,fa3")
    ap.add_argument("--tp", type=ints, default=TP_SIZES, help="DeepSeek-V3 TP sizes (1: 128 heads, 8: 16)")
    ap.add_argument("--workspaces", type=ints, default=WORKSPACE_ROWS)
    ap.add_argument("--contexts", type=ints, default=CONTINUE_CONTEXTS, help="part 2 context lengths L")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="graph,eager", help="part 2 timing: graph and/or eager")
    ap.add_argument("--parts", default="backend,workspace")
    add_shape_run_options(ap, budget_s=170.0, quick="16 heads, a few sizes: a smoke run",
                          analyze="re-decide and re-render an earlier run's JSON")
    args = ap.parse_args(argv)
    if args.analyze:
        doc = read_earlier_run(args.analyze)
        if doc is None:
            return 2
        print(render(doc, summarize(doc, scipy_compare())))
        return 0
    modes = tuple(m for m in args.modes.split(",") if m)
    if not set(modes) <= {"graph", "eager"} or args.samples < 2 or args.rounds < 1:
        ap.error("--modes takes graph,eager; --samples >= 2; --rounds >= 1")
    s = Settings(backends=tuple(b for b in args.backends.split(",") if b),
                 heads=heads_per_rank(args.tp), workspace_rows=args.workspaces,
                 continue_contexts=args.contexts, samples=args.samples, rounds=args.rounds,
                 modes=modes, parts=tuple(args.parts.split(",")), budget_s=args.budget_s)
    if args.quick:
        s.heads, s.new_token_totals, s.chunk_q_lens, s.chunk_kv_lens = (16,), (256, 2048), (256,), (1024, 16384)
        s.continue_contexts, s.continue_q_lens, s.workspace_rows = (32768,), (256,), (16384, 65536)
    try:
        import torch
        if not torch.cuda.is_available():
            print("error: no CUDA GPU here (this is a GPU benchmark; --analyze works anywhere)", file=sys.stderr)
            return 2
        doc = measure(s, " ".join(sys.argv))
    except Exception:
        traceback.print_exc()
        return 1
    return write(doc, Path(args.out))


def write(doc: dict, out: Path) -> int:
    summ = summarize(doc, scipy_compare())
    doc["summary"] = summ
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(doc, indent=1, default=str))
    text = render(doc, summ)
    (out / f"{NAME}.md").write_text(text)
    print()
    print(text)
    # the verdicts once more at the very end: a device reply keeps only the tail of the output
    print("== verdicts")
    print("\n".join(x for x in text.split("## 1.")[0].splitlines() if x.startswith(("*", "  *"))))
    print(f"wrote {out / (NAME + '.json')} and {out / (NAME + '.md')}")
    return 0


if __name__ == "__main__":
    if not os.environ.get("VLLM_METAX_FORCE"):
        from mla_tune.families.triton_mla import vllm_compiled_ops_missing
        if vllm_compiled_ops_missing():   # vLLM's own CUDA platform cannot load: ours must be active
            os.environ["VLLM_METAX_FORCE"] = "1"
    sys.exit(main())
