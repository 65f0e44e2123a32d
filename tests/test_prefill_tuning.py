"""The MLA prefill backend as a tuned parameter (issue #12): the tuned config's prefill section
(schema, refusals, lookup), the decision per device (`vllm_metax.core.decisions`), and the plugin's
prefill backend planning each bucket's backend with the real vllm==0.33.0 on the CPU (FlashInfer's
ragged wrapper replaced by the recording stand-in of tests/prefill_support.py, which computes
with the float64 reference from exactly the planned index pointers)."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch

import plugin_support as ps
from prefill_support import (HEADS, KV_LORA, NOPE, ROPE, V_DIM, RecordingFA3Fwd,
                             RecordingRaggedWrapper, prefill_metadata, ragged, reference, scale)
from vllm_metax.core import decisions, tuned_config as tc
from vllm_metax.core.device import DeviceInfo
from vllm_metax.core.serving import entry_for

pytestmark = pytest.mark.vllm

HOPPER = DeviceInfo("Test GPU 9000", "torch", False, 132, (9, 0))
METAX = DeviceInfo("MetaX C500", "pymxsml", True, 104, (8, 0))
DIMS = tc.ModelDims(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM, "bfloat16", "bfloat16")
DECODE = [tc.Bucket(8, 4096, 1, {"flashinfer": tc.FamilyChoice({"backend": "fa3"})}, "flashinfer")]
# what bench/results/prefill_choice_h200.md found at 16 heads: fa2 for a short query against a
# long context and for 256 new tokens over 4 requests, fa3 elsewhere
PREFILL = [
    tc.PrefillBucket(True, 256, 256, {"backend": "fa3"}, 12.6, 12.6),
    tc.PrefillBucket(True, 256, 64, {"backend": "fa2"}, 9.9, 10.8, True),
    tc.PrefillBucket(True, 2048, 2048, {"backend": "fa3"}, 58.6, 58.6),
    tc.PrefillBucket(False, 256, 1024, {"backend": "fa3"}, 22.4, 22.4),
    tc.PrefillBucket(False, 256, 16384, {"backend": "fa2"}, 133.4, 204.1, True),
    tc.PrefillBucket(False, 2048, 16384, {"backend": "fa3"}, 492.7, 492.7),
]


def _entry(prefill=PREFILL, dims=DIMS):
    return tc.ModelEntry(dims, 64, ["FLASHINFER_MLA"], list(DECODE), "deepseek-v2-lite", 1, "test",
                         list(prefill))


def _cfg(prefill=PREFILL, device=HOPPER.name):
    return tc.TunedConfig(device, {"test": True}, [_entry(prefill)])


def _write_raw(tmp_path, data, device=HOPPER.name):
    p = tmp_path / tc.config_filename(device)
    p.write_text(json.dumps(data))
    return p


# ---------------------------------------------------------------- schema

def test_prefill_section_round_trips_and_looks_up_by_kind_and_size(tmp_path):
    path = tc.write_tuned_config(_cfg(), tmp_path)
    e = entry_for(tc.read_tuned_config(path), DIMS).entry
    assert e.prefill == PREFILL
    assert json.loads(path.read_text())["models"][0]["prefill"]["buckets"][1] == {
        "causal": True, "query_tokens": 256, "kv_len": 64, "params": {"backend": "fa2"},
        "time_us": 9.9, "default_time_us": 10.8, "significant": True}
    assert e.prefill_lookup(True, 256, 64).backend == "fa2"
    assert e.prefill_lookup(True, 300, 250).backend == "fa3"          # nearest: (256, 256)
    assert e.prefill_lookup(True, 250, 50).backend == "fa2"           # nearest: (256, 64)
    assert e.prefill_lookup(False, 256, 20000).backend == "fa2"       # context chunk, long KV
    assert e.prefill_lookup(False, 256, 900).backend == "fa3"
    assert e.prefill_lookup(False, 4096, 16384).kv_len == 16384 and \
        e.prefill_lookup(False, 4096, 16384).query_tokens == 2048      # snaps past the grid's end
    only_new = tc.ModelEntry(DIMS, 64, ["FLASHINFER_MLA"], list(DECODE), prefill=PREFILL[:3])
    assert only_new.prefill_lookup(False, 256, 16384) is None         # no context bucket: untuned


def test_configs_without_a_prefill_section_stay_valid_and_are_written_as_before(tmp_path):
    path = tc.write_tuned_config(_cfg(prefill=[]), tmp_path)
    assert "prefill" not in json.loads(path.read_text())["models"][0]
    e = entry_for(tc.read_tuned_config(path), DIMS).entry
    assert e.prefill == [] and e.prefill_lookup(True, 256, 256) is None
    old = _cfg(prefill=[]).to_json()         # what the writer made before prefill was tuned
    assert "prefill" not in old["models"][0]
    assert entry_for(tc.parse_tuned_config(old), DIMS).entry.prefill == []


@pytest.mark.parametrize("mutate, message", [
    (lambda b: {**b, "params": {"backend": "auto"}}, r"params.backend must be one of fa2, fa3, vllm_fa3 .*got 'auto'"),
    (lambda b: {**b, "params": {"backend": "fa9"}}, r"params.backend must be one of fa2, fa3"),
    (lambda b: {**b, "params": {"backend": "fa2", "tile": 64}}, r"unknown prefill parameter 'tile'"),
    (lambda b: {**b, "params": "fa2"}, r"field 'params' should be dict"),
    (lambda b: {**b, "causal": "yes"}, r"field 'causal' should be bool"),
    (lambda b: {**b, "query_tokens": 0}, r"'query_tokens' must be in 1\.\."),
    (lambda b: {**b, "kv_len": 512}, r"causal \(new-token\) bucket's kv_len 512 is more than its query_tokens 256"),
    (lambda b: {k: v for k, v in b.items() if k != "kv_len"}, r"missing field 'kv_len'"),
])
def test_bad_prefill_buckets_are_refused_with_a_clear_message(tmp_path, mutate, message):
    d = _cfg().to_json()
    d["models"][0]["prefill"]["buckets"][0] = mutate(d["models"][0]["prefill"]["buckets"][0])
    with pytest.raises(tc.TunedConfigError, match=r"models\[0\]\.prefill\.buckets\[0\].*" + message):
        tc.read_tuned_config(_write_raw(tmp_path, d))


def test_a_prefill_section_that_is_not_one_is_refused(tmp_path):
    d = _cfg().to_json()
    d["models"][0]["prefill"] = ["fa2"]
    with pytest.raises(tc.TunedConfigError, match=r"models\[0\]\.prefill: should be an object"):
        tc.read_tuned_config(_write_raw(tmp_path, d))
    first = _cfg().to_json()["models"][0]["prefill"]["buckets"][0]
    d["models"][0]["prefill"] = {"buckets": [first, first]}
    with pytest.raises(tc.TunedConfigError, match="causal=True, query_tokens 256, kv_len 256 appears twice"):
        tc.read_tuned_config(_write_raw(tmp_path, d))


def test_the_writer_refuses_what_the_reader_would(tmp_path):
    bad = [tc.PrefillBucket(True, 256, 256, {"backend": "cutlass"})]
    with pytest.raises(tc.TunedConfigError, match="params.backend must be one of fa2, fa3"):
        tc.write_tuned_config(_cfg(prefill=bad), tmp_path)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- decisions

def test_prefill_backends_per_device():
    hopper = decisions.prefill_backends(False, (9, 0))
    assert hopper.allowed == ("fa3", "fa2") and hopper.default == "fa3"
    for metax_or_other in (decisions.prefill_backends(True, (9, 0)),     # MetaX: fa2 only, whatever SM
                           decisions.prefill_backends(False, (8, 0)),    # Ampere
                           decisions.prefill_backends(False, (10, 0))):  # Blackwell: fa2 (no fa3 kernel)
        assert metax_or_other.allowed == ("fa2",) and metax_or_other.default == "fa2"


def test_vllm_fa3_prefill_is_offered_on_hopper_only_where_its_library_loads():
    with_lib = decisions.prefill_backends(False, (9, 0), vllm_fa3=True)
    assert with_lib.allowed == ("fa3", "fa2", "vllm_fa3") and with_lib.default == "fa3"
    assert decisions.prefill_backends(False, (9, 0)).allowed == ("fa3", "fa2")
    for elsewhere in (decisions.prefill_backends(True, (9, 0), True),      # MetaX: no vLLM FA3
                      decisions.prefill_backends(False, (8, 0), True),
                      decisions.prefill_backends(False, (10, 0), True)):
        assert elsewhere.allowed == ("fa2",)


def test_prefill_statistic_is_total_query_tokens_and_mean_kv_per_request():
    assert decisions.prefill_statistic(256, 256, 1) == (256, 256)      # one 256-token request
    assert decisions.prefill_statistic(256, 256, 4) == (256, 64)       # 16+48+64+128
    assert decisions.prefill_statistic(512, 8192, 2) == (512, 4096)    # a context chunk of 2 requests
    assert decisions.prefill_statistic(0, 0, 0) == (1, 1)


def test_prefill_backend_choice_per_device():
    e = _entry()
    hopper = decisions.prefill_backends(False, (9, 0))
    metax = decisions.prefill_backends(True, (8, 0))
    assert decisions.prefill_backend(e, True, 256, 64, hopper) == "fa2"
    assert decisions.prefill_backend(e, True, 2048, 2048, hopper) == "fa3"
    assert decisions.prefill_backend(e, False, 256, 65536, hopper) == "fa2"
    # MetaX runs fa2 only: a tuned fa3 is never planned there, fa2 stays fa2
    assert decisions.prefill_backend(e, True, 2048, 2048, metax) == "fa2"
    assert decisions.prefill_backend(e, False, 256, 65536, metax) == "fa2"
    assert decisions.unservable_prefill(e, metax) == ["fa3"] and decisions.unservable_prefill(e, hopper) == []
    # untuned: the device default
    assert decisions.prefill_backend(None, True, 256, 64, hopper) == "fa3"
    assert decisions.prefill_backend(_entry(prefill=[]), True, 256, 64, hopper) == "fa3"


# ---------------------------------------------------------------- the plugin

@pytest.fixture
def plugin(monkeypatch, tmp_path):
    """A pretend GPU (set with the returned function), the recording ragged wrapper, no config."""
    import vllm_metax.backend as backend_pkg
    import vllm_metax.backend.flashinfer_prefill as fp
    import vllm_metax.ops.flashinfer_prefill as op
    import vllm_metax.platform as P
    from vllm_metax.core import device as device_mod

    ps.ensure_metax_platform()
    RecordingRaggedWrapper.instances, RecordingRaggedWrapper.refuse = [], set()
    monkeypatch.setattr(op, "ragged_wrapper_cls", lambda: RecordingRaggedWrapper)
    monkeypatch.setattr(fp, "_workspace", lambda device: torch.empty(16, dtype=torch.uint8))
    monkeypatch.delenv(tc.FOLDER_ENV, raising=False)
    fp._WARNED.clear()
    tc.clear_cache()

    def pretend(dev):
        for mod in (device_mod, backend_pkg, P):
            monkeypatch.setattr(mod, "detect_device", lambda: dev)
    pretend(HOPPER)
    yield pretend
    tc.clear_cache()


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    return ps.make_vllm_config(tmp_path_factory.mktemp("model"), block_size=64)


def _install(tmp_path, monkeypatch, cfg=None, raw=None, device=HOPPER.name):
    folder = tmp_path / "configs"
    folder.mkdir(exist_ok=True)
    if raw is not None:
        (folder / tc.config_filename(device)).write_text(raw)
    else:
        tc.write_tuned_config(cfg or _cfg(device=device), folder)
    monkeypatch.setenv(tc.FOLDER_ENV, str(folder))
    tc.clear_cache()


def _backend(vllm_config):
    from vllm_metax.backend.flashinfer_prefill import FlashInferMLAPrefillBackend
    return FlashInferMLAPrefillBackend(num_heads=HEADS, scale=scale(), kv_lora_rank=KV_LORA,
                                       qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                                       v_head_dim=V_DIM, vllm_config=vllm_config)


def _planned(b) -> dict:
    """index (None: the new tokens) -> (backend of the wrapper that planned, its last plan)."""
    out = {None: (b._main.wrapper.backend, b._main.wrapper.plans[-1])}
    for i, k in enumerate(b._chunks):
        out[i] = (k.wrapper.backend, k.wrapper.plans[-1])
    return out


def test_the_plugin_reads_the_decode_entry_of_the_model(plugin, vllm_config, tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch)
    from vllm_metax.backend import model_dims
    assert model_dims(vllm_config, HEADS) == DIMS        # the key the decode backend uses too
    b = _backend(vllm_config)
    assert b.entry is not None and b.entry.prefill == PREFILL


def test_each_plan_runs_its_buckets_backend(plugin, vllm_config, tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch)
    b = _backend(vllm_config)
    # new tokens: 256 over 4 requests -> (256, 64): fa2; the chunks: one request of 256 queries
    # of 8K context each -> nearest (256, 16384): fa2; of 256 each -> nearest (256, 1024): fa3
    q_lens = [16, 48, 64, 128]
    b.prepare_metadata(prefill_metadata(q_lens, "cpu", chunks=[[8192] * 4, [256] * 4]))
    planned = _planned(b)
    assert planned[None][0] == "fa2" and b.backend == "fa2" and planned[None][1]["causal"]
    assert planned[0][0] == "fa2" and not planned[0][1]["causal"]
    assert planned[1][0] == "fa3"
    # one 256-token request: (256, 256): fa3; the chunk's plan keeps its index, re-made for fa3
    b.prepare_metadata(prefill_metadata([256], "cpu", chunks=[[1000]]))
    planned = _planned(b)
    assert planned[None][0] == "fa3" and planned[0][0] == "fa3"
    assert planned[0][1]["kv"].tolist() == [0, 1000]

    # and the plans compute what they planned: the new tokens and a chunk against the reference
    q_lens, ctx = [250, 50], [9000, 7000]
    md = prefill_metadata(q_lens, "cpu", chunk_kv_lens=ctx)
    b.prepare_metadata(md)
    assert _planned(b)[None][0] == "fa3" and _planned(b)[0][0] == "fa2"   # (300, 150) / (300, 8000)
    q, k, v = ragged(q_lens, seed=1), ragged(q_lens, seed=2), ragged(q_lens, dim=V_DIM, seed=3)
    o = b.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
    assert torch.allclose(o.double(), reference(q, k, v, q_lens, q_lens, scale(), True)[0], atol=2e-2)
    kc, vc = ragged(ctx, seed=4), ragged(ctx, dim=V_DIM, seed=5)
    co, cl = b.run_prefill_context_chunk(md.chunked_context.chunks[0], q, kc, vc)
    ro, rl = reference(q, kc, vc, q_lens, ctx, scale(), False)
    assert torch.allclose(co.double(), ro, atol=2e-2) and torch.allclose(cl.double(), rl, atol=1e-4)


def test_untuned_plans_the_device_default(plugin, vllm_config, tmp_path, monkeypatch):
    b = _backend(vllm_config)                       # no config anywhere
    assert b.entry is None
    b.prepare_metadata(prefill_metadata([16, 48, 64, 128], "cpu", chunks=[[16384]]))
    assert {v[0] for v in _planned(b).values()} == {"fa3"}
    _install(tmp_path, monkeypatch, _cfg(prefill=[]))  # a config without a prefill section
    b = _backend(vllm_config)
    assert b.entry is not None and b.entry.prefill == []
    b.prepare_metadata(prefill_metadata([16, 48, 64, 128], "cpu", chunks=[[16384]]))
    assert {v[0] for v in _planned(b).values()} == {"fa3"}


def test_metax_never_plans_a_tuned_fa3(plugin, vllm_config, tmp_path, monkeypatch, caplog):
    plugin(METAX)
    _install(tmp_path, monkeypatch, _cfg(device=METAX.name), device=METAX.name)
    with caplog.at_level(logging.WARNING):
        layers = [_backend(vllm_config) for _ in range(3)]     # every layer has its own backend
    warned = [r for r in caplog.records if "does not run" in r.getMessage()]
    assert len(warned) == 1 and "fa3" in warned[0].getMessage()
    b = layers[0]
    b.prepare_metadata(prefill_metadata([2048], "cpu", chunks=[[16384], [1024]]))
    assert {v[0] for v in _planned(b).values()} == {"fa2"}
    assert {w.backend for w in RecordingRaggedWrapper.instances} == {"fa2"}   # fa3 never made


@pytest.mark.parametrize("raw", [
    "{not json",
    json.dumps({**_cfg().to_json(), "models": [{**_cfg().to_json()["models"][0],
                                                "prefill": {"buckets": [{"causal": True, "query_tokens": 256,
                                                                         "kv_len": 256, "params": {"backend": "fa4"}}]}}]}),
    json.dumps({**_cfg().to_json(), "models": [{**_cfg().to_json()["models"][0], "prefill": 7}]}),
])
def test_a_broken_prefill_section_logs_one_warning_and_plans_the_default(plugin, vllm_config, tmp_path,
                                                                         monkeypatch, caplog, raw):
    _install(tmp_path, monkeypatch, raw=raw)
    with caplog.at_level(logging.WARNING):
        layers = [_backend(vllm_config) for _ in range(2)]
    warned = [r.getMessage() for r in caplog.records if "ignored (using defaults)" in r.getMessage()]
    assert len(warned) == 1, warned
    b = layers[0]
    assert b.entry is None
    b.prepare_metadata(prefill_metadata([16, 48, 64, 128], "cpu", chunks=[[16384]]))
    assert {v[0] for v in _planned(b).values()} == {"fa3"}
    monkeypatch.setenv(tc.STRICT_ENV, "1")       # strict mode: the same file is an error
    tc.clear_cache()
    with pytest.raises(tc.TunedConfigError):
        _backend(vllm_config)


def test_a_refused_tuned_backend_falls_back_for_good(plugin, vllm_config, tmp_path, monkeypatch, caplog):
    _install(tmp_path, monkeypatch)
    RecordingRaggedWrapper.refuse = {"fa2"}
    b = _backend(vllm_config)
    with pytest.raises(Exception, match="not supported"):    # fa2 is the fallback: nothing below it
        b.prepare_metadata(prefill_metadata([16, 48, 64, 128], "cpu"))
    RecordingRaggedWrapper.refuse = {"fa3"}
    b = _backend(vllm_config)
    with caplog.at_level(logging.WARNING):
        b.prepare_metadata(prefill_metadata([256], "cpu", chunks=[[1024]]))    # both want fa3
        b.prepare_metadata(prefill_metadata([2048], "cpu"))
    assert {v[0] for v in _planned(b).values()} == {"fa2"} and b.backends.allowed == ("fa2",)
    assert sum("cannot plan here" in r.getMessage() for r in caplog.records) == 1


def test_device_index_pointers_without_host_lengths_plan_the_default(plugin, vllm_config, tmp_path,
                                                                     monkeypatch):
    from types import SimpleNamespace
    from vllm_metax.backend.flashinfer_prefill import chunk_statistic
    _install(tmp_path, monkeypatch)
    b = _backend(vllm_config)
    md = prefill_metadata([16, 48, 64, 128], "cpu")
    md.query_lens_cpu = None                 # only query_start_loc: no host statistic
    b.prepare_metadata(md)
    assert _planned(b)[None][0] == "fa3"
    # a chunk without vLLM's host fields: its host index pointers say, device ones would not
    host = SimpleNamespace(query_start_loc=torch.tensor([0, 256], dtype=torch.int32),
                           cu_seq_lens=torch.tensor([0, 16384], dtype=torch.int32))
    assert chunk_statistic(host) == (256, 16384)
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 256], device="meta"),
                           cu_seq_lens=torch.tensor([0, 16384], device="meta"))
    assert chunk_statistic(meta) is None


def test_context_chunks_plan_from_host_index_pointers(plugin, vllm_config, tmp_path, monkeypatch):
    """A prompt that continues cached context plans every chunk from vLLM's host fields: its device
    index pointers here live on the meta device, where reading them (FlashInfer's copy to the
    host, a sync on a GPU) fails."""
    _install(tmp_path, monkeypatch)
    b = _backend(vllm_config)
    q_lens, chunks = [300, 212, 7], [[3000, 5000, 64], [1000, 24, 8]]
    md = prefill_metadata(q_lens, "cpu", chunks=chunks)
    for c in md.chunked_context.chunks:
        c.query_start_loc, c.cu_seq_lens = c.query_start_loc.to("meta"), c.cu_seq_lens.to("meta")
    b.prepare_metadata(md)
    for i, kv in enumerate(chunks):
        plan = b._chunks[i].wrapper.plans[-1]
        assert plan["qo"].tolist() == [0, 300, 512, 519] and plan["kv"].tolist() == [0, *itertools.accumulate(kv)]
        assert plan["qo"].device.type == plan["kv"].device.type == "cpu" and not plan["causal"]
    # a chunk over a slice of the prefills (vLLM splits the context of several requests into
    # chunks by its workspace) takes that slice's query lengths
    md = prefill_metadata(q_lens, "cpu", chunks=[[3000]])
    c = md.chunked_context.chunks[0]
    c.request_slice, c.query_start_loc = slice(1, 2), torch.tensor([0, 212], dtype=torch.int32)
    b.prepare_metadata(md)
    assert b._chunks[0].wrapper.plans[-1]["qo"].tolist() == [0, 212]
    # without vLLM's host lengths the device pointers are planned (FlashInfer copies them)
    md = prefill_metadata(q_lens, "cpu", chunks=[[3000, 5000, 64]])
    del md.chunked_context.chunks[0].seq_lens
    b.prepare_metadata(md)
    assert b._chunks[0].wrapper.plans[-1]["kv"].tolist() == [0, 3000, 8000, 8064]


def test_plans_that_switch_backends_reuse_their_wrappers(plugin, vllm_config, tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch)
    b = _backend(vllm_config)
    for _ in range(3):        # fa2, then fa3, then fa2 again, step after step
        b.prepare_metadata(prefill_metadata([16, 48, 64, 128], "cpu", chunks=[[16384] * 4]))
        assert _planned(b)[None][0] == "fa2"
        b.prepare_metadata(prefill_metadata([256], "cpu", chunks=[[1024]]))
        assert _planned(b)[None][0] == "fa3" and _planned(b)[0][0] == "fa3"
    # one wrapper per (plan slot, backend): new tokens fa2/fa3, chunk 0 fa2/fa3
    assert sorted(w.backend for w in RecordingRaggedWrapper.instances) == ["fa2", "fa2", "fa3", "fa3"]


# ---------------------------------------------------------------- vLLM's FA3 prefill (vllm_fa3)

FA3_PREFILL = PREFILL + [tc.PrefillBucket(True, 8192, 8192, {"backend": "vllm_fa3"}, 3000.0, 3600.0,
                                          True),
                         tc.PrefillBucket(False, 2048, 65536, {"backend": "vllm_fa3"}, 14000.0,
                                          16000.0, True)]


@pytest.fixture
def fa3_here(monkeypatch):
    """vLLM's FA3 library 'loads' here; its forward op is the recording stand-in."""
    import vllm_metax.backend.flashinfer_prefill as fp
    import vllm_metax.ops.fa3_mla as fa3_mla
    from vllm_metax.ops.fa3_prefill import FA3PrefillKernel
    fwd = RecordingFA3Fwd()
    monkeypatch.setattr(fa3_mla, "fa3_available", lambda *a, **k: (True, ""))
    monkeypatch.setattr(fp, "FA3PrefillKernel", lambda device: FA3PrefillKernel(device, fwd=fwd))
    return fwd


def test_a_vllm_fa3_bucket_plans_vllms_fa3_from_vllms_device_pointers(plugin, fa3_here, vllm_config,
                                                                    tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, _cfg(prefill=FA3_PREFILL))
    b = _backend(vllm_config)
    assert "vllm_fa3" in b.backends.allowed and "vllm_fa3 in 2" in b.describe()
    # new tokens: 8192 in one request -> (8192, 8192): vllm_fa3; a chunk of 2048 queries against
    # 60K context -> nearest (2048, 65536): vllm_fa3; a chunk against 1K -> (256, 1024): fa3
    md = prefill_metadata([8192], "cpu", chunks=[[60000], [1000]])
    b.prepare_metadata(md)
    assert b.backend == "vllm_fa3" and b._main.backend == "vllm_fa3"
    assert b._chunks[0].backend == "vllm_fa3" and b._chunks[1].wrapper.backend == "fa3"
    planned = b._main.planned
    assert planned["cu_q"] is md.query_start_loc and planned["max_q"] == 8192 and planned["causal"]
    chunk = b._chunks[0].planned
    assert chunk["cu_kv"] is md.chunked_context.chunks[0].cu_seq_lens and chunk["max_kv"] == 60000

    # and what it computes: new tokens with the LSE and a chunk, in vLLM's form, against the reference
    q_lens, ctx = [300, 212], [3000, 5000]
    _install(tmp_path, monkeypatch, _cfg(prefill=[tc.PrefillBucket(True, 512, 256, {"backend": "vllm_fa3"}),
                                                  tc.PrefillBucket(False, 512, 4000, {"backend": "vllm_fa3"})]))
    b = _backend(vllm_config)
    md = prefill_metadata(q_lens, "cpu", chunk_kv_lens=ctx)
    b.prepare_metadata(md)
    assert b.backend == "vllm_fa3" and b._chunks[0].backend == "vllm_fa3"
    q, k, v = ragged(q_lens, seed=1), ragged(q_lens, seed=2), ragged(q_lens, dim=V_DIM, seed=3)
    o, lse = b.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
    ro, rl = reference(q, k, v, q_lens, q_lens, scale(), True)
    assert torch.allclose(o.double(), ro, atol=2e-2) and lse.shape == (HEADS, sum(q_lens))
    assert torch.allclose(lse.double(), rl, atol=1e-4)
    kc, vc = ragged(ctx, seed=4), ragged(ctx, dim=V_DIM, seed=5)
    co, cl = b.run_prefill_context_chunk(md.chunked_context.chunks[0], q, kc, vc)
    rco, rcl = reference(q, kc, vc, q_lens, ctx, scale(), False)
    assert torch.allclose(co.double(), rco, atol=2e-2) and torch.allclose(cl.double(), rcl, atol=1e-4)
    assert fa3_here.calls[-1]["max_k"] == 5000 and not fa3_here.calls[-1]["causal"]


def test_a_vllm_fa3_bucket_without_the_library_warns_once_and_plans_the_default(plugin, vllm_config,
                                                                              tmp_path, monkeypatch,
                                                                              caplog):
    import vllm_metax.ops.fa3_mla as fa3_mla
    monkeypatch.setattr(fa3_mla, "fa3_available", lambda *a, **k: (False, "not installed"))
    _install(tmp_path, monkeypatch, _cfg(prefill=FA3_PREFILL))
    with caplog.at_level(logging.WARNING):
        layers = [_backend(vllm_config) for _ in range(3)]
    warned = [r.getMessage() for r in caplog.records if "does not run" in r.getMessage()]
    assert len(warned) == 1 and "vllm_fa3" in warned[0]
    b = layers[0]
    b.prepare_metadata(prefill_metadata([8192], "cpu", chunks=[[60000]]))
    assert {v[0] for v in _planned(b).values()} == {"fa3"}


def test_without_spans_or_in_another_dtype_plans_flashinfer_not_fa3(plugin, fa3_here, vllm_config,
                                                                    tmp_path, monkeypatch):
    _install(tmp_path, monkeypatch, _cfg(prefill=FA3_PREFILL))
    b = _backend(vllm_config)
    md = prefill_metadata([8192], "cpu")
    del md.max_query_len                              # FA3 needs the longest span from the host
    b.prepare_metadata(md)
    assert b.backend == "fa3" and fa3_here.calls == []
    md = prefill_metadata([8192], "cpu", dtype=torch.float32)    # FA3 runs bf16/fp16 only
    b.prepare_metadata(md)
    assert b.backend == "fa3"
    b.prepare_metadata(prefill_metadata([8192], "cpu"))
    assert b.backend == "vllm_fa3"


def test_a_recording_server_counts_each_plans_lookup_key(plugin, vllm_config, tmp_path, monkeypatch):
    """VLLM_METAX_TRAFFIC: every plan's key (kind, query tokens, KV per request) is counted, the
    key its bucket is looked up by (`decisions.prefill_statistic`)."""
    from vllm_metax.core import traffic as rec
    monkeypatch.setattr(rec, "_RECORDERS", {})
    monkeypatch.setenv(rec.TRAFFIC_ENV, str(tmp_path / "t.db"))
    b = _backend(vllm_config)
    try:
        b.prepare_metadata(prefill_metadata([16, 48, 64, 128], "cpu", chunks=[[8192] * 4]))
        assert b.traffic.prefill_counts == {
            (True, rec.fine_bin(256), rec.fine_bin(64)): 1,          # 256 new tokens over 4 requests
            (False, rec.fine_bin(256), rec.fine_bin(8192)): 1}       # the chunk: 8K context each
    finally:
        b.traffic.close()
