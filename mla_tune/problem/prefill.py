"""The MLA prefill problem: what one prefill attention plan computes, its random instances and its
torch reference.

MLA prefill is plain multi-head attention over up-projected heads (q/k: qk_nope + qk_rope, v:
v_head_dim): vLLM's MLA layer plans it once for the new tokens of a step (causal, each request's
KV is its own tokens) and once per context chunk (non-causal, a request's new tokens against a
workspace-sized chunk of its cached context). A bucket is what the plugin looks a plan up by
(`vllm_metax.core.decisions.prefill_statistic`): the plan kind, its total query tokens and its mean KV
tokens per request. A bucket is measured on a uniform plan: `requests` requests of
query_tokens / requests queries and kv_len KV tokens each (the new tokens: kv_len = queries per
request, so requests = query_tokens / kv_len; a context chunk: one request unless told).

In results.db a prefill workload shares the decode workloads' table: batch_size = requests,
q_len = query tokens per request, context_len = KV tokens per request, and `ragged` names the plan
kind (`LAYOUTS`), which no decode workload uses; `ResultsStore.trials()` leaves them out unless
asked for (`prefill=True`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from mla_tune.problem.workload import DTYPES, ModelDims, ProblemError

NEW_TOKENS = "prefill-causal"        # the new tokens of a step: causal
CONTEXT_CHUNK = "prefill-context"    # one context chunk: non-causal, LSE returned
LAYOUTS = (NEW_TOKENS, CONTEXT_CHUNK)
MAX_TOKENS = 1 << 20                 # query or KV tokens of one measured plan (memory bound)
# FlashInfer's ragged prefill compiles per (qk, vo) head dim; the plugin's prefill backend serves
# DeepSeek's 128 + 64 / 128 (FlashInferMLAPrefillBackend.supported_mla_dimensions)
QK_NOPE, QK_ROPE, V_DIM = 128, 64, 128


@dataclass(frozen=True)
class PrefillWorkload:
    """One prefill plan's shape at one head count per rank (uniform requests)."""

    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    softmax_scale: float
    causal: bool
    query_tokens: int
    kv_len: int
    requests: int = 1
    seed: int = 0
    q_dtype: str = "bfloat16"
    model: str = "custom"

    def __post_init__(self):
        for label, v, hi in (("heads per rank", self.num_heads, 1024),
                             ("query tokens", self.query_tokens, MAX_TOKENS),
                             ("KV tokens per request", self.kv_len, MAX_TOKENS),
                             ("requests", self.requests, MAX_TOKENS)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ProblemError(f"{label} must be an integer in 1..{hi}, got {v!r}")
        if self.query_tokens % self.requests:
            raise ProblemError(f"{self.query_tokens} query tokens do not split evenly over "
                               f"{self.requests} requests")
        if self.causal and self.kv_len * self.requests != self.query_tokens:
            raise ProblemError(f"new tokens attend to themselves: kv_len ({self.kv_len}) x requests "
                               f"({self.requests}) must be the query tokens ({self.query_tokens})")
        if self.requests * self.kv_len > MAX_TOKENS:
            raise ProblemError(f"{self.requests} x {self.kv_len} KV tokens is more than one measured "
                               f"plan takes ({MAX_TOKENS})")
        if self.q_dtype not in DTYPES:
            raise ProblemError(f"unsupported dtype {self.q_dtype!r}; one of {DTYPES}")

    @property
    def layout(self) -> str:
        return NEW_TOKENS if self.causal else CONTEXT_CHUNK

    @property
    def q_lens(self) -> list[int]:
        return [self.query_tokens // self.requests] * self.requests

    @property
    def kv_lens(self) -> list[int]:
        return [self.kv_len] * self.requests

    @property
    def total_kv_tokens(self) -> int:
        return self.kv_len * self.requests

    @property
    def key(self) -> dict:
        """The workloads-table columns this plan is stored under (see the module docstring)."""
        return {"model": self.model, "num_heads": self.num_heads, "kv_lora_rank": self.kv_lora_rank,
                "qk_rope_head_dim": self.qk_rope_head_dim, "softmax_scale": self.softmax_scale,
                "batch_size": self.requests, "context_len": self.kv_len,
                "q_len": self.query_tokens // self.requests, "ragged": self.layout,
                "seed": self.seed, "q_dtype": self.q_dtype, "kv_dtype": self.q_dtype}

    def lengths_json(self) -> None:
        """No per-request lengths are stored: a prefill plan's requests are uniform (`key`)."""
        return None

    @classmethod
    def from_row(cls, row: dict) -> "PrefillWorkload":
        """The workload a stored prefill trial row (ResultsStore.trials(prefill=True)) measured."""
        if row.get("ragged") not in LAYOUTS:
            raise ProblemError(f"not a prefill workload (layout {row.get('ragged')!r})")
        return cls(int(row["num_heads"]), int(row["kv_lora_rank"]), int(row["qk_rope_head_dim"]),
                   float(row["softmax_scale"]), row["ragged"] == NEW_TOKENS,
                   int(row["q_len"]) * int(row["batch_size"]), int(row["context_len"]),
                   int(row["batch_size"]), int(row["seed"]), row["q_dtype"], row["model"])

    def flops(self) -> int:
        """2 x multiply-adds of QK^T and PV over the (query, key) pairs the mask keeps."""
        q = self.query_tokens // self.requests
        pairs = self.requests * (q * (q + 1) // 2 if self.causal else q * self.kv_len)
        return 2 * pairs * self.num_heads * (QK_NOPE + QK_ROPE + V_DIM)

    def bytes(self, dtype_bytes: int = 2) -> int:
        """q, k, v read and out written once."""
        qk = QK_NOPE + QK_ROPE
        return dtype_bytes * self.num_heads * (self.query_tokens * (qk + V_DIM)
                                               + self.total_kv_tokens * (qk + V_DIM))

    def label(self) -> str:
        kind = "new" if self.causal else "ctx"
        return (f"H{self.num_heads} {kind} q{self.query_tokens} kv{self.kv_len}"
                + (f" x{self.requests} req" if self.requests > 1 else ""))


def prefill_workload(model: ModelDims, tp_size: int, causal: bool, query_tokens: int,
                     kv_len: int | None = None, requests: int | None = None,
                     q_dtype: str = "bfloat16", seed: int = 0) -> PrefillWorkload:
    """A prefill bucket of `model` at `tp_size`: new tokens (`kv_len` per request, default the
    whole plan as one request) or a context chunk (`requests`, default 1)."""
    if (model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim) != (QK_NOPE, QK_ROPE, V_DIM):
        raise ProblemError(f"{model.name}: MLA prefill is tuned for qk {QK_NOPE}+{QK_ROPE}, v {V_DIM} "
                           f"(what the plugin's prefill serves), not {model.qk_nope_head_dim}+"
                           f"{model.qk_rope_head_dim}, v {model.v_head_dim}")
    if causal:
        kv = kv_len or query_tokens
        if query_tokens % kv:
            raise ProblemError(f"{query_tokens} new tokens do not split into requests of {kv}")
        n = query_tokens // kv
    else:
        if kv_len is None:
            raise ProblemError("a context-chunk bucket needs its KV tokens per request")
        kv, n = kv_len, requests or 1
    # the scale vLLM's DeepSeek layer passes to MLA prefill: the model's (YaRN mscale^2 included)
    return PrefillWorkload(model.heads_per_rank(tp_size), model.kv_lora_rank, model.qk_rope_head_dim,
                           model.softmax_scale, causal, query_tokens, kv, n, seed, q_dtype, model.name)


# ---------------------------------------------------------------- instances and the reference

def indptr(lens, device="cpu"):
    import torch    # lazy: the store and the CLI read problem/ without torch
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(list(lens), dtype=torch.int32), 0)
    return out.to(device)


@dataclass
class PrefillProblem:
    """Random q, k, v of one prefill plan, laid out as vLLM's MLA layer hands them over."""

    workload: PrefillWorkload
    q: object            # [query tokens, H, qk]
    k: object            # [KV tokens, H, qk]
    v: object            # [KV tokens, H, v] (a strided view of kv_b_proj's output, as in vLLM)
    qo_indptr: object    # [requests + 1] int32: host for new tokens, device for a context chunk
    kv_indptr: object

    @property
    def device(self):
        return self.q.device


def make_prefill_problem(w: PrefillWorkload, device="cpu", seed: int = 0) -> PrefillProblem:
    """Fresh random inputs; the index pointers where the plugin has them (new tokens: the host,
    from vLLM's query lengths; a context chunk: vLLM's device cu_seq_lens)."""
    import torch
    from mla_tune.problem.instance import torch_dtype
    dt = torch_dtype(w.q_dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    H = w.num_heads
    q = torch.randn(w.query_tokens, H, QK_NOPE + QK_ROPE, generator=g, device=device).to(dt)
    n = w.total_kv_tokens
    kv_nope = torch.randn(n, H, QK_NOPE + V_DIM, generator=g, device=device).to(dt)
    k_pe = torch.randn(n, 1, QK_ROPE, generator=g, device=device).to(dt)
    k = torch.cat([kv_nope[..., :QK_NOPE], k_pe.expand(-1, H, -1)], dim=-1)
    where = "cpu" if w.causal else device
    return PrefillProblem(w, q, k, kv_nope[..., QK_NOPE:], indptr(w.q_lens, where),
                          indptr(w.kv_lens, where))


def check_rows(w: PrefillWorkload, max_rows: int = 48, seed: int = 0) -> list[int]:
    """Query rows the correctness gate compares: each request's first and last, then spread."""
    rows, start = set(), 0
    for n in w.q_lens:
        rows.update((start, start + n - 1))
        start += n
    rng = random.Random(seed)
    while len(rows) < min(max_rows, w.query_tokens):
        rows.add(rng.randrange(w.query_tokens))
    return sorted(rows)


def prefill_reference(p: PrefillProblem, rows: list[int], head_block: int = 16):
    """float32 attention for the given query rows: (out [rows, H, v], lse [rows, H] natural log).
    Query i of a request sees its first i + 1 + (kv_len - q_len) keys when causal, all otherwise."""
    import torch
    w = p.workload
    q_per = w.query_tokens // w.requests
    outs = torch.empty(len(rows), w.num_heads, V_DIM, dtype=torch.float32, device=p.device)
    lses = torch.empty(len(rows), w.num_heads, dtype=torch.float32, device=p.device)
    for j, r in enumerate(rows):
        req, i = divmod(r, q_per)
        visible = (w.kv_len - q_per + i + 1) if w.causal else w.kv_len
        k0 = req * w.kv_len
        for h0 in range(0, w.num_heads, head_block):
            hs = slice(h0, h0 + head_block)
            qq = p.q[r, hs].float()                                   # [h, qk]
            kk = p.k[k0:k0 + visible, hs].float()                     # [L, h, qk]
            vv = p.v[k0:k0 + visible, hs].float()                     # [L, h, v]
            s = torch.einsum("hd,lhd->hl", qq, kk) * w.softmax_scale
            lses[j, hs] = torch.logsumexp(s, -1)
            outs[j, hs] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), vv)
    return outs, lses


def relative_error(out, ref) -> float:
    o, r = out.double(), ref.double()
    if not bool(o.isfinite().all()):
        return math.inf
    d = r.norm().item()
    return (o - r).norm().item() / (d if d else 1.0)
