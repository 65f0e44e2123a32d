"""bench/experiments/prefill_choice.py on the CPU: its shape lists, vLLM's workspace and chunking rules (against
vLLM 0.33.0's own functions), the memory formulas, the beyond-noise rule and the verdicts on
constructed samples, the LSE merge and the chunked context pass against a float64 reference, and
the whole measuring pipeline over a torch stand-in for FlashInfer's ragged prefill (one of whose
backends is wrong on purpose and must not win)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from bench_support import load_bench
from prefill_support import reference

@pytest.fixture(scope="module")
def pc():
    return load_bench("prefill_choice")


# ---------------------------------------------------------------- shapes

def test_ragged_lengths_split_the_total_into_different_positive_lengths(pc):
    for total in (256, 1024, 2048, 8192, 37):
        lens = pc.ragged_lengths(total)
        assert sum(lens) == total and min(lens) >= 1 and len(lens) == 4
    assert pc.ragged_lengths(256) == (16, 48, 64, 128)
    assert len(set(pc.ragged_lengths(8192))) == 4
    with pytest.raises(ValueError):
        pc.ragged_lengths(2)


def test_shape_lists_cover_the_question(pc):
    assert pc.heads_per_rank() == (128, 16)                  # DeepSeek-V3 TP1 and TP8
    new = pc.new_token_shapes()
    assert {s.heads for s in new} == {128, 16}
    assert {sum(s.q_lens) for s in new} == {256, 1024, 2048, 8192}
    assert all(s.causal and s.q_lens == s.kv_lens for s in new)
    assert sorted({len(s.q_lens) for s in new}) == [1, 4]
    assert len(new) == 2 * 4 * 2
    ctx = pc.context_chunk_shapes()
    assert not any(s.causal for s in ctx)
    assert {s.kv_lens[0] for s in ctx} == {1024, 4096, 16384, 65536}
    assert len({s.label for s in new + ctx}) == len(new + ctx)


def test_flops_count_the_kept_pairs(pc):
    causal = pc.PrefillShape(pc.NEW_TOKENS, 2, (4,), (4,))
    assert causal.flops() == 2 * 10 * 2 * (192 + 128)          # 4 + 3 + 2 + 1 pairs
    chunk = pc.PrefillShape(pc.CONTEXT_CHUNK, 2, (4, 1), (8, 3))
    assert chunk.flops() == 2 * (32 + 3) * 2 * 320


# ---------------------------------------------------------------- vLLM's rules

def _vllm_config(max_model_len, max_num_seqs, block_size, dcp=1, interleave=1):
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=dcp,
                                        cp_kv_cache_interleave_size=interleave))


@pytest.mark.vllm
def test_default_workspace_rows_is_vllms_rule(pc):
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
    rule = MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size
    for mml in (512, 2048, 4096, 8191, 8192, 32768, 163840):
        for seqs in (1, 16, 256, 1024):
            for block in (1, 16, 64, 128):
                for dcp, il in ((1, 1), (2, 1), (4, 16)):
                    got = pc.vllm_default_workspace_rows(mml, seqs, block, dcp, il)
                    assert got == rule(_vllm_config(mml, seqs, block, dcp, il)), (mml, seqs, block, dcp)
    assert pc.vllm_default_workspace_rows(pc.V3_MAX_MODEL_LEN, pc.V3_MAX_NUM_SEQS, 64) == 65536


@pytest.mark.vllm
def test_context_chunks_are_the_ones_vllm_plans(pc):
    from vllm.model_executor.layers.attention.mla_attention import plan_mla_context_chunks
    rng = random.Random(3)
    cases = [(L, W, b) for L in (1, 63, 64, 65, 8192, 32768, 131072, 131073, 163840)
             for W in (16384, 32768, 65536, 131072) for b in (16, 64)]
    cases += [(rng.randrange(1, 300000), rng.randrange(64, 140000), rng.choice((1, 16, 64, 128)))
              for _ in range(200)]
    for L, W, b in cases:
        plans = plan_mla_context_chunks([L], W, W // b * b, b, lambda r: r)
        theirs = [n for p in plans for n in p.seq_lens]
        assert pc.context_chunk_lens(L, W, b) == theirs, (L, W, b)
        assert sum(theirs) == L
        if W % b == 0:
            assert len(theirs) == math.ceil(L / W)
    assert pc.context_chunk_lens(131072, 65536) == [65536, 65536]
    assert pc.context_chunk_lens(0, 65536) == []
    with pytest.raises(ValueError):
        pc.context_chunk_lens(100, 32, 64)


def test_memory_formulas_are_the_tensors_vllm_allocates(pc):
    meta = dict(dtype=torch.bfloat16, device="meta")

    def nbytes(*shape):
        t = torch.empty(shape, **meta)
        return t.numel() * t.element_size()

    for w in (16384, 65536, 131072):
        assert pc.workspace_bytes(w) == nbytes(w, 512 + 64)            # the builder's workspace
        assert pc.workspace_bytes(w, dcp_size=4) == nbytes(w + w // 4, 512 + 64)
        for h in (16, 128):
            assert pc.upprojected_kv_bytes(w, h) == nbytes(w, h, 128 + 128)   # the profile reservation
            assert pc.chunk_k_bytes(w, h) == nbytes(w, h, 192)
    assert pc.workspace_bytes(65536) == 72 << 20
    assert pc.upprojected_kv_bytes(65536, 128) == 4 << 30


# ---------------------------------------------------------------- beyond noise and verdicts

def _samples(median, jitter=0.01, n=20, seed=0):
    rng = random.Random(seed)
    return [median * (1 + rng.uniform(-jitter, jitter)) for _ in range(n)]


def _shape(label, **samples):
    return {"label": label, "samples": samples}


@pytest.fixture(params=["quartiles", "mann-whitney"])
def compare(request, pc):
    if request.param == "quartiles":
        return None
    c = pc.scipy_compare()
    if c is None:
        pytest.skip("scipy not installed")
    return c


def test_beats_needs_both_the_ratio_and_the_separation(pc, compare):
    fast, slow = _samples(100, seed=1), _samples(120, seed=2)
    c = pc.beats(fast, slow, compare=compare)
    assert c.beats and c.ratio == pytest.approx(1.2, rel=0.02)
    assert not pc.beats(slow, fast, compare=compare).beats
    assert not pc.beats(_samples(100, seed=1), _samples(103, seed=2), compare=compare).beats   # < 5%
    # a 10% median gap inside a spread of +-30%: not beyond noise
    assert not pc.beats(_samples(100, 0.3, seed=1), _samples(110, 0.3, seed=2), compare=compare).beats


def test_one_value_faster_everywhere_is_not_a_choice(pc, compare):
    shapes = [_shape(f"s{i}", fa2=_samples(100 * r, seed=i), fa3=_samples(100, seed=i + 50))
              for i, r in enumerate((1.2, 1.5, 2.0))]
    v = pc.choice_verdict(shapes, default="fa3", compare=compare, name="backend")
    assert v["kind"] == "not a choice" and v["winner"] == "fa3"
    assert v["text"].startswith("not a choice: backend fa3 wins everywhere (fa2/fa3 time 1.")
    assert "..2.0" in v["text"] or "..1.9" in v["text"]


def test_each_value_winning_somewhere_is_a_real_choice(pc, compare):
    shapes = [_shape("small", fa2=_samples(80, seed=1), fa3=_samples(100, seed=2)),
              _shape("big", fa2=_samples(150, seed=3), fa3=_samples(100, seed=4)),
              _shape("tie", fa2=_samples(100, seed=5), fa3=_samples(101, seed=6))]
    v = pc.choice_verdict(shapes, default="fa3", compare=compare, name="backend")
    assert v["kind"] == "real choice" and v["never_beaten"] == []
    assert "fa2 best at 1/3" in v["text"] and "fa3 best at 1/3" in v["text"]
    assert v["sole_winner_at"] == {"fa2": ["small"], "fa3": ["big"]}


def test_differences_within_noise_are_not_a_choice_and_keep_the_default(pc, compare):
    shapes = [_shape(f"s{i}", fa2=_samples(100, seed=i), fa3=_samples(102, seed=i + 9)) for i in range(3)]
    v = pc.choice_verdict(shapes, default="fa3", compare=compare, name="backend")
    assert v["kind"] == "not a choice" and v["winner"] == "fa3"      # the default, though slower by 2%
    assert "within noise" in v["text"] and set(v["never_beaten"]) == {"fa2", "fa3"}


def test_a_win_at_some_shapes_and_ties_elsewhere_is_not_a_choice(pc, compare):
    shapes = [_shape("a", fa2=_samples(130, seed=1), fa3=_samples(100, seed=2)),
              _shape("b", fa2=_samples(100, seed=3), fa3=_samples(100, seed=4))]
    v = pc.choice_verdict(shapes, default="fa3", compare=compare, name="backend")
    assert v["kind"] == "not a choice" and v["winner"] == "fa3"
    assert "beats backend fa2 beyond noise at 1/2 shapes" in v["text"]


def test_a_value_missing_somewhere_cannot_be_chosen(pc):
    shapes = [_shape("a", fa2=_samples(100), fa3=_samples(50)), _shape("b", fa2=_samples(100))]
    v = pc.choice_verdict(shapes, default="fa3", name="backend")
    assert v["kind"] == "not a choice" and "only fa2 measured at every shape" in v["text"]


def test_workspace_verdict_names_the_default_and_the_cheapest_free_size(pc):
    def row(w, L, med, n):
        return {"part": "workspace", "heads": 16, "context_len": L, "q_len": 256, "backend": "fa3",
                "workspace_rows": w, "n_chunks": n,
                "results": {"graph": {"status": "ok", "samples_us": _samples(med, seed=w + L),
                                      "median_us": med}}}
    rows = []
    for L, times in ((131072, {16384: 140, 32768: 103, 65536: 100, 131072: 101}),
                     (8192, {16384: 30, 32768: 30.2, 65536: 29.9, 131072: 30.1})):
        for w, t in times.items():
            rows.append(row(w, L, t, math.ceil(L / w)))
    doc = {"rows": rows, "settings": {"modes": ["graph"], "samples": 20},
           "vllm_default_workspace_rows": 65536, "served_default_backend": "fa3"}
    s = pc.summarize(doc)
    assert list(s["workspace"]) == ["graph/fa3"]
    v = s["workspace"]["graph/fa3"]
    assert v["kind"] == "not a choice" and v["winner"] == 65536
    assert v["never_beaten"] == [32768, 65536, 131072] and v["smallest_never_beaten"] == 32768
    assert "beats W 16384 beyond noise at 1/2 shapes" in v["text"]
    assert s["aa_control"]["n_groups"] == 1 and s["aa_control"]["max_ratio"] < 1.05   # L=8K: one chunk each
    assert "W=65536 (chunks)" in pc.render(doc | {"environment": {}, "thresholds": {}}, s)


# ---------------------------------------------------------------- the merge and the chunked pass

H, DQK, DV = 3, 192, 128


def _rand(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, d, generator=g, dtype=torch.float64)


def test_torch_merge_of_two_chunks_is_attention_over_both(pc):
    q, k, v = _rand(5, DQK, 1), _rand(40, DQK, 2), _rand(40, DV, 3)
    s = DQK ** -0.5
    o1, l1 = reference(q, k[:25], v[:25], [5], [25], s, causal=False)
    o2, l2 = reference(q, k[25:], v[25:], [5], [15], s, causal=False)
    full_o, full_l = reference(q, k, v, [5], [40], s, causal=False)
    out, lse = torch.empty_like(o1), torch.empty_like(l1)
    pc.torch_merge(output=out, prefix_output=o1, prefix_lse=l1, suffix_output=o2, suffix_lse=l2,
                   output_lse=lse)
    assert torch.allclose(out, full_o, atol=1e-6) and torch.allclose(lse, full_l, atol=1e-6)
    # in place, as vLLM accumulates chunks into its running partial
    pc.torch_merge(output=o1, prefix_output=o1, prefix_lse=l1, suffix_output=o2, suffix_lse=l2,
                   output_lse=l1)
    assert torch.allclose(o1, full_o, atol=1e-6) and torch.allclose(l1, full_l, atol=1e-6)


class ReferenceRagged:
    """Stand-in for FlashInfer's ragged prefill wrapper: float64 reference attention from the planned
    index pointers, LSE as FlashInfer returns it ([tokens, heads], base 2). `wrong` backends use a
    softmax scale of 1 (a fast wrong kernel); `refuse` backends refuse to plan."""

    wrong: set = set()
    refuse: set = set()

    def __init__(self, workspace, layout, backend="auto"):
        self.backend = backend

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             causal=False, sm_scale=None, q_data_type=None, kv_data_type=None, o_data_type=None):
        if self.backend in self.refuse:
            raise ValueError(f"{self.backend} is not supported on this device")
        assert (head_dim_qk, head_dim_vo, num_qo_heads) == (192, 128, num_kv_heads)
        self.qo, self.kv = qo_indptr.tolist(), kv_indptr.tolist()
        self.causal, self.scale = causal, 1.0 if self.backend in self.wrong else sm_scale

    def run(self, q, k, v, out=None, lse=None, return_lse=False):
        ql = [b - a for a, b in zip(self.qo, self.qo[1:])]
        kl = [b - a for a, b in zip(self.kv, self.kv[1:])]
        o, l = reference(q, k, v, ql, kl, self.scale, self.causal)
        o = o.to(q.dtype)
        if out is not None:
            out.copy_(o)
            o = out
        return (o, (l / math.log(2)).T.float()) if return_lse else o


def test_the_chunked_pass_is_attention_over_context_and_new_tokens(pc):
    L, qn, s = 150, 6, DQK ** -0.5
    q, ctx_k, ctx_v = _rand(qn, DQK, 4), _rand(L, DQK, 5), _rand(L, DV, 6)
    new_k, new_v = _rand(qn, DQK, 7), _rand(qn, DV, 8)
    # float64 truth: each new token sees the whole context and the new tokens up to itself
    keys, vals = torch.cat([ctx_k, new_k]), torch.cat([ctx_v, new_v])
    truth, _ = reference(q, keys, vals, [qn], [L + qn], s, causal=True)
    suffix = ReferenceRagged(None, "NHD", "fa2")
    suffix.plan(torch.tensor([0, qn]), torch.tensor([0, qn]), H, H, DQK, DV, True, s)
    so, sl = suffix.run(q, new_k, new_v, return_lse=True)
    for w in (16, 64, 160):
        chunks = pc.context_chunk_lens(L, w, 16)
        kernels = []
        for n in chunks:
            kern = ReferenceRagged(None, "NHD", "fa2")
            kern.plan(torch.tensor([0, qn]), torch.tensor([0, n]), H, H, DQK, DV, False, s)
            kernels.append(kern)
        final = torch.full((qn, H, DV), float("nan"), dtype=torch.float64)
        pc.context_pass(kernels, chunks, q, ctx_k, ctx_v, so, sl.transpose(0, 1) * math.log(2), final,
                        pc.torch_merge)
        assert len(chunks) == math.ceil(L / w)
        assert torch.allclose(final, truth, atol=1e-5), w
    # the rows the bench checks, through its own float32 reference, agree with the float64 truth
    rows = [0, 3, qn - 1]
    ref_o, _ = pc.reference_rows(q[rows], [(ctx_k, ctx_v, torch.full((3,), L)),
                                           (new_k, new_v, torch.tensor([r + 1 for r in rows]))], s)
    assert torch.allclose(ref_o.double(), truth[rows], atol=1e-4)


# ---------------------------------------------------------------- the whole pipeline, CPU stand-in

@pytest.mark.slow
def test_the_pipeline_measures_checks_and_decides(pc, monkeypatch, tmp_path):
    import vllm_metax.ops.flashinfer_prefill as op
    monkeypatch.setattr(op, "ragged_wrapper_cls", lambda: ReferenceRagged)
    monkeypatch.setattr(ReferenceRagged, "wrong", {"fa3"})
    monkeypatch.setattr(ReferenceRagged, "refuse", {"cutlass"})
    monkeypatch.setattr(pc, "LOG", [])
    s = pc.Settings(device="cpu", backends=("fa2", "fa3", "cutlass"), heads=(2,), new_token_totals=(16,),
                    chunk_q_lens=(4,), chunk_kv_lens=(24,), continue_contexts=(40,),
                    continue_q_lens=(4,), workspace_rows=(16, 32, 64), block_size=8, modes=("graph",),
                    samples=4, rounds=2, warmup=1, plan_samples=1, check_rows=4)
    doc = pc.measure(s)
    assert doc["availability"]["cutlass"]["status"] == "refused"
    assert {doc["availability"][b]["status"] for b in ("fa2", "fa3")} == {"ok"}
    backend_rows = [r for r in doc["rows"] if r["part"] == "backend"]
    assert len(backend_rows) == 3                                   # 16 tokens x (1, 4 requests) + 1 chunk
    for r in backend_rows:
        assert r["results"]["fa2"]["status"] == "ok" and len(r["results"]["fa2"]["samples_us"]) == 4
        assert r["results"]["fa2"]["rel_err"] < 1e-2
        assert r["results"]["fa3"]["status"] == "wrong"             # scale 1: caught, never timed
        assert "samples_us" not in r["results"]["fa3"]
    ws_rows = [r for r in doc["rows"] if r["part"] == "workspace"]
    assert sorted((r["backend"], r["workspace_rows"], r["n_chunks"]) for r in ws_rows) == [
        ("fa2", 16, 3), ("fa2", 32, 2), ("fa2", 64, 1), ("fa3", 16, 3), ("fa3", 32, 2), ("fa3", 64, 1)]
    for r in ws_rows:
        if r["backend"] == "fa2":
            assert r["check"]["ok"] and r["check"]["rel_diff_vs_one_chunk"] < 1e-2
            assert r["results"]["graph"]["status"] == "ok" and len(r["results"]["graph"]["samples_us"]) == 4
        else:
            assert not r["check"]["ok"] and r["results"]["graph"]["status"] == "wrong"
    assert pc.write(doc, tmp_path) == 0
    summ = doc["summary"]
    assert summ["backend"]["all"]["text"] == "not a choice: only fa2 measured at every shape"
    assert summ["correctness"]["wrong"]
    md = (tmp_path / "prefill_choice.md").read_text()
    assert "## 1. Backend per shape" in md and "## Memory per workspace size W" in md
    again = pc.summarize(__import__("json").loads((tmp_path / "prefill_choice.json").read_text()))
    assert again["backend"]["all"]["text"] == summ["backend"]["all"]["text"]
