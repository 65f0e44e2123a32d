"""What is tuned is what is served: `mla-tune emit` over a stored sweep writes a tuned config, and
the plugin's own metadata builders (FLASHINFER_MLA with a recording kernel, TRITON_MLA), driven
through vLLM's MLA `build()` with that very file, plan for every bucket what the file says: the
FlashInfer backend value, the Triton split count, or vLLM's split rule where the bucket kept it,
and the split-KV Triton decode with the file's knobs wherever `decisions.split_serves` says so (its
on-device check is taken as passed here: the kernel itself is checked in
tests/test_split_decode_kernel.py and tests/test_gpu_split.py).

Two stored sweeps: a temporary copy of the shipped results.db (the H200 and H100 sweeps behind every
shipped config, configs/device_name=*.json: 96 buckets each; the H200's keeps vLLM's Triton rule in
28) and a
small sweep written through ResultsStore in which fa2 beats the tuner's fa3 baseline in some
buckets and Triton's tuned count beats vLLM's rule in some.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import plugin_support as ps
from mla_tune.families.base import Candidate
from mla_tune.tune.emit import emit_config
from mla_tune.problem.workload import custom_model, workload_for
from mla_tune.store.results import ResultsStore
from vllm_metax.core import choices, decisions
from vllm_metax.ops import device_backends
from vllm_metax.core import tuned_config as tc
from vllm_metax.core.device import DeviceInfo
from vllm_metax.ops import split_decode

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
LAYER = "model.layers.0.self_attn.attn"
H200 = DeviceInfo("NVIDIA H200", "torch", False, 132, (9, 0))
H100 = DeviceInfo("NVIDIA H100 80GB HBM3", "torch", False, 132, (9, 0))
# every config the project ships, with what its 16-head entry serves by the split kernel (batch,
# splits) and how many of its buckets that is: anchors against a silent change of the rule
SHIPPED = {"NVIDIA_H200": (H200, [(1, 128), (2, 64)], 12),
           "NVIDIA_H100_80GB_HBM3": (H100, [(1, 128), (2, 64)], 12)}


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("contract-model")


@pytest.fixture
def plugin(monkeypatch, tmp_path, request):
    """The plugin on a pretend H200 (or the device a test is parametrized with), FlashInfer's
    wrapper replaced by the recording kernel."""
    import vllm_metax.backend.triton_mla as tm

    device = SHIPPED[request.param][0] if hasattr(request, "param") else H200
    ps.install_recording_plugin(monkeypatch, device, tm)
    monkeypatch.setenv(tc.FOLDER_ENV, str(tmp_path / "configs"))
    tc.clear_cache()
    yield tmp_path / "configs"
    tc.clear_cache()


def _builders(model_root, heads: int, page: int):
    """The plugin's FLASHINFER_MLA and TRITON_MLA metadata builders for a model of `heads` heads,
    constructed as vLLM's model runner constructs them."""
    from vllm.config import set_current_vllm_config

    from vllm_metax.backend.flashinfer_mla import FlashInferMLABackend
    from vllm_metax.backend.triton_mla import MetaxTritonMLABackend

    vc = ps.make_vllm_config(model_root, block_size=page, num_attention_heads=heads,
                             num_key_value_heads=heads)
    vc.compilation_config.static_forward_context[LAYER] = ps.stand_in_layer()
    spec = ps.kv_cache_spec(vc)
    with set_current_vllm_config(vc):
        fi = FlashInferMLABackend.get_builder_cls()(spec, [LAYER], vc, torch.device("cpu"))
        tr = MetaxTritonMLABackend.get_builder_cls()(spec, [LAYER], vc, torch.device("cpu"))
    return fi, tr


def _step(builder, seq_lens, page):
    """One decode step through vLLM's MLA build(): the decode metadata the builder planned."""
    _, _, common, _ = ps.ragged_batch(seq_lens, page)
    return builder.build(0, common).decode


def _expected_splits(params: dict) -> int | None:
    """What the file says the Triton kernel runs: its count, or None (vLLM's rule)."""
    return None if params.get("rule") == "vllm" else params["num_kv_splits"]


def _check_every_bucket(entry: dict, fi, tr, page: int, flashinfer_expected, split_expected=None) -> dict:
    seen = {"flashinfer": [], "triton": [], "split": []}
    for b in entry["buckets"]:
        lens = [b["context_len"]] * b["batch_size"]         # the bucket as the tuner measured it
        md = _step(fi, lens, page)
        split = split_expected(b, md.cuda_graph) if split_expected else None
        if split is not None:
            from vllm_metax.ops.split_decode import SplitStep
            assert md.backend == choices.SPLIT and isinstance(md.kernel, SplitStep), b
            assert (md.kernel.kernel.num_splits, str(md.kernel.kernel.ws_acc.dtype)) == \
                (split.num_splits, f"torch.{split.partial}"), b
            pipe = split_decode.PIPES[split.pipe]
            assert (md.kernel.kernel.block_n, md.kernel.kernel.num_stages, md.kernel.kernel.pdl) == \
                (pipe.block_n, pipe.num_stages, pipe.pdl), b
            assert md.kernel.seq_lens.tolist() == lens
            seen["split"].append((b["batch_size"], b["context_len"], split.num_splits))
        else:
            want = flashinfer_expected(b["families"]["flashinfer"]["params"]["backend"])
            assert md.backend == want, b
            assert isinstance(md.kernel, ps.RecordingKernel) and md.kernel.backend == want
            assert md.kernel.plans[-1]["meta"].kv_len.tolist() == lens     # this step, planned there
            seen["flashinfer"].append(want)
        splits = _step(tr, lens, page).num_kv_splits
        assert splits == _expected_splits(b["families"]["triton"]["params"]), b
        seen["triton"].append(splits)
    return seen


# ---------------------------------------------------------------- the shipped H200 sweep

def test_every_shipped_config_is_tested_here_and_packaged():
    files = sorted(p.stem.removeprefix("device_name=") for p in (ROOT / "configs").glob("device_name=*.json"))
    assert files == sorted(SHIPPED)
    for name in files:       # the plugin ships the same files (its packaged folder)
        assert (ROOT / "vllm_metax" / "configs" / f"device_name={name}.json").read_bytes() == \
            (ROOT / "configs" / f"device_name={name}.json").read_bytes()


@pytest.mark.parametrize("plugin", sorted(SHIPPED), indirect=True)
def test_emit_of_the_shipped_sweep_is_served_bucket_for_bucket(plugin, model_root, tmp_path, monkeypatch,
                                                               request):
    from vllm_metax.ops import split_decode
    name = request.node.callspec.params["plugin"]
    device, split_anchor, split_count = SHIPPED[name]
    monkeypatch.setattr(split_decode, "self_check", lambda kernel, dtype, device: None)
    db = tmp_path / "results.db"
    shutil.copy(ROOT / "results.db", db)
    with ResultsStore(db, create=False) as store:
        path = emit_config(store, plugin, device=device.name)
    data = json.loads(path.read_text())
    # the file emit writes today is the one shipped (same choices in every bucket)
    shipped = json.loads((ROOT / "configs" / f"device_name={name}.json").read_text())
    assert [[b["families"] for b in m["buckets"]] for m in data["models"]] == \
        [[b["families"] for b in m["buckets"]] for m in shipped["models"]]
    rule_buckets, split_buckets = 0, 0
    typed = tc.read_tuned_config(path)
    for entry, typed_entry in zip(data["models"], typed.models):
        page = entry["global"]["page_size"]
        fi, tr = _builders(model_root, entry["dims"]["num_heads"], page)
        assert fi.choice.entry is not None and tr.tuned_splits.entry is not None
        by_key = {(b.batch_size, b.context_len, b.q_len): decisions.split_serves(b) for b in typed_entry.buckets}

        def graph_vote(batch):
            """A captured graph's split knobs: served in most buckets of its batch, the knobs most
            of those name, ties to the longest context's."""
            at = [(c, v) for (bb, c, q), v in by_key.items() if bb == batch and q == 1]
            served = [(c, v) for c, v in at if v is not None]
            if 2 * len(served) <= len(at):
                return None
            n = {v: sum(1 for _, w in served if w == v) for _, v in served}
            return max((t for t in served if n[t[1]] == max(n.values())), key=lambda t: t[0])[1]

        def expected_split(b, graph):
            return graph_vote(b["batch_size"]) if graph else by_key[(b["batch_size"], b["context_len"], b["q_len"])]
        # "auto" was that sweep's untuned baseline; on SM90 FlashInfer's auto is fa3, and fa3 is
        # what the plugin plans untuned
        seen = _check_every_bucket(entry, fi, tr, page,
                                   lambda v: "fa3" if v == decisions.AUTO else v,
                                   expected_split)
        split_buckets += len(seen["split"])
        from vllm_metax.ops.split_decode import SERVED_BLOCK_N, splits_for
        for batch, ctx, served_splits in seen["split"]:
            tuned = by_key[(batch, ctx, 1)]
            if tuned is not None:     # the graph's count cuts each request as its bucket's count did
                assert splits_for(ctx, SERVED_BLOCK_N, served_splits) == \
                    splits_for(ctx, SERVED_BLOCK_N, tuned.num_splits), (batch, ctx)
        if entry["dims"]["num_heads"] == 16 and split_anchor is not None:
            assert sorted({(b, n) for b, _, n in seen["split"]}) == split_anchor
        assert len(seen["triton"]) == len(entry["buckets"])
        rule_buckets += seen["triton"].count(None)
        assert any(n is not None for n in seen["triton"])
    # served with vLLM's rule, not the count frozen in the file, wherever the file says "rule"
    kept = sum(1 for m in shipped["models"] for b in m["buckets"]
               if b["families"].get("triton", {}).get("params", {}).get("rule") == "vllm")
    assert kept > 0 and rule_buckets == kept
    # the split kernel serves the 16-head buckets of batch 1 and 2 (most of their buckets: one
    # kernel per captured graph), with 128 and 64 splits (the count each of their longer contexts
    # won; a short request uses as many 64-token splits as it has, the count its bucket won)
    if split_count is not None:
        assert split_buckets == split_count


# ---------------------------------------------------------------- a sweep with mixed winners

DEVICE = H200.name
PAGE = 64
BATCHES = (1, 4, 32)
CONTEXTS = (512, 2048, 8192)


def _samples(base: float) -> list[float]:
    pattern = [1.00, 1.01, 0.99, 1.02, 0.98, 1.00, 1.03, 0.995, 1.005, 1.01, 0.99, 1.06]
    return [round(base * p, 4) for p in pattern]


def _vllm_rule(context: int) -> int:
    """vLLM 0.33's _compute_num_kv_splits without the SM cap: next_power_of_2(L // 512)."""
    n = max(1, context // 512)
    return 1 << (n - 1).bit_length()


def _mixed_sweep(path: Path, ragged: str = "uniform") -> Path:
    """fa2 beats the fa3 baseline at batch 1; 32 Triton splits beat vLLM's rule at batch <= 4
    below 8K (at 8K, batch 32 and wherever the rule gives 32, the rule stays)."""
    model = custom_model(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM)
    with ResultsStore(path) as store:
        run = store.add_run({"kind": "gpu", "device_name": DEVICE, "sm_count": 132,
                             "capability": "9.0", "flashinfer": "0.7.2.post1"})
        for b in BATCHES:
            for c in CONTEXTS:
                wl = workload_for(model, 1, b, c, ragged=ragged, seed=5)
                wid = store.workload_id(wl, 0.0, 0.0)
                fa3 = 10.0 + b * c / 2000
                rule = _vllm_rule(c)
                trials = [
                    (f"flashinfer/fa3/p{PAGE}", fa3, True),
                    (f"flashinfer/fa2/p{PAGE}", fa3 * (0.7 if b == 1 else 1.3), False),
                    (f"triton/triton/p{PAGE}/num_kv_splits={rule},rule=vllm", 3 * fa3, True),
                ]
                if rule != 32:
                    trials.append((f"triton/triton/p{PAGE}/num_kv_splits=32",
                                   3 * fa3 * (0.6 if b <= 4 and c < 8192 else 1.4), False))
                for key, t, default in trials:
                    store.add_trial(run, wid, Candidate.parse(key), "ok",
                                    {"kernel_us": _samples(t)}, is_default=default)
    return path


def test_emit_of_a_mixed_sweep_is_served_bucket_for_bucket(plugin, model_root, tmp_path):
    db = _mixed_sweep(tmp_path / "mixed.db")
    with ResultsStore(db, create=False) as store:
        path = emit_config(store, plugin)
    (entry,) = json.loads(path.read_text())["models"]
    assert len(entry["buckets"]) == 9
    fi, tr = _builders(model_root, ps.NUM_HEADS, PAGE)
    seen = _check_every_bucket(entry, fi, tr, PAGE, lambda v: v)
    # the file really says different things in different buckets, and each was served
    assert seen["flashinfer"].count("fa2") == 3 and seen["flashinfer"].count("fa3") == 6
    assert seen["triton"].count(32) == 4 and seen["triton"].count(None) == 5


def test_a_ragged_batch_finds_the_same_bucket_in_both_families(plugin, model_root, tmp_path):
    db = _mixed_sweep(tmp_path / "mixed.db")
    with ResultsStore(db, create=False) as store:
        emit_config(store, plugin)
    fi, tr = _builders(model_root, ps.NUM_HEADS, PAGE)
    # batch 4, mean 2048 (the tuner's per-request bucket context), longest 6656: both families
    # look up (4, 2048), where Triton's 32 splits won; by the longest request Triton would land
    # on (4, 8192), which kept vLLM's rule
    lens = [512, 512, 512, 6656]
    assert decisions.bucket_context(lens) == 2048
    entry = tc.load_tuned_config(DEVICE).models[0]
    bucket = entry.lookup(4, 2048).bucket
    assert (bucket.batch_size, bucket.context_len) == (4, 2048)
    assert bucket.families["triton"].params == {"backend": "triton", "num_kv_splits": 32}
    assert entry.lookup(4, 8192).bucket.families["triton"].params.get("rule") == "vllm"
    assert _step(fi, lens, PAGE).backend == bucket.families["flashinfer"].params["backend"]
    assert _step(tr, lens, PAGE).num_kv_splits == 32
    # and a uniform batch at 8K is served with vLLM's rule
    assert _step(tr, [8192] * 4, PAGE).num_kv_splits is None


def test_a_ragged_sweep_is_keyed_by_the_lookup_statistic(plugin, model_root, tmp_path):
    """Buckets measured with ragged lengths are written under the context the plugin computes
    from those very lengths, so serving the measured batch finds its own bucket."""
    db = _mixed_sweep(tmp_path / "ragged.db", ragged="uniform-random")
    with ResultsStore(db, create=False) as store:
        path = emit_config(store, plugin)
    (entry,) = json.loads(path.read_text())["models"]
    fi, tr = _builders(model_root, ps.NUM_HEADS, PAGE)
    model = custom_model(ps.NUM_HEADS, ps.KV_LORA_RANK, ps.ROPE_DIM)
    cfg_entry = tc.load_tuned_config(DEVICE).models[0]
    written = {(b["batch_size"], b["context_len"]): b for b in entry["buckets"]}
    moved = 0
    for b in BATCHES:
        for c in CONTEXTS:
            lens = workload_for(model, 1, b, c, ragged="uniform-random", seed=5).seq_lens
            key = (b, decisions.bucket_context(lens))
            assert key in written, (b, c)
            moved += key[1] != c
            found = cfg_entry.lookup(b, key[1])
            assert found.exact
            params = written[key]["families"]
            assert _step(fi, lens, PAGE).backend == params["flashinfer"]["params"]["backend"]
            assert _step(tr, lens, PAGE).num_kv_splits == _expected_splits(params["triton"]["params"])
    assert moved >= 6          # ragged means are not the nominal contexts: the keys really moved


# ---------------------------------------------------------------- the measured set

@pytest.mark.parametrize("dev", [
    H200,
    DeviceInfo("MetaX C500", "pymxsml", True, 104, (8, 0)),
    DeviceInfo("NVIDIA A100", "torch", False, 108, (8, 0)),
    DeviceInfo("NVIDIA B200", "torch", False, 148, (10, 0)),
], ids=lambda d: d.name)
def test_the_tuner_measures_what_the_plugin_may_plan_and_its_untuned_default(dev, monkeypatch):
    """On every kind of device, the FlashInfer family's space is exactly the values the plugin's
    builder may plan, and its baseline is what the plugin plans without a tuned config."""
    import flashinfer_fakes as fakes
    import vllm_metax.backend as backend_pkg
    from mla_tune.families.flashinfer import FlashInferFamily
    from vllm_metax.core import device as device_mod
    from vllm_metax.backend.plan_choice import PlanChoice
    from vllm_metax.ops import flashinfer_mla as op

    fakes.install(monkeypatch, fakes.keyword_module(op.KNOWN_BACKENDS))   # accepts every value
    monkeypatch.setattr(device_mod, "detect_device", lambda: dev)
    monkeypatch.setattr(backend_pkg, "detect_device", lambda: dev)
    wl = workload_for(custom_model(16), 1, 4, 1024)
    tuner = FlashInferFamily()
    measured = {c.backend for c in tuner.space(wl, [64])}
    served = PlanChoice(None, device_backends.device_flashinfer_backends())
    assert measured == set(served.allowed) and decisions.AUTO not in measured
    assert tuner.default_candidate(wl).backend == served.for_step(4, 1024) == served.default
    assert served.default == ("fa3" if dev is H200 else "fa2")
