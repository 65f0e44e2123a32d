"""The CPU parts of bench/serve_bench.py: its client arguments parse with vLLM's own `vllm bench
serve` parser and draw, from the locally made tokenizer, the prompt lengths each workload names;
each setup's server environment; the report's ratios. Real vllm==0.33.0, no GPU, no server."""

from __future__ import annotations

import os

import json

import pytest

from bench_support import load_bench

pytestmark = pytest.mark.vllm

sb = load_bench("serve_bench")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    # the tokenizer and config alone: the client never reads weights
    sb.make_model_dir.__globals__["write_weights"] = lambda *a, **k: None
    return sb.make_model_dir(d, sb.model_config(16, 2, 4096, sb.MAX_MODEL_LEN + 1024))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(sb.WORKLOADS))
def test_each_workload_draws_its_lengths_through_vllms_client(model_dir, name, seed):
    """Every repeat's prompts (seed i), drawn by vLLM's client, pass the server's own checks."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.renderers.params import TokenizeParams
    from vllm.tokenizers.registry import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    wl = sb.WORKLOADS[name]
    inp, out, ratio, prompts, rates = wl
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(sb.bench_args(model_dir, 8000, wl, rates[0], seed))
    assert args.ignore_eos and args.dataset_name == "random" and args.num_prompts == prompts
    tok = get_tokenizer(str(model_dir))
    samples = get_samples(args, tok)
    assert len(samples) == prompts
    # the server's text check (vLLM answers 400 Bad Request where it fails: seed 1's longest
    # prompts did on the lent H100, 2026-12-07, when the longest vocabulary entry was 5 characters)
    check = TokenizeParams(max_total_tokens=sb.MAX_MODEL_LEN, max_output_tokens=out)
    for s in samples:
        assert check._text_len_check(tok, s.prompt) == s.prompt
        assert len(tok.encode(s.prompt)) <= s.prompt_len + 1          # its BOS at most
    lo, hi = inp * (1 - ratio["input"]), inp * (1 + ratio["input"])
    assert all(lo - 2 <= s.prompt_len <= hi + 2 for s in samples), [s.prompt_len for s in samples]
    assert max(s.prompt_len for s in samples) + out * (1 + ratio["output"]) <= sb.MAX_MODEL_LEN
    olo, ohi = out * (1 - ratio["output"]), out * (1 + ratio["output"])
    assert all(olo - 1 <= s.expected_output_len <= ohi + 1 for s in samples)
    assert len(rates) >= 3


def test_the_tokenizer_round_trips_every_id(model_dir):
    from vllm.tokenizers.registry import get_tokenizer

    tok = get_tokenizer(str(model_dir))
    ids = list(range(3, 4096, 7))
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids


def test_setups_get_the_environment_they_name(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_METAX_MLA_CONFIG_FOLDER", "/somewhere")
    empty = tmp_path / "empty"
    tuned = sb.server_env("tuned", "/tuned", empty)
    assert tuned["VLLM_METAX_FORCE"] == "1" and tuned["VLLM_METAX_MLA_CONFIG_FOLDER"] == "/tuned"
    packaged = sb.server_env("tuned", None, empty)
    assert "VLLM_METAX_MLA_CONFIG_FOLDER" not in packaged and "VLLM_METAX_MLA_PACKAGED_FOLDER" not in packaged
    for name in ("untuned", "triton16"):
        env = sb.server_env(name, "/tuned", empty)
        assert env["VLLM_METAX_MLA_PACKAGED_FOLDER"] == str(empty)
        assert "VLLM_METAX_MLA_CONFIG_FOLDER" not in env
    assert sb.SETUPS["triton16"][0] == ["--attention-backend", "TRITON_MLA", "--block-size", "16"]
    plain = sb.server_env("vllm_default", "/tuned", empty)
    assert "VLLM_METAX_FORCE" not in plain             # vLLM's own platform, the plugin inactive
    # and PyTorch's sampler, as the plugin's platform has (no FlashInfer sampler JIT at start)
    assert plain["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert all("VLLM_USE_FLASHINFER_SAMPLER" not in sb.server_env(n, None, empty) or
               sb.server_env(n, None, empty)["VLLM_USE_FLASHINFER_SAMPLER"] == os.environ.get(
                   "VLLM_USE_FLASHINFER_SAMPLER") for n in ("tuned", "untuned", "triton16"))


def test_the_report_quotes_tuned_over_each_setup():
    def run(tpot):
        return {"completed": 8, "p50_tpot_ms": tpot, "p99_tpot_ms": tpot * 2, "p50_itl_ms": tpot,
                "p99_itl_ms": tpot, "p50_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "output_throughput": 100.0}
    record = {"h16/tuned": {"model": "h16", "setup": "tuned", "runs": {"long@1": run(2.0), "long@4": run(3.0)}},
              "h16/triton16": {"model": "h16", "setup": "triton16", "runs": {"long@1": run(4.0), "long@4": run(6.0)}},
              "h16/vllm_default": {"model": "h16", "setup": "vllm_default", "skipped": "no FA3 here"}}
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert "| long@1 | p50_tpot_ms | 2.00 | 4.00 | 0.500 |" in md
    assert "p50 TPOT tuned / triton16, geomean over 2 workload-rates: 0.500" in md
    assert "- vllm_default: no FA3 here" in md
    assert "Profile" not in md                       # no --profile: no section
    assert "the server log warns" not in md
    # a tuned kernel the server could not run is said beside the numbers, once (the log repeats it)
    fa3 = ("(EngineCore pid=946) WARNING 12-07 08:14:49 [plan_choice.py:193] vllm_metax MLA: the tuned "
           "config's vLLM FA3 MLA decode cannot run here (num_splits=32, schedule=aot: not installed); "
           "FlashInfer decodes those steps")
    record["h16/tuned"]["log"] = [
        "(EngineCore pid=946) INFO 12-07 08:14:32 [__init__.py:64] vllm_metax MLA: tuned entry 16 heads",
        fa3, fa3.replace("08:14:49", "08:15:07"),
        "(EngineCore pid=946) WARNING 12-07 08:15:07 [kernel_warmup.py:1] not the plugin's"]
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert md.count("the server log warns") == 1
    # a setup without a tuned config by design does not list that as a warning
    record["h16/triton16"]["log"] = ["(EngineCore pid=1) WARNING 12-07 08:18:00 [discovery.py:88] "
                                     "vllm_metax MLA: no tuned config for 'X' (looked for /x)"]
    assert sb.report(record, {"device": "X", "date": "d", "note": "n"}).count("the server log warns") == 1
    # one setup alone (a run cut short): its numbers, no ratio columns, no goals
    alone = sb.report({"h128/tuned": {"model": "h128", "setup": "tuned", "runs": {"long@1": run(7.0)}}},
                      {"device": "X", "date": "d", "note": "n"})
    assert "| workload@rate | metric | tuned |" in alone and "tuned/" not in alone
    assert "| long@1 | p50_tpot_ms | 7.00 |" in alone and "Goals" not in alone
    # the long-context goal is set for 16 heads per rank; 128 heads get the other goals only
    h128 = {k.replace("h16", "h128"): {**r, "model": "h128"} for k, r in record.items()}
    md128 = sb.report(h128, {"device": "X", "date": "d", "note": "n"})
    assert "## h128" in md128 and "tuned / triton16 p50 TPOT <= 0.6" not in md128
    assert "tuned / triton16 p50 TPOT <= 0.6: met (long@1 0.500, long@4 0.500)" in md
    assert ("- tuned: the server log warns: vllm_metax MLA: the tuned config's vLLM FA3 MLA decode "
            "cannot run here (num_splits=32, schedule=aot: not installed); FlashInfer decodes those "
            "steps") in md
    json.dumps(record)
    step = lambda total, attn: {"steps": 32, "step_kernel_us": total, "attention_share": attn / total,  # noqa: E731
                                "per_step_us": {"attention": attn, "kv cache write": 0.0, "other": total - attn}}
    record["h16/tuned"]["profile"] = step(2000.0, 500.0)
    record["h16/triton16"]["profile"] = step(4000.0, 2500.0)
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert "tuned/triton16 GPU time per step 0.500; with tuned's attention free it would be 0.375" in md


def test_the_preflight_builds_vllms_http_app(model_dir):
    """What `vllm serve` builds after its engine is up (its routers and their imports), built
    here without an engine: the lent H100 once lost a whole run to an import at that point."""
    import plugin_support as ps

    ps.ensure_metax_platform()          # as the device run forces it (VLLM_METAX_FORCE=1)
    assert sb.preflight(model_dir) > 10


def _cell(tpot: float, completed: int = 48, failed: int = 0) -> dict:
    return {"completed": completed, "failed": failed, "p50_tpot_ms": tpot, "p99_tpot_ms": tpot * 2,
            "p50_itl_ms": tpot, "p99_itl_ms": tpot, "p50_ttft_ms": 10.0, "p99_ttft_ms": 20.0,
            "output_throughput": 100.0}


def test_cells_are_ordered_by_workload_then_rate():
    cells = ["chat@inf", "chat@32", "long@4", "chat@8", "other@1", "long@1", "long@inf"]
    assert sorted(cells, key=sb.cell_order) == ["long@1", "long@4", "long@inf", "chat@8", "chat@32",
                                                 "chat@inf", "other@1"]


def test_a_cell_is_the_median_of_its_repeats_and_keeps_lost_requests():
    cell = sb.median_summary([_cell(3.0), _cell(9.0, completed=47, failed=1), _cell(4.0)])
    assert cell["p50_tpot_ms"] == 4.0 and cell["p99_tpot_ms"] == 8.0
    assert cell["completed"] == 47 and cell["failed"] == 1


def _with_repeats(setup: str, cells: dict) -> dict:
    reps = {k: [_cell(t) for t in ts] for k, ts in cells.items()}
    return {"model": "h16", "setup": setup, "repeats": reps,
            "runs": {k: sb.median_summary(r) for k, r in reps.items()}}


def test_with_repeats_only_a_tested_difference_is_a_verdict():
    """chat@32: tuned's median 26% slower, but its repeats overlap untuned's: noise, not a verdict.
    chat@8: every tuned repeat slower, but by 2%: under the 5% floor. ragged@2: every repeat 10%
    slower: a verdict. long@1: every tuned repeat about 20% faster: faster beyond noise."""
    record = {"h16/tuned": _with_repeats("tuned", {"chat@32": [6.35, 3.7, 6.4], "chat@8": [2.04, 2.05, 2.06],
                                                   "ragged@2": [2.2, 2.21, 2.22], "long@1": [1.6, 1.62, 1.64]}),
              "h16/untuned": _with_repeats("untuned", {"chat@32": [5.02, 4.6, 7.0], "chat@8": [2.0, 2.01, 2.02],
                                                       "ragged@2": [2.0, 2.01, 2.02], "long@1": [2.0, 2.02, 2.04]})}
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert "| chat@32 | p50_tpot_ms | 6.35 [3.70-6.40] | 5.02 [4.60-7.00] | 1.265 |" in md
    goal = next(ln for ln in md.splitlines() if ln.startswith("- tuned no slower than untuned"))
    assert "3 repeats a cell: Mann-Whitney p < 0.1" in goal
    assert "NOT met: ragged@2 1.100" in goal and "chat@32" not in goal.split("; faster")[0]
    assert "chat@8" not in goal
    # the repeats side by side, seed by seed: chat@32's first repeat 1.265, its second 0.804
    paired = md.splitlines()[md.splitlines().index(goal) + 1]
    assert paired.startswith("  - tuned / untuned repeat by repeat (the same seed")
    assert "chat@32 1.265 0.804 0.914" in paired and "long@1 0.800 0.802 0.804" in paired
    assert "failed" not in md
    # a repeat that lost requests is said beside the setup's numbers
    record["h16/tuned"]["repeats"]["chat@8"][1] = _cell(2.05, completed=46, failed=2)
    assert "- tuned: chat@8 repeat 1: 2 of 48 requests failed" in sb.report(record, {"device": "X", "date": "d",
                                                                                    "note": "n"})
    # a setup cut before its first cell is said to be, not compared
    record["h16/vllm_default"] = {"model": "h16", "setup": "vllm_default", "partial": True}
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert "- tuned vs vllm_default: not measured (cut before its first cell)" in md
    assert goal.endswith("faster beyond noise in 1 of 4 (long@1 0.802)")
    # one run a cell: the 5% ratio alone, and the report says that is weak
    single = {k: {**r, "repeats": {}} for k, r in record.items()}
    goal1 = next(ln for ln in sb.report(single, {"device": "X", "date": "d", "note": "n"}).splitlines()
                 if ln.startswith("- tuned no slower than untuned"))
    assert "one run a cell" in goal1 and "chat@32 1.265" in goal1


def test_each_repeat_runs_vllms_client_with_its_own_seed(tmp_path, monkeypatch, model_dir):
    """run_setup with the server and vLLM's client replaced (the real ones need a GPU): repeat i
    draws with seed i, each cell keeps its repeats and their median."""
    seeds, tpot = [], iter([5.0, 3.0, 4.0, 2.0, 2.5, 2.2])

    class FakeServer:
        args = ["python", "-m", "vllm"]

        def __init__(self, model_dir, setup, port, log, env, compilation, extra=(), mode="w"):
            log.write_text("(EngineCore pid=1) INFO vllm_metax MLA: tuned entry 16 heads\n")

        def wait_ready(self, timeout):
            return 1.0

        def stop(self):
            pass

    def fake_client(argv):
        seeds.append(int(argv[argv.index("--seed") + 1]))
        return {**_cell(next(tpot)), "duration": 1.0, "mean_tpot_ms": 1.0}

    monkeypatch.setattr(sb, "Server", FakeServer)
    monkeypatch.setattr(sb, "run_client", fake_client)
    args = sb.argparse.Namespace(out=tmp_path, start_timeout=5, compilation="default", cache_root=None,
                                 tokens=False, profile=False,
                                 config_folder=None, repeats=3)
    record: dict = {}
    saved = []
    wl = {"chat": sb.WORKLOADS["chat"][:4] + (("8", "32"),)}
    sb.run_setup("h16", "tuned", model_dir, args, tmp_path / "empty", 8000, False, wl, record,
                 lambda: saved.append(sorted(record["h16/tuned"].get("runs", {}))))
    rec = record["h16/tuned"]
    assert seeds == [0, 1, 2, 0, 1, 2]
    assert [r["p50_tpot_ms"] for r in rec["repeats"]["chat@8"]] == [5.0, 3.0, 4.0]
    assert rec["runs"]["chat@8"]["p50_tpot_ms"] == 4.0 and rec["runs"]["chat@32"]["p50_tpot_ms"] == 2.2
    assert rec["log"] == ["(EngineCore pid=1) INFO vllm_metax MLA: tuned entry 16 heads"]
    assert "partial" not in rec and "previous" not in rec
    assert saved == [["chat@8"], ["chat@32", "chat@8"], ["chat@32", "chat@8"]]   # each cell, then the end

    # the same setup again, cut by the time limit (timeout's SIGTERM: SystemExit) in its second
    # cell: the first cell is saved and marked partial; the complete run before it is kept
    tpot = iter([1.0, 1.1, 1.2, 9.0])
    calls = iter(range(100))

    def cut_client(argv):
        if next(calls) == 4:
            raise SystemExit(143)
        return {**_cell(next(tpot)), "duration": 1.0, "mean_tpot_ms": 1.0}

    monkeypatch.setattr(sb, "run_client", cut_client)
    with pytest.raises(SystemExit):
        sb.run_setup("h16", "tuned", model_dir, args, tmp_path / "empty", 8000, False, wl, record,
                     lambda: saved.append(sorted(record["h16/tuned"].get("runs", {}))))
    cut = record["h16/tuned"]
    assert cut["partial"] and list(cut["runs"]) == ["chat@8"] and cut["runs"]["chat@8"]["p50_tpot_ms"] == 1.1
    assert cut["previous"]["runs"] == rec["runs"] and saved[-1] == ["chat@8"]
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert "- tuned: partial, cut before it finished (1 cell measured)" in md


def test_cells_pick_workload_rates_and_unknown_ones_are_refused(tmp_path, capsys):
    picked = sb.select_cells(dict(sb.WORKLOADS), "long@inf, chat@8,long@4")
    assert {w: wl[4] for w, wl in picked.items()} == {"long": ("4", "inf"), "chat": ("8",)}
    assert picked["long"][:4] == sb.WORKLOADS["long"][:4]
    assert sb.select_cells(dict(sb.WORKLOADS), "") == sb.WORKLOADS
    why = sb.select_cells(dict(sb.WORKLOADS), "long@4,chat@7")
    assert isinstance(why, str) and why.startswith("no such cell chat@7 (") and "chat@8" in why
    # the CLI: one line and exit 2, before any model is made or server started
    assert sb.main(["--out", str(tmp_path / "o"), "--cells", "ragged@3",
                    "--model-root", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("serve_bench: --cells: no such cell ragged@3") and err.count("\n") == 1
    assert not (tmp_path / "m").exists()


def test_profile_prompt_0_profiles_only_the_batch(tmp_path, monkeypatch, model_dir):
    """--profile-prompt 0 skips the single long request; the batch profile runs with its own shape
    (4 x 16384: the long workloads' batches at 128 heads)."""
    calls = []

    class FakeServer:
        args = ["python", "-m", "vllm"]

        def __init__(self, *a, **k):
            a[3].write_text("")

        def wait_ready(self, timeout):
            return 1.0

        def stop(self):
            pass

    def fake_profile(port, trace_dir, vocab, prompt_tokens, requests, layers):
        calls.append((prompt_tokens, requests, layers))
        return {"per_step_us": {"attention": 1.0}, "requests": requests, "prompt_tokens": prompt_tokens}

    monkeypatch.setattr(sb, "Server", FakeServer)
    monkeypatch.setattr(sb, "profile_decode", fake_profile)
    args = sb.argparse.Namespace(out=tmp_path, start_timeout=5, compilation="default", cache_root=None,
                                 tokens=False, profile=True, config_folder=None,
                                 repeats=1, profile_prompt=0, profile_batch=4, profile_batch_prompt=16384)
    record: dict = {}
    sb.run_setup("h128", "tuned", model_dir, args, tmp_path / "empty", 8000, False, {}, record)
    assert calls == [(16384, 4, 27)]
    assert "profile" not in record["h128/tuned"] and record["h128/tuned"]["profile_batch"]["requests"] == 4


def test_a_follow_up_run_is_attached_and_reported_after_the_run(tmp_path, capsys):
    meta = {"device": "GPU X", "date": "d1", "note": "survey"}
    survey = {"runs": {"h16/tuned": {"model": "h16", "setup": "tuned", "runs": {"chat@8": _cell(2.0)}},
                       "h16/untuned": {"model": "h16", "setup": "untuned", "runs": {"chat@8": _cell(2.5)}}},
              "meta": meta}
    results = tmp_path / "serve_bench_x.json"
    results.write_text(json.dumps(survey))
    rep = {k: dict(v, runs={"chat@32": _cell(t)}, repeats={"chat@32": [_cell(t - 0.1), _cell(t), _cell(t + 0.1)]})
           for (k, v), t in zip(survey["runs"].items(), (3.0, 4.0))}
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"runs": rep, "meta": {"device": "GPU X", "date": "d2", "note": "repeats"}}))
    assert sb.main(["--out", str(results), "--attach", str(run)]) == 0
    data = json.loads(results.read_text())
    assert data["runs"] == survey["runs"] and data["followups"][0]["runs"] == rep
    md = results.with_suffix(".md").read_text()
    first, second = md.split("# Follow-up: GPU X (d2)")
    assert "survey" in first and "chat@8" in first and "chat@32" not in first
    assert "repeats" in second and "| chat@32 | p50_tpot_ms | 3.00 [2.90-3.10] | 4.00 [3.90-4.10] | 0.750 |" in second
    # another device's run, or a file that is not a run: refused, nothing written
    before = results.read_text()
    run.write_text(json.dumps({"runs": rep, "meta": {"device": "GPU Y", "date": "d3", "note": "n"}}))
    assert sb.main(["--out", str(results), "--attach", str(run)]) == 2
    run.write_text("{not json")
    assert sb.main(["--out", str(results), "--attach", str(run)]) == 2
    assert results.read_text() == before
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "ran on GPU Y" in err[0] and err[1].startswith("serve_bench: --attach: JSONDecodeError")
    # a results file that is not one (a list, say) is refused the same way
    other = tmp_path / "other.json"
    other.write_text("[1, 2]")
    assert sb.main(["--out", str(other), "--attach", str(results)]) == 2
    assert other.read_text() == "[1, 2]"
    assert capsys.readouterr().err.strip() == f"serve_bench: --attach: {other}: no serve_bench run in it"


def test_the_batch_profile_prompt_is_n_or_a_range(tmp_path, capsys):
    assert sb.prompt_spec("512") == 512 and sb.prompt_spec("8192-32768") == (8192, 32768)
    for bad in ("32768-8192", "0", "x", "8k-32k"):
        with pytest.raises(sb.argparse.ArgumentTypeError):
            sb.prompt_spec(bad)
    # the CLI: argparse's one-line error and exit 2, no traceback
    with pytest.raises(SystemExit) as e:
        sb.main(["--out", str(tmp_path), "--profile-batch-prompt", "32768-8192"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--profile-batch-prompt: '32768-8192': positive, LO <= HI" in err and "Traceback" not in err


@pytest.mark.parametrize("mode", sorted(sb.COMPILATION))
def test_each_compilation_mode_parses_with_vllms_serve_parser(model_dir, mode):
    """The server command line of each --compilation mode, read by `vllm serve`'s own parser and
    turned into vLLM's CompilationConfig: default is vLLM's (compiled, FULL_AND_PIECEWISE)."""
    from vllm.config import CompilationConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    tokens = sb.tokens_args(sb.argparse.Namespace(tokens=True))
    cmd = sb.server_args(model_dir, "tuned", 8000, mode, sb.model_args("v3tp8") + tokens)
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", str(model_dir)]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", *cmd[4:]])
    assert args.load_format == "dummy" and args.max_model_len == sb.MAX_MODEL_LEN
    assert args.logprobs_mode == "raw_logits"           # --tokens: the top values are the LM head's logits
    cc = args.compilation_config if isinstance(args.compilation_config, CompilationConfig) else \
        CompilationConfig(**(args.compilation_config or {}))
    if mode == "default":
        assert "--compilation-config" not in cmd
        assert cc == CompilationConfig()                  # nothing set: vLLM decides, as for users
    else:
        assert cc.mode == 0 and str(cc.cudagraph_mode).endswith("FULL_DECODE_ONLY")
    assert sb.compilation_of({"compilation": mode}) == mode
    # results files from before --compilation: `compile` False was the eager-graphs default
    assert sb.compilation_of({"compile": False}) == "eager-graphs" and sb.compilation_of({"compile": True}) == "default"


def test_compile_off_is_eager_graphs_and_the_dry_run_prints_each_server(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_METAX_FORCE", "1")
    assert sb.main(["--out", str(tmp_path / "o"), "--models", "h16,v3tp8", "--setups", "tuned,vllm_default",
                    "--compile-off", "--cache-root", str(tmp_path / "c"), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# compilation: eager-graphs: torch.compile off")
    assert [ln.split("]")[0] + "]" for ln in out[1:]] == ["[h16/tuned]", "[h16/vllm_default]", "[v3tp8/tuned]",
                                                          "[v3tp8/vllm_default]"]
    assert all('"cudagraph_mode": "FULL_DECODE_ONLY"' in ln for ln in out[1:])
    assert f"VLLM_CACHE_ROOT={tmp_path / 'c' / 'h16_tuned' / 'vllm'}" in out[1]
    assert f"FLASHINFER_WORKSPACE_BASE={tmp_path / 'c' / 'v3tp8_vllm_default' / 'flashinfer'}" in out[4]
    assert "-u VLLM_METAX_FORCE" in out[2] and "-u VLLM_METAX_FORCE" not in out[1]   # vLLM alone
    assert all(("--load-format dummy" in ln) == ("v3tp8" in ln) for ln in out[1:])
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()          # nothing made
    assert sb.main(["--out", str(tmp_path / "o"), "--start-only", "-1"]) == 2
    assert capsys.readouterr().err.startswith("serve_bench: --start-only -1:")


def test_setups_get_caches_of_their_own(tmp_path):
    cache = tmp_path / "root" / "h16_tuned"
    env = sb.server_env("tuned", None, tmp_path / "empty", cache)
    assert {env[k] for k in ("VLLM_CACHE_ROOT", "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR",
                             "TORCHINDUCTOR_CACHE_DIR")} == {str(cache / d) for d in ("vllm", "flashinfer", "triton",
                                                                                      "inductor")}
    plain = sb.server_env("vllm_default", None, tmp_path / "empty", tmp_path / "root" / "h16_vllm_default")
    assert plain["VLLM_CACHE_ROOT"].endswith("h16_vllm_default/vllm")
    assert "VLLM_CACHE_ROOT" not in sb.server_env("tuned", None, tmp_path / "empty") or \
        sb.server_env("tuned", None, tmp_path / "empty")["VLLM_CACHE_ROOT"] == os.environ.get("VLLM_CACHE_ROOT")
    assert sb.cache_state(None) == "shared" and sb.cache_state(cache) == "cold"
    assert sb.empty_cache(cache) is None and sb.cache_state(cache) == "cold"      # made, marked, empty
    assert sb.jit_state(cache) == "empty" and sb.jit_state(None) is None
    (cache / "flashinfer" / "90a").mkdir(parents=True)
    (cache / "flashinfer" / "90a" / "mla.so").write_bytes(b"x")                # prebuilt: still cold
    assert sb.cache_state(cache) == "cold" and sb.jit_state(cache) == "filled"
    (cache / "vllm" / "torch_compile_cache").mkdir(parents=True)             # a server's compile cache
    assert sb.cache_state(cache) == "warm"
    sb.empty_cache(cache)
    sb.mark_started(cache)
    assert sb.cache_state(cache) == "warm"
    assert sb.empty_cache(cache) is None and sb.cache_state(cache) == "cold"      # emptied: it made it
    assert sb.jit_state(cache) == "empty"
    # a folder serve_bench did not make is never emptied
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("data")
    why = sb.empty_cache(other)
    assert why and "did not make it" in why and (other / "keep.txt").read_text() == "data"


def test_start_only_records_a_cold_then_warm_start_per_setup(tmp_path, monkeypatch, model_dir):
    """Each setup's server started twice and stopped once ready, nothing else sent: the first
    start cold (its own cache folder emptied, though an earlier run filled it), the second warm;
    the report compares them with vLLM's own server's against the start-up goals."""
    started, ready = [], iter([200.0, 60.0, 130.0, 58.0])

    class FakeServer:
        args = ["python", "-m", "vllm", "serve"]

        def __init__(self, model_dir, setup, port, log, env, compilation, extra=(), mode="w"):
            assert mode == "a" and compilation == "default"
            self.env = env
            started.append((setup, env["VLLM_CACHE_ROOT"]))

        def wait_ready(self, timeout):
            Path(self.env["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)    # a start fills its cache
            (Path(self.env["VLLM_CACHE_ROOT"]) / "torch_compile_cache").mkdir(exist_ok=True)
            return next(ready)

        def stop(self):
            pass

    from pathlib import Path
    monkeypatch.setattr(sb, "Server", FakeServer)
    monkeypatch.setattr(sb, "fa3_available", lambda: None)
    root = tmp_path / "caches"
    assert sb.empty_cache(root / "h16_tuned") is None
    (root / "h16_tuned" / "vllm").mkdir()                     # filled by an earlier call
    args = sb.argparse.Namespace(out=tmp_path, start_timeout=5, compilation="default", cache_root=root,
                                 config_folder=None, start_only=2, fresh_cache=True)
    record: dict = {}
    for setup in ("tuned", "vllm_default"):
        sb.start_only("h16", setup, model_dir, args, tmp_path / "empty", 8000, record)
    assert [s for s, _ in started] == ["tuned", "tuned", "vllm_default", "vllm_default"]
    assert started[0][1] == str((root / "h16_tuned" / "vllm").resolve())
    assert record["h16/tuned"]["starts"] == [{"cache": "cold", "ready_s": 200.0, "flashinfer_cache": "empty"},
                                             {"cache": "warm", "ready_s": 60.0, "flashinfer_cache": "empty"}]
    assert [(x["cache"], x["ready_s"]) for x in record["h16/vllm_default"]["starts"]] == [("cold", 130.0),
                                                                                         ("warm", 58.0)]
    # without --fresh-cache the caches are taken as they are: a third start of each is warm
    again = sb.argparse.Namespace(**{**vars(args), "fresh_cache": False, "start_only": 1})
    ready = iter([61.0, 57.0])
    warm: dict = {}
    for setup in ("tuned", "vllm_default"):
        sb.start_only("h16", setup, model_dir, again, tmp_path / "empty", 8000, warm)
    assert [warm[k]["starts"][0]["cache"] for k in ("h16/tuned", "h16/vllm_default")] == ["warm", "warm"]
    md = sb.report(record, {"device": "X", "date": "d", "note": "n", "compilation": "default"})
    assert "Compilation: vLLM's default compilation (torch.compile, FULL_AND_PIECEWISE" in md
    assert "| tuned | 200.0 | 60.0 | - |" in md and "| vllm_default | 130.0 | 58.0 | - |" in md
    assert "- cold start, tuned / vllm_default <= 1.2: NOT met (1.54: 200.0 s against 130.0 s)" in md
    assert "- warm start, tuned / vllm_default <= 1.1: met (1.03: 60.0 s against 58.0 s)" in md
    assert "workload@rate" not in md                          # no workloads, no table
    # a start that does not come up is recorded, not raised, and the setup's later starts skipped
    def fail(self, timeout):
        raise TimeoutError("server not ready in 5 s")
    monkeypatch.setattr(FakeServer, "wait_ready", fail)
    sb.start_only("h16", "tuned", model_dir, args, tmp_path / "empty", 8000, record)
    assert record["h16/tuned"]["starts"] == [{"cache": "cold", "error": "TimeoutError: server not ready in 5 s",
                                             "flashinfer_cache": "empty"}]
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert "- tuned: start 1 (cold caches) FAILED: TimeoutError: server not ready in 5 s" in md
    assert "Compilation: torch.compile off" in md          # a file without the field: the old default
    # with --fresh-cache, a cache root holding a folder serve_bench did not make: that setup fails,
    # nothing is deleted
    (root / "h16_untuned").mkdir()
    (root / "h16_untuned" / "x").write_text("y")
    sb.start_only("h16", "untuned", model_dir, args, tmp_path / "empty", 8000, record)
    assert "did not make it" in record["h16/untuned"]["error"] and (root / "h16_untuned" / "x").exists()


def test_prebuild_runs_before_each_plugin_setups_cold_start_in_its_environment(tmp_path, monkeypatch,
                                                                              model_dir):
    """--prebuild: `mla-tune prebuild` once per plugin setup, before its first (cold) start, with the
    server's FlashInfer cache and config; timed and reported apart, the start still cold."""
    import subprocess
    from pathlib import Path
    calls, ready = [], iter([90.0, 60.0, 130.0, 58.0])

    class FakeServer:
        args = ["python", "-m", "vllm", "serve"]

        def __init__(self, model_dir, setup, port, log, env, compilation, extra=(), mode="w"):
            self.env = env

        def wait_ready(self, timeout):
            Path(self.env["VLLM_CACHE_ROOT"]).mkdir(parents=True, exist_ok=True)
            return next(ready)

        def stop(self):
            pass

    def run(cmd, env, **kw):
        calls.append((cmd[1:], env["FLASHINFER_WORKSPACE_BASE"], env.get("VLLM_METAX_MLA_CONFIG_FOLDER")))
        return subprocess.CompletedProcess(cmd, 0, "3 modules in 41.0 s wall: 3 built\n", "")

    monkeypatch.setattr(sb, "Server", FakeServer)
    monkeypatch.setattr(sb, "fa3_available", lambda: None)
    monkeypatch.setattr(sb.subprocess, "run", run)
    root = tmp_path / "caches"
    args = sb.argparse.Namespace(out=tmp_path, start_timeout=5, compilation="default", cache_root=root,
                                 config_folder="/cfg", start_only=2, prebuild=True)
    record: dict = {}
    for setup in ("tuned", "vllm_default"):
        sb.start_only("h16", setup, model_dir, args, tmp_path / "empty", 8000, record)
    assert calls == [(["-m", "mla_tune", "prebuild"], str((root / "h16_tuned" / "flashinfer").resolve()), "/cfg")]
    assert record["h16/tuned"]["prebuild"]["rc"] == 0 and "prebuild" not in record["h16/vllm_default"]
    assert record["h16/tuned"]["starts"][0] == {"cache": "cold", "ready_s": 90.0, "flashinfer_cache": "empty"}
    assert "3 modules in 41.0 s wall" in (tmp_path / "prebuild_h16_tuned.log").read_text()
    md = sb.report(record, {"device": "X", "date": "d", "note": "n", "compilation": "default"})
    assert "- tuned: `mla-tune prebuild` before its cold start took " in md
    assert "- cold start, tuned / vllm_default <= 1.2: met (0.69: 90.0 s against 130.0 s)" in md


def _seq(tokens: list[int], gaps: float = 20.0) -> dict:
    """A served sequence in serve_tokens' form: each token's logit 10, the next id `gaps` ulps below."""
    ulp = 2 ** -4
    return {"tokens": tokens, "top": [[[t, 10.0], [t + 1, 10.0 - gaps * ulp]] for t in tokens]}


def _tokens(single: list[dict], batch: list[dict]) -> dict:
    return {"seed": 0, "vocab": 4096, "lens": [5, 40, 9], "max_tokens": 3, "top_k": 2, "single": single,
            "batch": batch, "wall_s": 1.0, "bf16_values": 1.0}


def test_tokens_are_collected_on_each_server_and_divergences_reported(tmp_path, monkeypatch, model_dir):
    """--tokens: the server runs with raw logits as its logprobs, the check's record is kept per
    setup, and the report classifies tuned's divergences from the other setups (a near-tie, a
    failure with its float32 verdict), each server against itself, and the goal."""
    extras, collected = [], iter([
        _tokens([_seq([5, 6, 7]), _seq([8, 9, 10])], [_seq([5, 6, 7]), _seq([8, 9, 10]), _seq([3, 4, 5])]),
        _tokens([_seq([5, 6, 7]), _seq([8, 30, 31])], [_seq([5, 6, 7]), _seq([8, 9, 10]), _seq([3, 4, 5])])])

    class FakeServer:
        args = ["python", "-m", "vllm"]

        def __init__(self, model_dir, setup, port, log, env, compilation, extra=(), mode="w"):
            extras.append(list(extra))
            log.write_text("")

        def wait_ready(self, timeout):
            return 1.0

        def stop(self):
            pass

    monkeypatch.setattr(sb, "Server", FakeServer)
    monkeypatch.setattr(sb, "fa3_available", lambda: None)
    monkeypatch.setattr(sb.serve_tokens, "collect", lambda port, vocab: next(collected))
    args = sb.argparse.Namespace(out=tmp_path, start_timeout=5, compilation="default", cache_root=None,
                                 tokens=True, profile=False, config_folder=None, repeats=1)
    record: dict = {}
    for setup in ("tuned", "vllm_default"):
        sb.run_setup("h16", setup, model_dir, args, tmp_path / "empty", 8000, False, {}, record)
    assert all(e[-2:] == ["--logprobs-mode", "raw_logits"] for e in extras)
    assert record["h16/tuned"]["tokens"]["single"][1]["tokens"] == [8, 9, 10]
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert ("- tuned vs vllm_default: 5 sequences, 1 diverge: 0 near-ties, 1 failures (bound 4 bf16 ulps of "
            "the top logit)") in md
    assert "  - failure, single prompt 1 (40 tokens), position 1: a server's token is not in the other's top 2" in md
    assert "- tuned against itself, one at a time vs in the batch: 0 of 2 diverge" in md
    assert "- goal, 0 divergences from another setup that are not near-ties: NOT met (1)" in md
    # the float32 reference's verdict, beside the failure (the reference itself needs the weights)
    monkeypatch.setattr(sb.serve_tokens, "reference_verdicts",
                        lambda d, cfg, a, b, cases, names, device: {"single/1": {"verdict": "prefers tuned's token"}})
    sb.check_failures("h16", record, model_dir, "cpu")
    assert "position 1: a server's token is not in the other's top 2; tokens 9 / 30" in sb.report(record, {
        "device": "X", "date": "d", "note": "n"})
    assert "; float32: prefers tuned's token" in sb.report(record, {"device": "X", "date": "d", "note": "n"})
    # v3tp8's weights are drawn inside the server: no reference, and the report says so
    v3 = {k.replace("h16", "v3tp8"): {**r, "model": "v3tp8"} for k, r in record.items()}
    v3["v3tp8/tuned"].pop("tokens_reference")
    sb.check_failures("v3tp8", v3, model_dir, "cpu")
    assert "  - float32: no float32 reference: the weights are drawn inside the server" in sb.report(
        v3, {"device": "X", "date": "d", "note": "n"})
    # records of other prompts (another version's lengths): said, not compared, no crash
    other = {k: {**r, "tokens": {**r["tokens"], "lens": [1, 2, 3]}} if k == "h16/vllm_default" else r
             for k, r in record.items()}
    md = sb.report(other, {"device": "X", "date": "d", "note": "n"})
    assert "- tuned vs vllm_default: not compared (the two records were collected with different prompts" in md
    # a server whose check failed: said, and nothing compared
    record["h16/vllm_default"]["tokens"] = {"error": "RuntimeError: prompt 5 (32000 tokens): HTTP 400"}
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert "- vllm_default: no tokens (RuntimeError: prompt 5 (32000 tokens): HTTP 400)" in md
    assert "tuned vs vllm_default" not in md and "goal, 0 divergences" not in md


def test_the_report_compares_attention_share_across_models():
    """Each model's decode-step profiles in one table: GPU time per step, attention's part and
    share, host time per decode-only step (the metadata build only where the tracer was on)."""
    def prof(total, attn, requests, host):
        return {"steps": 33, "steps_streamed": 32, "steps_source": "trace", "step_kernel_us": total,
                "attention_share": attn / total,
                "per_step_us": {"attention": attn, "kv cache write": 1.0, "other": total - attn - 1.0},
                "requests": requests, "prompt_tokens": 16384, "host": host}
    record = {"h16/tuned": {"model": "h16", "setup": "tuned", "runs": {},
                            "profile": prof(1800.0, 554.0, 1, {"decode_steps": 33, "execute_model_us": 410.0})},
              "v3tp8/vllm_default": {"model": "v3tp8", "setup": "vllm_default", "runs": {},
                                     "profile_batch": prof(9000.0, 900.0, 4, {
                                         "decode_steps": 30, "execute_model_us": 700.0, "python_tracer": True,
                                         "metadata_build_us": 95.0, "plugin_code_us": 0.0})}}
    md = sb.report(record, {"device": "X", "date": "d", "note": "n"})
    assert "## v3tp8: 16 heads, 61 layers; DeepSeek-V3's layers on one TP8 rank" in md
    assert "| h16 | tuned | 1 x 16384 | 1800 | 554 | 31% | 410.0 | - | - |" in md
    assert "| v3tp8 | vllm_default | 4 x 16384 | 9000 | 900 | 10% | 700.0 | 95.0 | 0.0 |" in md
    assert md.index("## Attention's share of a decode step") > md.index("## v3tp8")
    assert "Attention's share" not in sb.report({"h16/tuned": {"model": "h16", "setup": "tuned", "runs": {}}},
                                                {"device": "X", "date": "d", "note": "n"})


def test_the_start_up_lines_say_how_a_cold_start_got_its_flashinfer_modules():
    """A cold tuned start that built FlashInfer's modules itself is said to be one (the cold-start
    goal allows `mla-tune prebuild`, timed apart); one after a prebuild names the prebuild."""
    sb = load_bench("serve_bench")
    own = {"setup": "vllm_default", "model": "h16", "cache": "cold", "flashinfer_cache": "empty", "ready_s": 180.3}
    jit = {"setup": "tuned", "model": "h16", "cache": "cold", "flashinfer_cache": "empty", "ready_s": 326.5}
    text = "\n".join(sb.startup_lines({"tuned": jit, "vllm_default": own}))
    assert "no `mla-tune prebuild`: tuned built the config's FlashInfer modules inside the start" in text
    assert "NOT met (1.81: 326.5 s against 180.3 s)" in text
    pre = {**jit, "flashinfer_cache": "filled", "ready_s": 190.8, "prebuild": {"s": 162.0, "rc": 0}}
    text = "\n".join(sb.startup_lines({"tuned": pre, "vllm_default": {**own, "ready_s": 160.7}}))
    assert "inside the start" not in text
    assert "`mla-tune prebuild` before its cold start took 162.0 s" in text and "met (1.19" in text
