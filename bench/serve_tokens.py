"""Served tokens checked between two `vllm serve` servers (issue #51): does the tuned server serve
the same model as vLLM's own?

    python3 bench/serve_tokens.py collect --port 8471 --vocab 4096 --out tokens_tuned.json
    python3 bench/serve_tokens.py compare tokens_tuned.json tokens_vllm.json
    python3 bench/serve_tokens.py reference --results DIR/serve_bench.json --model h16 \
        --model-dir /tmp/serve_bench_models/h16        # float32 verdicts on the failures, on a GPU
    python3 bench/serve_bench.py --tokens ...          # collect on every server, report beside its numbers

`collect` sends greedy (temperature 0) /v1/completions with the top TOP_K logits of every
generated token (`logprobs`, token ids as ids) for prompts of SINGLE_LENS tokens (5 to 32,000),
one at a time, then the same prompts with BATCH_EXTRA ragged others all at once, so chunked prefill
mixes prefill and decode in one step. The server must run with `--logprobs-mode raw_logits`
(serve_bench adds it with --tokens): the values are then the LM head's bf16 logits, whose bf16
spacing (ulp) is known, not log-probabilities. Prompts are token ids drawn from a seeded generator,
the same on every server (`prompt_ids`).

`compare` finds, per prompt and mode, the first position where the two servers' tokens differ and
classifies it (`classify`):
  near-tie  each server puts the other's token at most NEAR_TIE_ULPS bf16 ulps below its own best
            logit there (so both servers' top-2 gaps are within the bound; a three-way tie counts);
  failure   anything else: a token one server ranks further below its best, or not in its top 5.
The bound: a logit is bf16, 8 significant bits. Rounding the two logits of a top-2 pair moves
their gap by up to 1 ulp in one server; the bf16 hidden state entering the LM head, summed in
another order upstream (split-KV against one-pass attention, FA3 against FlashInfer, chunked
prefill), moves it by about as much again. Two servers: 2 x (1 + 1) = 4 ulps. Nothing here
assumes the bound holds: on every position before the first difference both servers saw the same
context, so the difference of their top logits there is the servers' noise measured, reported
beside the bound (`noise`), with the distribution of top-2 gaps (`gaps`): where most positions are
near-ties the check cannot tell a bug from rounding, and the report says so. How sharp the tiny
models' logits are, measured on the CPU (2026-12-07, the 16-head 27-layer model with serve_bench's
seed, weights drawn on the CPU, the float32 reference over a 300-token prompt): top logits around
14.4 (ulp 1/16), top-2 gaps p10 2 and p50 11 ulps, 26% of positions within 4 ulps. So a quarter of
positions could flip by rounding; a wrong token elsewhere is a failure.

Failures are teacher-forced through serve_e2e's float32 reference (the tiny models' weights are on
disk; v3tp8's are drawn inside the server, so it has none): which of the two tokens float32
prefers, and by how much (`reference_verdicts`, run by serve_bench after the model's servers
stopped, or by `reference` above).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

SINGLE_LENS = (5, 40, 300, 2000, 9000, 32000)
BATCH_EXTRA = 10               # ragged prompts beside SINGLE_LENS' in the batch, 3 to 32,000 tokens
MAX_TOKENS = 32
TOP_K = 5
NEAR_TIE_ULPS = 4
SEED = 0
LOGPROBS_MODE = "raw_logits"   # `vllm serve --logprobs-mode`: the top values are bf16 logits


# ----------------------------------------------------------------------------- prompts

def prompt_lens(seed: int = SEED) -> list[int]:
    """Every prompt's length: SINGLE_LENS, then BATCH_EXTRA drawn log-uniformly from 3-32,000."""
    rng = random.Random(f"serve_tokens:{seed}:lens")
    return list(SINGLE_LENS) + [int(math.exp(rng.uniform(math.log(3), math.log(32000))))
                                for _ in range(BATCH_EXTRA)]


def prompt_ids(index: int, length: int, vocab: int, seed: int = SEED) -> list[int]:
    """Prompt `index`'s token ids: ids 3 and up (0-2 are the tokenizer's specials)."""
    rng = random.Random(f"serve_tokens:{seed}:{index}")
    return [rng.randrange(3, vocab) for _ in range(length)]


# ----------------------------------------------------------------------------- collect

def _id(token: str) -> int:
    return int(token.rsplit(":", 1)[1])       # "token_id:123" (return_tokens_as_token_ids)


def parse_choice(choice: dict) -> dict:
    """One completion's tokens and, per position, its top values as [[id, value], ...] best
    first."""
    lp = choice["logprobs"]
    top = [sorted(([_id(t), v] for t, v in (d or {}).items()), key=lambda x: -x[1]) for d in lp["top_logprobs"]]
    return {"tokens": [_id(t) for t in lp["tokens"]], "top": top}


def request(port: int, prompt: list[int], max_tokens: int = MAX_TOKENS, top_k: int = TOP_K,
            timeout: float = 600) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": top_k, "ignore_eos": True, "return_tokens_as_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return parse_choice(json.loads(r.read())["choices"][0])


def collect(port: int, vocab: int, seed: int = SEED, max_tokens: int = MAX_TOKENS, top_k: int = TOP_K) -> dict:
    """The check's requests against the server at `port`: SINGLE_LENS' prompts one at a time,
    then every prompt at once. Raises where a request fails (the caller records it)."""
    lens = prompt_lens(seed)
    t0 = time.perf_counter()
    single = [request(port, prompt_ids(i, n, vocab, seed), max_tokens, top_k)
              for i, n in enumerate(lens[:len(SINGLE_LENS)])]
    batch: list = [None] * len(lens)
    errors: list = []

    def one(i: int, n: int) -> None:
        try:
            batch[i] = request(port, prompt_ids(i, n, vocab, seed), max_tokens, top_k)
        except Exception as e:  # noqa: BLE001 - raised below, with the others'
            errors.append(f"prompt {i} ({n} tokens): {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate(lens)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    values = [v for seq in single + batch for pos in seq["top"] for _, v in pos]
    return {"seed": seed, "vocab": vocab, "max_tokens": max_tokens, "top_k": top_k, "lens": lens,
            "single": single, "batch": batch, "wall_s": round(time.perf_counter() - t0, 1),
            # raw logits are the LM head's bf16 outputs; log-probabilities almost never are
            "bf16_values": round(sum(is_bf16(v) for v in values) / max(len(values), 1), 4)}


# ----------------------------------------------------------------------------- classify

def is_bf16(x: float) -> bool:
    """Is `x` exactly a bfloat16 value (a float32 whose low 16 bits are zero)?"""
    import struct
    f32 = struct.pack("<f", x)
    return struct.unpack("<f", f32)[0] == x and struct.unpack("<I", f32)[0] & 0xFFFF == 0


def ulp_bf16(x: float) -> float:
    """The spacing of bfloat16 values at |x| (8 significant bits)."""
    x = abs(x)
    if x == 0 or not math.isfinite(x):
        return 2.0 ** -133
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def gap_ulps(top: list) -> float | None:
    """The top-2 gap of one position's values, in bf16 ulps of its top value."""
    if len(top) < 2:
        return None
    return (top[0][1] - top[1][1]) / ulp_bf16(top[0][1])


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def classify(a: dict, b: dict, bound: float = NEAR_TIE_ULPS) -> dict | None:
    """The first divergence of two servers' sequences (`parse_choice` form), classified; None
    where they agree. `gap_ulps`: how far below its own best each server puts the other's token
    (None where that token is not in its top values)."""
    i = first_difference(a["tokens"], b["tokens"])
    if i is None:
        return None
    out = {"position": i}
    if i >= min(len(a["tokens"]), len(b["tokens"])):
        return {**out, "kind": "failure", "why": f"lengths differ ({len(a['tokens'])} and {len(b['tokens'])} tokens)"}
    ta, tb = a["top"][i], b["top"][i]
    out.update(tokens=[a["tokens"][i], b["tokens"][i]], gap_ulps=[below(ta, b["tokens"][i]), below(tb, a["tokens"][i])],
               top2_ulps=[gap_ulps(ta), gap_ulps(tb)])
    if any(g is None for g in out["gap_ulps"]):
        return {**out, "kind": "failure", "why": f"a server's token is not in the other's top {len(ta)}"}
    if max(out["gap_ulps"]) > bound:
        return {**out, "kind": "failure", "why": "a gap above the bound"}
    return {**out, "kind": "near-tie"}


def below(top: list, token: int) -> float | None:
    """How far below the best of one position's top values `token` is, in bf16 ulps of the best
    (0 for the best itself; None where `token` is not among them)."""
    v = next((x[1] for x in top if x[0] == token), None)
    return None if v is None else (top[0][1] - v) / ulp_bf16(top[0][1])


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None


def compare(a: dict, b: dict, bound: float = NEAR_TIE_ULPS, modes=("single", "batch")) -> dict:
    """Two servers' `collect` records, prompt by prompt in each mode: every divergence classified,
    the servers' noise on the shared prefixes (their top logits' difference in ulps where both had
    the same context), and the distribution of `a`'s top-2 gaps in ulps."""
    if (a.get("seed"), a.get("lens")) != (b.get("seed"), b.get("lens")):
        raise ValueError("the two records were collected with different prompts (seed or lengths)")
    cases, noise, gaps = [], [], []
    for mode in modes:
        for i, (sa, sb) in enumerate(zip(a[mode], b[mode])):
            d = classify(sa, sb, bound)
            shared = len(sa["tokens"]) if d is None else d["position"]
            for pa, pb in zip(sa["top"][:shared], sb["top"][:shared]):
                if pa and pb:
                    noise.append(abs(pa[0][1] - pb[0][1]) / ulp_bf16(pa[0][1]))
            gaps += [g for g in map(gap_ulps, sa["top"]) if g is not None]
            if d:
                cases.append({"mode": mode, "prompt": i, "prompt_len": a["lens"][i], **d})
    n = sum(min(len(a[m]), len(b[m])) for m in modes)
    return {"bound_ulps": bound, "compared": n, "divergent": len(cases),
            "near_ties": sum(c["kind"] == "near-tie" for c in cases),
            "failures": sum(c["kind"] == "failure" for c in cases), "cases": cases,
            "noise_ulps": {"positions": len(noise), "p50": _pct(noise, 0.5), "p99": _pct(noise, 0.99),
                           "max": round(max(noise), 2) if noise else None},
            "gap_ulps": {"positions": len(gaps), "p10": _pct(gaps, 0.1), "p50": _pct(gaps, 0.5),
                         "within_bound": round(sum(g <= bound for g in gaps) / len(gaps), 4) if gaps else None}}


def summary_lines(name_a: str, name_b: str, c: dict, verdicts: dict | None = None) -> list[str]:
    """Report lines of one `compare`."""
    lines = [f"- {name_a} vs {name_b}: {c['compared']} sequences, {c['divergent']} diverge: "
             f"{c['near_ties']} near-ties, {c['failures']} failures (bound {c['bound_ulps']:g} bf16 ulps of "
             f"the top logit)"]
    nz, gp = c["noise_ulps"], c["gap_ulps"]
    if nz["positions"]:
        lines.append(f"  - noise where both had the same context ({nz['positions']} positions): top logits "
                     f"differ by p50 {nz['p50']}, p99 {nz['p99']}, max {nz['max']} ulps"
                     + (" (above the bound: the bound is too tight for these servers, or one is wrong)"
                        if nz["max"] is not None and nz["max"] > c["bound_ulps"] else ""))
    if gp["positions"]:
        weak = gp["within_bound"] >= 0.5
        lines.append(f"  - {name_a}'s top-2 gaps: p10 {gp['p10']}, p50 {gp['p50']} ulps; "
                     f"{100 * gp['within_bound']:.0f}% of positions within the bound"
                     + (": most positions are near-ties, so the check has little teeth here" if weak else ""))
    for case in c["cases"]:
        if case["kind"] != "failure":
            continue
        where = f"{case['mode']} prompt {case['prompt']} ({case['prompt_len']} tokens), position {case['position']}"
        text = f"  - failure, {where}: {case.get('why')}"
        if "gap_ulps" in case:
            text += (f"; tokens {case['tokens'][0]} / {case['tokens'][1]}, each below the other's best by "
                     + " / ".join("(not in its top values)" if g is None else f"{g:.1f} ulps"
                                  for g in case["gap_ulps"][::-1]))
        v = (verdicts or {}).get(case_key(case))
        if v:
            text += "; float32: " + (v.get("error") or v["verdict"])
        lines.append(text)
    return lines


def case_key(case: dict) -> str:
    return f"{case['mode']}/{case['prompt']}"


# ----------------------------------------------------------------------------- float32 reference

def reference_verdicts(model_dir: Path, config: dict, a: dict, b: dict, cases: list[dict], names=("a", "b"),
                       device: str = "cuda", limit: int = 8) -> dict:
    """Each failure (up to `limit`, shortest prompt first) teacher-forced through serve_e2e's
    float32 reference: its logits after the prompt and the shared tokens, and which of the two
    servers' tokens it prefers, by how many ulps of a bf16 logit there."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_e2e import Reference

    ref = Reference(Path(model_dir), device, config=config)
    out = {}
    todo = sorted((c for c in cases if c["kind"] == "failure" and "tokens" in c), key=lambda c: c["prompt_len"])
    for c in todo[:limit]:
        seq = a[c["mode"]][c["prompt"]]
        ctx = prompt_ids(c["prompt"], c["prompt_len"], a["vocab"], a["seed"]) + seq["tokens"][:c["position"]]
        try:
            lg = ref.logits(ctx)[-1]
        except Exception as e:  # noqa: BLE001 - out of memory on a long prompt, say: said, not fatal
            out[case_key(c)] = {"error": f"{type(e).__name__}: {e}"}
            continue
        ta, tb = c["tokens"]
        la, lb, best = float(lg[ta]), float(lg[tb]), int(lg.argmax())
        ulp = ulp_bf16(float(lg.max()))
        margin = abs(la - lb) / ulp
        pick = names[0] if la > lb else names[1] if lb > la else "neither"
        verdict = (f"prefers {pick}'s token by {margin:.1f} ulps" + (" (within the bound: a near-tie in "
                   "float32 too)" if margin <= NEAR_TIE_ULPS else "")
                   + ("" if best in (ta, tb) else f"; its best is another token, {best}"))
        out[case_key(c)] = {"fp32_logits": [la, lb], "fp32_best": best, "margin_ulps": round(margin, 2),
                            "prefers": pick, "verdict": verdict}
    if len(todo) > limit:
        out["_skipped"] = {"error": f"{len(todo) - limit} more failures not checked (limit {limit})"}
    return out


# ----------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="the check's requests against a running server")
    c.add_argument("--port", type=int, default=8471)
    c.add_argument("--vocab", type=int, required=True, help="the model's vocabulary size (config.json)")
    c.add_argument("--out", type=Path, required=True)
    k = sub.add_parser("compare", help="two `collect` files: every divergence classified")
    k.add_argument("a", type=Path)
    k.add_argument("b", type=Path)
    k.add_argument("--bound-ulps", type=float, default=NEAR_TIE_ULPS)
    r = sub.add_parser("reference", help="float32 verdicts on a serve_bench run's failures (GPU)")
    r.add_argument("--results", type=Path, required=True, help="serve_bench.json of a --tokens run")
    r.add_argument("--model", required=True)
    r.add_argument("--model-dir", type=Path, required=True)
    r.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "collect":
            a.out.write_text(json.dumps(collect(a.port, a.vocab)))
            print(f"{a.out}: tokens of {len(SINGLE_LENS)} prompts one at a time and {len(prompt_lens())} at once")
            return 0
        if a.cmd == "compare":
            ra, rb = json.loads(a.a.read_text()), json.loads(a.b.read_text())
            res = compare(ra, rb, a.bound_ulps)
            print("\n".join(summary_lines(a.a.stem, a.b.stem, res)))
            return 0 if res["failures"] == 0 else 1
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import serve_bench
        return serve_bench.tokens_reference(a.results, a.model, a.model_dir, a.device)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        print(f"serve_tokens: {a.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
