"""bench/serve_tokens.py's classifier on synthetic servers: two that differ by bf16 rounding only
(divergences are near-ties), and negative controls that serve another model (a different seed,
logits scaled: every divergence a failure); the response format read through vLLM's own
completion-logprobs code; the float32 reference's query chunking; the report's section."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest

from bench_support import load_bench

st = load_bench("serve_tokens")

VOCAB = 64


def bf16(xs):
    import torch
    return torch.tensor(xs, dtype=torch.float32).to(torch.bfloat16).float().tolist()


def _draw(context: list[int], seed: int):
    import numpy as np

    key = hashlib.sha256(f"{seed}:{len(context)}:{context[-4:]}".encode()).digest()
    return np.random.default_rng(list(key[:8])).standard_normal(VOCAB)


def logits(context: list[int], seed: int, scale: float = 2.0, noise: int | None = None,
           perturb: float = 0.0) -> list[float]:
    """A synthetic model: logits drawn from the last tokens and the position (`seed` picks the
    model), rounded to bf16 like an LM head's output. `noise`: a server that computes the same
    model in another order: up to 1.5 bf16 ulps added before rounding, drawn per server.
    `perturb`: a slightly wrong model (that much of another model's logits added)."""
    import numpy as np

    x = _draw(context, seed) * scale + perturb * scale * _draw(context, seed + 100)
    if noise is not None:
        k2 = hashlib.sha256(f"noise{noise}:{len(context)}:{context[-4:]}".encode()).digest()
        ulp = np.array([st.ulp_bf16(v) for v in x])
        x = x + np.random.default_rng(list(k2[:8])).uniform(-1.5, 1.5, VOCAB) * ulp
    return bf16(x.tolist())


def serve(prompt: list[int], seed: int, n: int = 32, **kw) -> dict:
    """One greedy completion in parse_choice's form."""
    ctx, out = list(prompt), {"tokens": [], "top": []}
    for _ in range(n):
        lg = logits(ctx, seed, **kw)
        top = sorted(([i, v] for i, v in enumerate(lg)), key=lambda t: -t[1])[:st.TOP_K]
        out["tokens"].append(top[0][0])
        out["top"].append(top)
        ctx.append(top[0][0])
    return out


def record(seed: int, **kw) -> dict:
    """A `collect` record from a synthetic server (short prompts: the model reads 4 tokens)."""
    lens = [min(n, 50) for n in st.prompt_lens()]
    prompts = [st.prompt_ids(i, n, VOCAB) for i, n in enumerate(lens)]
    return {"seed": st.SEED, "vocab": VOCAB, "lens": lens, "max_tokens": 32, "top_k": st.TOP_K,
            "single": [serve(p, seed, **kw) for p in prompts[:len(st.SINGLE_LENS)]],
            "batch": [serve(p, seed, **kw) for p in prompts]}


@pytest.fixture(scope="module")
def base():
    return record(1)


def test_rounding_alone_gives_near_ties_only(base):
    other = record(1, noise=7)
    c = st.compare(base, other)
    assert c["compared"] == len(st.SINGLE_LENS) + len(st.prompt_lens())
    assert c["divergent"] >= 3, c                  # the noise flips some near-ties: the check is exercised
    assert c["failures"] == 0 and c["near_ties"] == c["divergent"], [x for x in c["cases"] if x["kind"] != "near-tie"]
    assert all(max(x["gap_ulps"]) <= st.NEAR_TIE_ULPS for x in c["cases"])
    # the noise where both had the same context is measured, within the bound
    assert c["noise_ulps"]["positions"] > 100 and 0 < c["noise_ulps"]["max"] <= st.NEAR_TIE_ULPS
    # and most positions are not near-ties: a wrong token would not pass as one
    assert c["gap_ulps"]["within_bound"] < 0.3 and c["gap_ulps"]["p50"] > 2 * st.NEAR_TIE_ULPS


@pytest.mark.parametrize("wrong", [dict(seed=2), dict(seed=1, perturb=0.1)],
                         ids=["another_model", "perturbed_model"])
def test_negative_controls_are_failures(base, wrong):
    """A server of another model (other weights), or of one perturbed by a tenth of another's
    logits (a wrong attention scale or a lost context chunk perturbs the hidden state): its
    divergences are failures, not passed off as near-ties."""
    c = st.compare(base, record(**wrong))
    assert c["divergent"] >= 3
    assert c["failures"] >= 0.7 * c["divergent"], c
    lines = st.summary_lines("tuned", "wrong", c)
    assert lines[0].startswith(f"- tuned vs wrong: {c['compared']} sequences, {c['divergent']} diverge")
    assert sum(ln.startswith("  - failure,") for ln in lines) == c["failures"]


def test_a_server_that_scales_every_logit_is_caught_by_its_noise(base):
    """Logits all scaled by 1.25 keep every greedy choice (a divergence is then a near-tie at
    most), but where both servers saw the same context their logits differ by far more than
    rounding does: the report says the noise is above the bound."""
    c = st.compare(base, record(1, scale=2.5))
    assert c["failures"] == 0 and c["noise_ulps"]["p50"] > 5 * st.NEAR_TIE_ULPS
    assert "above the bound" in st.summary_lines("tuned", "scaled", c)[1]
    assert "above the bound" not in "".join(st.summary_lines("tuned", "same", st.compare(base, record(1, noise=3))))


def test_classify_by_hand():
    def seq(tok, gap_ulps, second, top1=10.0, third=9):
        ulp = st.ulp_bf16(top1)
        return {"tokens": [5, tok], "top": [[[5, 12.0], [6, 1.0]],
                                            [[tok, top1], [second, top1 - gap_ulps * ulp], [third, top1 - 3 * ulp]]]}
    assert st.ulp_bf16(10.0) == 2 ** -4 and st.ulp_bf16(1.0) == 2 ** -7 and st.ulp_bf16(-3.0) == 2 ** -6
    assert st.classify(seq(7, 2, 8), seq(7, 3, 8)) is None
    tie = st.classify(seq(7, 2, 8), seq(8, 1, 7))
    assert tie["kind"] == "near-tie" and tie["position"] == 1 and tie["gap_ulps"] == [2.0, 1.0]
    assert st.classify(seq(7, 2, 8), seq(8, 5, 7))["kind"] == "failure"       # 7 is 5 ulps below b's best
    # a three-way tie: b's token is a's third, 3 ulps below its best
    assert st.classify(seq(7, 1, 8, third=9), seq(9, 2, 7))["kind"] == "near-tie"
    off = st.classify(seq(7, 1, 8, third=11), seq(9, 1, 8, third=12))      # 9 not among a's top values
    assert off["kind"] == "failure" and "not in the other's top" in off["why"] and off["gap_ulps"][0] is None
    short = {"tokens": [5], "top": [[[5, 12.0], [6, 1.0]]]}
    assert st.classify(seq(7, 2, 8), short)["why"].startswith("lengths differ")
    assert st.is_bf16(10.0) and st.is_bf16(10.0 - 3 * 2 ** -4) and not st.is_bf16(1 + 2 ** -10)
    assert not st.is_bf16(-0.6931471805599453)                                # a log-probability
    with pytest.raises(ValueError):
        st.compare({"seed": 0, "lens": [1]}, {"seed": 1, "lens": [1]})


def test_the_response_is_read_as_vllms_completion_code_writes_it():
    """vLLM's own `_create_completion_logprobs` (return_tokens_as_token_ids) makes the response's
    logprobs; parse_choice gets the ids and top values back, best first."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import Logprob

    fake = SimpleNamespace(return_tokens_as_token_ids=False,
                           _get_decoded_token=OpenAIServingCompletion._get_decoded_token)    # a staticmethod
    tops = [{17: Logprob(9.5, 1), 4: Logprob(9.25, 2), 99: Logprob(-1.0, 3)},
            {4: Logprob(3.0, 1), 17: Logprob(2.0, 2), 5: Logprob(1.5, 3)}]
    lp = OpenAIServingCompletion._create_completion_logprobs(fake, [17, 4], tops, 3, None, return_as_token_id=True)
    choice = json.loads(json.dumps({"logprobs": lp.model_dump()}))
    got = st.parse_choice(choice)
    assert got == {"tokens": [17, 4], "top": [[[17, 9.5], [4, 9.25], [99, -1.0]], [[4, 3.0], [17, 2.0], [5, 1.5]]]}


def test_prompts_are_the_same_everywhere_and_span_a_few_to_32k_tokens():
    lens = st.prompt_lens()
    assert lens == st.prompt_lens() and lens[:len(st.SINGLE_LENS)] == list(st.SINGLE_LENS)
    assert min(lens) <= 5 and max(lens) >= 32000 and len(set(lens)) > 10
    assert all(3 <= n <= 32000 for n in lens[len(st.SINGLE_LENS):])
    p = st.prompt_ids(3, 2000, 4096)
    assert p == st.prompt_ids(3, 2000, 4096) and p != st.prompt_ids(4, 2000, 4096)
    assert min(p) >= 3 and max(p) < 4096
    assert st.SINGLE_LENS[-1] + st.MAX_TOKENS <= 34816            # serve_bench's MAX_MODEL_LEN


def test_the_float32_reference_chunks_queries_without_changing_the_logits(tmp_path):
    """serve_e2e's Reference, as serve_tokens uses it on 32K prompts: attention in query chunks
    gives the logits of the one-shot computation (CPU, a 2-layer model)."""
    import torch

    e2e = load_bench("serve_e2e")
    tm = load_bench("tiny_model")
    cfg = {**tm.model_config(16, 2, 256, 4096), "hidden_size": 256, "intermediate_size": 512}
    d = tm.make_model_dir(tmp_path / "m", cfg)
    ids = st.prompt_ids(0, 70, 256)
    whole = e2e.Reference(d, "cpu", config=cfg).logits(ids)
    chunked = e2e.Reference(d, "cpu", config=cfg)
    chunked.score_elems = 16 * 70 * 9                  # 9 query rows at a time
    assert torch.allclose(whole, chunked.logits(ids), atol=1e-5)
    win = e2e.Reference(d, "cpu", config=cfg, window=16)
    win_chunked = e2e.Reference(d, "cpu", config=cfg, window=16)
    win_chunked.score_elems = 16 * 70 * 5
    assert torch.allclose(win.logits(ids), win_chunked.logits(ids), atol=1e-5)
    assert not torch.allclose(whole[-1], win.logits(ids)[-1], atol=1e-3)    # the window does matter
    # a failure teacher-forced: which server's token float32 prefers
    lg = whole[-1]
    best, second = [int(i) for i in lg.topk(2).indices]
    a = {"seed": st.SEED, "vocab": 256, "lens": [70], "single": [{"tokens": [best], "top": []}]}
    case = {"mode": "single", "prompt": 0, "prompt_len": 70, "position": 0, "kind": "failure",
            "tokens": [best, second]}
    v = st.reference_verdicts(d, cfg, a, a, [case], ("tuned", "vllm_default"), "cpu")["single/0"]
    assert v["prefers"] == "tuned" and v["fp32_best"] == best and v["verdict"].startswith("prefers tuned's token by")


def test_collect_against_an_http_server_answering_as_vllms_completions():
    """collect's requests (greedy, top-5, token ids as ids, every prompt's ids) against a small
    HTTP server that answers in vLLM's completion format from the synthetic model; its record
    compares with itself as equal, and the values are bf16."""
    import http.server
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            out = serve(body["prompt"][-50:], 1, body["max_tokens"])
            lp = {"tokens": [f"token_id:{t}" for t in out["tokens"]],
                  "token_logprobs": [top[0][1] for top in out["top"]],
                  "top_logprobs": [{f"token_id:{i}": v for i, v in top} for top in out["top"]]}
            data = json.dumps({"choices": [{"text": "", "logprobs": lp}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        rec = st.collect(srv.server_address[1], VOCAB, max_tokens=8)
    finally:
        srv.shutdown()
    lens = st.prompt_lens()
    assert len(seen) == len(st.SINGLE_LENS) + len(lens) and rec["lens"] == lens
    assert all(b["temperature"] == 0.0 and b["logprobs"] == st.TOP_K and b["return_tokens_as_token_ids"]
               and b["ignore_eos"] and b["max_tokens"] == 8 for b in seen)
    assert sorted(len(b["prompt"]) for b in seen) == sorted(list(st.SINGLE_LENS) + lens)
    assert [len(s["tokens"]) for s in rec["single"] + rec["batch"]] == [8] * len(seen)
    assert rec["bf16_values"] == 1.0
    same = st.compare(rec, rec)
    assert same["divergent"] == 0 and same["noise_ulps"]["max"] == 0


def test_the_cli_says_bad_input_in_one_line(tmp_path, capsys):
    results = tmp_path / "serve_bench.json"
    results.write_text(json.dumps({"runs": {"h16/tuned": {"model": "h16", "setup": "tuned"}}, "meta": {}}))
    assert st.main(["reference", "--results", str(results), "--model", "h128", "--model-dir", str(tmp_path)]) == 2
    assert st.main(["compare", str(tmp_path / "none.json"), str(results)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"serve_tokens: reference: ValueError: {results}: no run of model 'h128'",
                   f"serve_tokens: compare: FileNotFoundError: [Errno 2] No such file or directory: "
                   f"'{tmp_path / 'none.json'}'"]
