"""bench/tiny_model.py's v3tp8: DeepSeek-V3's layers on one TP8 rank, parsed by vLLM 0.33's own
ModelConfig (the config a `vllm serve --load-format dummy` reads), its parameter count checked
against transformers' DeepseekV3 built on the meta device, the docstring's memory arithmetic."""

from __future__ import annotations

import json

import pytest

from bench_support import load_bench

tm = load_bench("tiny_model")


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    return tm.make_model_dir(tmp_path_factory.mktemp("v3tp8"), tm.v3tp8_config(), weights=False)


def test_the_folder_holds_config_and_tokenizer_only(v3_dir):
    assert not (v3_dir / "model.safetensors").exists()
    assert json.loads((v3_dir / "config.json").read_text()) == tm.V3TP8
    assert (v3_dir / "tokenizer.json").exists()
    # weights a folder had for another config go: never served in place of vLLM's dummy load
    (v3_dir / "model.safetensors").write_bytes(b"stale")
    tm.make_model_dir(v3_dir, tm.v3tp8_config(5), weights=False)
    assert not (v3_dir / "model.safetensors").exists()
    tm.make_model_dir(v3_dir, tm.v3tp8_config(), weights=False)


@pytest.mark.vllm
def test_vllms_model_config_reads_it_as_deepseek_v3_mla_on_one_tp8_rank(v3_dir):
    from vllm.config import ModelConfig

    mc = ModelConfig(model=str(v3_dir), dtype="bfloat16", max_model_len=34816)
    hf = mc.hf_config
    assert hf.model_type == "deepseek_v3" and mc.architectures == ["DeepseekV3ForCausalLM"]
    assert mc.use_mla and mc.get_head_size() == 576            # kv_lora_rank 512 + rope 64: MLA
    assert mc.get_num_attention_heads(parallel_config=_tp1()) == 16
    assert (hf.hidden_size, hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
            hf.v_head_dim) == (7168, 1536, 512, 128, 64, 128)
    assert hf.num_hidden_layers == hf.first_k_dense_replace == tm.V3TP8_LAYERS    # every layer dense
    assert hf.intermediate_size == 2304 == 9 * hf.moe_intermediate_size          # 8 routed + 1 shared
    assert mc.get_vocab_size() == 16160 and mc.max_model_len == 34816
    rope = getattr(hf, "rope_parameters", None) or hf.rope_scaling
    assert rope["rope_type"] == "yarn" and rope["factor"] == 40
    assert mc.get_num_layers(_tp1()) == tm.V3TP8_LAYERS


def _tp1():
    from vllm.config import ParallelConfig
    return ParallelConfig()


def test_the_parameter_count_is_transformers_deepseek_v3s():
    """layer_params (the docstring's bytes) against transformers' DeepseekV3 of the same config,
    built on the meta device: one layer's parameters, and the whole model's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(tm.v3tp8_config(2))
    cfg.pop("architectures")
    hf = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert layer == tm.layer_params(tm.v3tp8_config()) == 86_196_224
    total = sum(p.numel() for p in model.parameters())
    assert 2 * total == tm.v3tp8_budget(2)["weight_bytes"]


def test_the_docstring_arithmetic():
    b = tm.v3tp8_budget()
    assert round(b["layer_bytes"] / 1e6, 1) == 172.4 and round(b["weight_bytes"] / 1e9, 2) == 10.98
    assert b["kv_bytes_per_token"] == 70_272 and round(b["kv_bytes"] / 1e9, 1) == 57.3
    assert round((b["kv_bytes"] + b["weight_bytes"] + 4e9) / 1e9, 2) == 72.28
    assert b["kv_tokens"] // 1000 == 815 and b["kv_tokens"] // 34816 == 23
    assert b["kv_tokens"] > 3 * 8 * (32768 + 256)              # long@inf's most tokens at once, thrice
    # 64 full-length sequences would leave 24 layers
    full = 64 * 34816
    assert tm.v3tp8_budget(24)["kv_tokens"] >= full > tm.v3tp8_budget(25)["kv_tokens"]
    for n in ("36.64 M", "49.55 M", "172.4 MB", "463.3 MB", "10.98 GB", "70,272 B", "72.28 GB", "~57.3 GB",
              "~815K tokens", "23 sequences", "leave 24 layers"):
        assert n in tm.__doc__, n
