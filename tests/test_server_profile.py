"""bench/server_profile.py on the CPU: kernel names classified, a chrome trace summed per decode step,
the attention-free bound, and `profile_decode`'s protocol against a small HTTP server that streams
tokens, takes /start_profile and /stop_profile as vLLM's does, and writes a trace on stop."""

from __future__ import annotations

import gzip
import http.server
import json
import threading
import time

import pytest
from bench_support import load_bench


@pytest.fixture(scope="module")
def sp():
    return load_bench("server_profile")


@pytest.mark.parametrize("name, cls", [
    ("void flashinfer::mla::BatchMLAPagedAttentionKernel<KernelTraits<...>>(Params)", "attention"),
    ("_fwd_grouped_kernel_stage1", "attention"), ("_fwd_kernel_stage2", "attention"),
    ("void flash::FlashAttnFwdSm90<...>", "attention"), ("flash_fwd_splitkv_mla_kernel", "attention"),
    ("tma_kernel", "attention"), ("merge_kernel", "attention"),
    ("void vllm::concat_and_cache_mla_kernel<...>", "kv cache write"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "other"), ("void vllm::rms_norm_kernel<...>", "other"),
    ("triton_poi_fused_rotary_0", "other"),
])
def test_kernel_names_are_classified(sp, name, cls):
    assert sp.kernel_class(name) == cls


def _trace(path, kernels):
    events = [{"ph": "X", "cat": "kernel", "name": n, "ts": i * 10.0, "dur": d} for i, (n, d) in enumerate(kernels)]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999.0}]   # not a kernel
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_a_trace_is_summed_per_class_and_step(sp, tmp_path):
    _trace(tmp_path / "w0.123.pt.trace.json.gz", [("tma_kernel", 30.0), ("merge_kernel", 5.0),
                                                   ("gemm", 50.0), ("concat_and_cache_mla_kernel", 2.0)] * 4)
    s = sp.kernel_summary(tmp_path, steps=4)
    assert s["trace_files"] == 1 and s["kernel_launches"] == 16
    assert s["per_class_us"] == {"attention": 140.0, "kv cache write": 8.0, "other": 200.0}
    assert s["per_step_us"] == {"attention": 35.0, "kv cache write": 2.0, "other": 50.0}
    assert s["step_kernel_us"] == 87.0 and s["attention_share"] == pytest.approx(140 / 348, abs=1e-4)
    assert s["top"][0] == {"name": "gemm", "class": "other", "us": 200.0, "launches": 4}


def test_steps_are_counted_in_the_trace_where_the_model_layers_are_known(sp, tmp_path):
    """The trace spans a few more steps than the client counted (35 traced for 32 streamed): with
    the model's layers the steps come from its KV-cache writes, one per layer per step; a summary
    stored before that (its top kernels only) is re-stepped to the same figures."""
    layer = [("tma_kernel", 30.0), ("merge_kernel", 5.0), ("gemm", 50.0), ("concat_and_cache_mla_kernel", 2.0)]
    _trace(tmp_path / "w0.1.pt.trace.json.gz", layer * 3 * 35)
    s = sp.kernel_summary(tmp_path, steps=32, layers=3)
    assert (s["steps"], s["steps_streamed"], s["steps_source"]) == (35, 32, "trace")
    assert s["per_step_us"] == {"attention": 105.0, "kv cache write": 6.0, "other": 150.0}
    assert s["step_kernel_us"] == 261.0
    streamed = sp.kernel_summary(tmp_path, steps=32)           # no layers: the client's count
    assert (streamed["steps"], streamed["steps_source"]) == (32, "streamed")
    old = {k: v for k, v in streamed.items() if k not in ("steps_source", "steps_streamed", "kv_write_launches")}
    assert sp.restep(old, 3)["per_step_us"] == s["per_step_us"]
    assert sp.restep(s, 99) == s                               # counted already: unchanged
    # a trace without the KV-cache write (another cache kernel): the streamed count stays
    _trace(tmp_path / "w0.1.pt.trace.json.gz", layer[:3] * 3 * 35)
    assert sp.kernel_summary(tmp_path, steps=32, layers=3)["steps_source"] == "streamed"


def test_the_bound_is_tuned_without_attention_over_the_baseline(sp):
    prof = lambda step, attn: {"steps": 8, "step_kernel_us": step, "attention_share": attn / step,  # noqa: E731
                                "per_step_us": {"attention": attn, "kv cache write": 1.0, "other": step - attn - 1.0}}
    lines = sp.bound_lines({"tuned": prof(100.0, 20.0), "triton16": prof(160.0, 80.0), "untuned": {"error": "x"}})
    assert any(ln.startswith("- untuned: no profile (x)") for ln in lines)
    assert lines[-1].startswith("- tuned/triton16 GPU time per step 0.625; with tuned's attention free it would be 0.500")
    # what the 0.6 goal asks of tuned's attention: 0.6 * 160 - 80 = 16 us, it takes 20 (1.25x)
    goal = sp.bound_lines({"tuned": prof(100.0, 20.0), "triton16": prof(160.0, 80.0)}, goal=0.6)
    assert goal[-1] == "- for tuned/triton16 <= 0.6, tuned's attention would have to take <= 16 us per step; it takes 20 us (1.25x that)"
    met = sp.bound_lines({"tuned": prof(90.0, 10.0), "triton16": prof(160.0, 80.0)}, goal=0.6)
    assert met[-1].endswith("it takes 10 us (met)")
    # tuned's step without attention (90 us) already over 0.5 * 160: no attention time meets it
    beyond = sp.bound_lines({"tuned": prof(100.0, 10.0), "triton16": prof(160.0, 80.0)}, goal=0.5)
    assert beyond[-1].endswith("would have to take <= 0 us per step; it takes 10 us (out of reach: "
                               "tuned's step without attention is over the goal)")


class _FakeVllm(http.server.BaseHTTPRequestHandler):
    """Streams a token every 5 ms after a 0.2 s 'prefill'; records the profile calls; writes a
    trace with one attention and one other kernel per token streamed while profiling."""
    trace_dir, calls, profiling, prompts = None, [], [False, 0], []

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path in ("/start_profile", "/stop_profile"):
            type(self).calls.append(self.path)
            if self.path == "/start_profile":
                type(self).profiling[:] = [True, 0]
            else:
                n = type(self).profiling[1]
                type(self).profiling[0] = False
                # vLLM names each stop's trace anew (a timestamp): the call count stands in here
                _trace(self.trace_dir / f"rank0.{len(type(self).calls)}.pt.trace.json.gz",
                       [("tma_kernel", 10.0), ("gemm", 30.0)] * n)
            self.send_response(200)
            self.end_headers()
            return
        assert self.path == "/v1/completions" and body["stream"]
        type(self).prompts.append(len(body["prompt"]))
        self.send_response(200)
        self.end_headers()
        time.sleep(0.2)
        for i in range(body["max_tokens"]):
            if type(self).profiling[0]:
                type(self).profiling[1] += 1
            self.wfile.write(f'data: {{"choices": [{{"text": "w{i}"}}]}}\n\n'.encode())
            self.wfile.flush()
            time.sleep(0.005)
        self.wfile.write(b"data: [DONE]\n\n")


def test_profile_decode_profiles_a_window_of_decode_steps(sp, tmp_path):
    _FakeVllm.trace_dir, _FakeVllm.calls = tmp_path, []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        out = sp.profile_decode(srv.server_address[1], tmp_path, vocab=100, prompt_tokens=64, decode_steps=8,
                                timeout=30)
    finally:
        srv.shutdown()
    assert _FakeVllm.calls == ["/start_profile", "/stop_profile"]
    assert out["steps"] == 8 and out["trace_files"] == 1
    launches = out["kernel_launches"] // 2            # tokens streamed while profiling
    assert launches >= 8
    assert out["per_class_us"]["attention"] == 10.0 * launches
    assert 4.0 <= out["window_tpot_ms_p50"] < 100


def test_a_second_profile_sums_its_own_trace_only(sp, tmp_path):
    """serve_bench profiles each server twice (one long request, then a batch) into one trace
    folder: the second summary must not count the first profile's kernels."""
    _FakeVllm.trace_dir, _FakeVllm.calls = tmp_path, []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        first = sp.profile_decode(srv.server_address[1], tmp_path, vocab=100, prompt_tokens=64,
                                  decode_steps=8, timeout=30)
        batch = sp.profile_decode(srv.server_address[1], tmp_path, vocab=100, prompt_tokens=32,
                                  requests=3, decode_steps=8, timeout=30)
    finally:
        srv.shutdown()
    assert len(list(tmp_path.glob("*.pt.trace.json.gz"))) == 2
    assert first["trace_files"] == 1 and batch["trace_files"] == 1 and batch["files_before"] == 1
    assert batch["requests"] == 3 and batch["steps"] == 8
    # three streams while profiling: about three tokens a step, each one attention launch here
    assert batch["per_class_us"]["attention"] == 10.0 * (batch["kernel_launches"] // 2)
    assert batch["kernel_launches"] // 2 >= 3 * 8 - 3
    assert first["kernel_launches"] // 2 < 2 * 8 + 8


def test_a_ragged_batch_draws_each_prompt_length_from_its_range(sp, tmp_path):
    """--profile-batch-prompt LO-HI: the long workloads' ragged batches (8K-32K tokens), scaled down."""
    _FakeVllm.trace_dir, _FakeVllm.calls, _FakeVllm.prompts = tmp_path, [], []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        out = sp.profile_decode(srv.server_address[1], tmp_path, vocab=100, prompt_tokens=(16, 64),
                                requests=6, decode_steps=8, timeout=30)
    finally:
        srv.shutdown()
    assert sorted(_FakeVllm.prompts) == sorted(out["prompt_lens"]) and len(out["prompt_lens"]) == 6
    assert all(16 <= n <= 64 for n in out["prompt_lens"]) and len(set(out["prompt_lens"])) > 1
    assert out["prompt_tokens"] == "16-64" and out["requests"] == 6 and out["steps"] == 8
    assert sp.prompt_lengths(512, 3, None) == [512, 512, 512]


def _host_trace(path, pid=7, tid=1, stack=True, steps=3):
    """A worker's trace of `steps` decode-only steps of 1000 us each, a mixed step (context and
    decode) and, with the Python tracer: in each decode step vLLM's MLA build (200 us) around the
    plugin's build (150 us, itself around its _build_decode, 100 us) and other plugin code (50 us);
    the API server's process has Python events at the same times, which are not the worker's."""
    events = []
    for i in range(steps + 1):
        t0 = i * 2000.0
        name = "execute_context_0(0)_generation_4(4)" if i < steps else "execute_context_1(512)_generation_3(3)"
        events.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": t0, "dur": 1000.0, "pid": pid,
                       "tid": tid})
        events.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": t0, "dur": 900.0, "pid": 0,
                       "tid": 7})
        if stack:
            py = [("/tmp/site/vllm/v1/worker/gpu/model_runner.py(100): execute_model", 0, 990),
                  ("/tmp/site/vllm/model_executor/layers/attention/mla_attention.py(2546): build", 100, 200),
                  ("/work/vllm_metax/backend/builder.py(28): build", 120, 150),
                  ("/work/vllm_metax/backend/flashinfer_mla.py(172): _build_decode", 130, 100),
                  ("/work/vllm_metax/backend/plan_choice.py(50): lookup", 500, 50)]
            events += [{"ph": "X", "cat": "python_function", "name": n, "ts": t0 + a, "dur": float(d), "pid": pid,
                        "tid": tid} for n, a, d in py]
            events.append({"ph": "X", "cat": "python_function", "name": "/x/vllm_metax/backend/builder.py(28): build",
                           "ts": t0, "dur": 900.0, "pid": pid + 1, "tid": tid})      # another process
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_host_time_per_decode_step_from_the_step_annotations_and_python_functions(sp, tmp_path):
    _host_trace(tmp_path / "w.1.pt.trace.json.gz")
    h = sp.host_summary([tmp_path / "w.1.pt.trace.json.gz"])
    assert h == {"decode_steps": 3, "execute_model_us": 1000.0, "python_tracer": True,
                 "metadata_build_us": 200.0,            # vLLM's build, the plugin's nested inside it once
                 "plugin_code_us": 200.0}               # builder 150 (its _build_decode inside) + lookup 50
    _host_trace(tmp_path / "plain.pt.trace.json.gz", stack=False)
    assert sp.host_summary([tmp_path / "plain.pt.trace.json.gz"]) == {
        "decode_steps": 3, "execute_model_us": 1000.0, "python_tracer": False}
    _trace(tmp_path / "k.pt.trace.json.gz", [("gemm", 5.0)])
    assert sp.host_summary([tmp_path / "k.pt.trace.json.gz"]) == {}
    assert sp.profiler_args(tmp_path, with_stack=True)[1].count('"torch_profiler_with_stack": true') == 1
    assert '"torch_profiler_with_stack": false' in sp.profiler_args(tmp_path)[1]
    lines = sp.bound_lines({"tuned": {"per_step_us": {"attention": 300.0, "kv cache write": 10.0, "other": 690.0},
                                      "step_kernel_us": 1000.0, "attention_share": 0.3, "steps": 32,
                                      "host": sp.host_summary([tmp_path / "w.1.pt.trace.json.gz"])}})
    assert lines[1] == ("  - tuned, host per decode-only step (3 steps): execute_model 1000 us; with the Python "
                        "tracer on (inflated): attention metadata build 200 us, the plugin's code 200 us")
