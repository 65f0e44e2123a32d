"""A DeepSeek-V2-shaped model directory made locally, with nothing downloaded: config.json, seeded
safetensors weights (MLA attention, dense MLP layers) and a tokenizer built with `tokenizers`.

    python3 bench/tiny_model.py DIR [--heads 16] [--layers 27]
    python3 bench/tiny_model.py DIR --v3tp8        # config.json + tokenizer only (see V3TP8)

Used by bench/serve_e2e.py (vLLM's engine) and bench/serve_bench.py (`vllm serve`). The attention
dims are DeepSeek-V2/V3's (kv_lora_rank 512, rope 64, nope 128, v 128), so the tuned config's model
entry for that head count applies; hidden size, MLP and vocabulary are small. The tokenizer is a
word-level one over `vocab_size` made-up words: every id decodes to one word and the text
re-encodes to the same ids, which vLLM's random dataset relies on when it sizes prompts.

V3TP8 (`v3tp8_config`) is a different model: every layer has DeepSeek-V3's shapes on one rank of
tensor parallelism 8, the way `vllm serve --tensor-parallel-size 8` cuts it (vLLM's default TP
sharding, no expert parallelism): hidden 7168, q_lora_rank 1536 and kv_lora_rank 512 (replicated),
16 of the 128 heads (nope 128, rope 64, v 128), V3's YaRN rope (factor 40 over 4096 positions),
and the vocabulary's eighth (129280 / 8 = 16160 rows of the vocab-parallel embedding and LM head).
Its weights are not written: vLLM draws them at load (`--load-format dummy`), so the folder holds
config.json and the tokenizer only (nothing to carry to the GPU machine).

Dense layers, not MoE. On one TP8 rank V3's MoE layer is 256 routed experts of intermediate
2048 / 8 = 256, top-8 (grouped: 8 groups, top 4), plus one shared expert of 256: a token's MLP is
(8 + 1) x 256 = 2304 wide, which is exactly V3's dense-layer width at TP8 (18432 / 8). vLLM 0.33
cannot run its fused MoE on this project's platform: for an out-of-tree platform
`select_unquantized_moe_backend` returns `UnquantizedMoeBackend.OOT`, whose
`process_weights_after_loading` builds no kernel ("OOT handles internally"), and `forward_oot`
falls to `forward_native`, which asserts that kernel exists (fused_moe/unquantized_fused_moe_method.py,
oracle/unquantized.py). So every layer is V3's dense layer at TP8 (intermediate 2304): the same
FLOPs per token as its MoE layers. Decode reads fewer bytes than the MoE would: at a decode batch of
B tokens a TP8 rank's MoE layer reads the experts the batch routes to (about 256 (1 - (1 - 8/256)^B)
of 256: 8 at B=1, 57 at B=8, 163 at B=32, 222 at B=64; 2.83 GB for all 256) where the dense layer
reads 99 MB. Attention's share of a decode step is therefore an upper bound of a real V3 TP8
rank's beyond batch 1 (and the model has no all-reduce, which TP8 adds twice a layer).

Layers: V3's 61, which fit an 80 GB H100 at serve_bench's --gpu-memory-utilization 0.85 with room
to spare (`v3tp8_budget` computes these; bf16):
  per layer: attention 36.64 M parameters (fused q_a+kv_a 7168 x 2112, q_b 1536 x 3072,
  kv_b 512 x 4096, o 2048 x 7168, two norms) + MLP 49.55 M (3 x 7168 x 2304) + 2 norms of 7168
  = 86.20 M = 172.4 MB; embedding + LM head 2 x 16160 x 7168 parameters = 463.3 MB;
  61 layers: 10.98 GB.
  KV cache: 576 x 2 B = 1152 B per token per layer, 70,272 B per token at 61 layers.
  budget: 0.85 x 79.19 GiB (an H100 80GB's total as vLLM logs it; check the server log)
  = 72.28 GB; less the weights and ~4 GB for activations and CUDA-graph pools leaves ~57.3 GB of
  KV cache: ~815K tokens, 23 sequences of MAX_MODEL_LEN 34,816, three times the most the
  benchmark holds at once (long@inf: 8 x (32,768 + 256) = 264,192 tokens). Room for 64
  full-length sequences (2.23 M tokens, 2.57 GB per layer) would leave 24 layers; 64 sequences
  of the workloads' sizes fit in 61 layers.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

BASE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 256,
    "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 2048, "max_position_embeddings": 4096,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 3, "torch_dtype": "bfloat16", "rope_theta": 10000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
}
# ids 0, 1, 2: bos, eos, unk; bos and eos are DeepSeek-V2/V3's own. Their length matters: vLLM refuses
# a text prompt longer than max_model_len x the longest vocabulary entry in characters
# (renderers/params.py, `_text_len_check`), and with "<s>" the longest entry was a 5-character word
# while each word costs 6 characters with its space: prompts over ~29K of 34,816 tokens were refused.
SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<unk>")


# DeepSeek-V3 on one rank of TP8, dense layers of its MoE layers' FLOPs (module docstring)
V3TP8_LAYERS = 61
V3TP8 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432 // 8,
    "num_hidden_layers": V3TP8_LAYERS, "first_k_dense_replace": V3TP8_LAYERS,
    "num_attention_heads": 128 // 8, "num_key_value_heads": 128 // 8,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 129280 // 8, "max_position_embeddings": 163840,
    # V3's MoE on one TP8 rank, for the record: unused while first_k_dense_replace covers every layer
    "n_routed_experts": 256, "moe_intermediate_size": 2048 // 8, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}


def v3tp8_config(layers: int = V3TP8_LAYERS) -> dict:
    """V3TP8 with `layers` dense layers."""
    return {**V3TP8, "num_hidden_layers": layers, "first_k_dense_replace": layers}


def layer_params(c: dict) -> int:
    """Parameters of one dense MLA layer of config `c` (q_lora_rank set or None)."""
    h, heads, nope, rope, v, kvl = (c["hidden_size"], c["num_attention_heads"], c["qk_nope_head_dim"],
                                    c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"])
    q = (h * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * (nope + rope)
         if c.get("q_lora_rank") else h * heads * (nope + rope))
    attn = q + h * (kvl + rope) + kvl + kvl * heads * (nope + v) + heads * v * h
    return attn + 3 * h * c["intermediate_size"] + 2 * h


def v3tp8_budget(layers: int = V3TP8_LAYERS, total_bytes: float = 79.19 * 2**30,
                 utilization: float = 0.85, reserve_bytes: float = 4e9) -> dict:
    """The docstring's arithmetic: weight and KV-cache bytes of V3TP8 at `layers` layers on a GPU
    of `total_bytes`, with `reserve_bytes` for activations and CUDA-graph pools."""
    c = v3tp8_config(layers)
    weights = 2 * (layers * layer_params(c) + 2 * c["vocab_size"] * c["hidden_size"] + c["hidden_size"])
    kv_per_token = layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    kv = utilization * total_bytes - weights - reserve_bytes
    return {"layer_bytes": 2 * layer_params(c), "weight_bytes": weights, "kv_bytes_per_token": kv_per_token,
            "kv_bytes": kv, "kv_tokens": int(kv // kv_per_token)}


def model_config(heads: int = 16, layers: int = 3, vocab_size: int = 2048,
                 max_positions: int = 4096) -> dict:
    """BASE_CONFIG with these heads, layers (all dense: first_k_dense_replace = layers), vocabulary
    and context length."""
    return {**BASE_CONFIG, "num_attention_heads": heads, "num_key_value_heads": heads,
            "num_hidden_layers": layers, "first_k_dense_replace": layers,
            "vocab_size": vocab_size, "max_position_embeddings": max_positions}


def write_weights(d: Path, c: dict, seed: int = 20261203, device: str = "cpu") -> None:
    """Seeded bf16 weights, scaled so activations stay O(1) and greedy choices have margins well
    above bf16 noise. `device="cuda"` draws them on the GPU (large models in seconds); the numbers
    then differ from a CPU draw of the same seed."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator(device).manual_seed(seed)
    h, heads, nope, rope, v = (c["hidden_size"], c["num_attention_heads"], c["qk_nope_head_dim"],
                               c["qk_rope_head_dim"], c["v_head_dim"])
    kvl, inter, vocab = c["kv_lora_rank"], c["intermediate_size"], c["vocab_size"]

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    def lin(out_f, in_f, gain=1.0):
        return (randn(out_f, in_f) * gain / math.sqrt(in_f)).to(torch.bfloat16)

    def norm(n):
        return (1.0 + 0.1 * randn(n)).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": randn(vocab, h).to(torch.bfloat16),
         "model.norm.weight": norm(h), "lm_head.weight": lin(vocab, h, gain=4.0)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": lin(heads * (nope + rope), h, gain=2.0),
            p + "self_attn.kv_a_proj_with_mqa.weight": lin(kvl + rope, h, gain=2.0),
            p + "self_attn.kv_a_layernorm.weight": norm(kvl),
            p + "self_attn.kv_b_proj.weight": lin(heads * (nope + v), kvl, gain=2.0),
            p + "self_attn.o_proj.weight": lin(h, heads * v),
            p + "mlp.gate_proj.weight": lin(inter, h), p + "mlp.up_proj.weight": lin(inter, h),
            p + "mlp.down_proj.weight": lin(h, inter),
        })
    save_file({k: t.cpu().contiguous() for k, t in w.items()}, str(d / "model.safetensors"))


def write_tokenizer(d: Path, vocab_size: int) -> None:
    """A word-level fast tokenizer: ids 0-2 are SPECIAL_TOKENS; id i >= 3 is the word `w<i>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)    # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1],
                                   unk_token="<unk>", model_max_length=1 << 20)
    fast.save_pretrained(str(d))


def make_model_dir(d: Path, config: dict, seed: int = 20261203, device: str = "cpu",
                   weights: bool = True) -> Path:
    """Write config.json, weights and tokenizer into `d` (weights kept when config.json is the
    same: a rerun reuses them). `weights=False`: no weights, for vLLM's `--load-format dummy`
    (weights a folder had for another config are removed, so they are never served by mistake)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "config.json"
    same = cfg_path.exists() and json.loads(cfg_path.read_text()) == config
    cfg_path.write_text(json.dumps(config))
    if not weights:
        if not same:
            (d / "model.safetensors").unlink(missing_ok=True)
    elif not (same and (d / "model.safetensors").exists()):
        write_weights(d, config, seed, device)
    if not (d / "tokenizer.json").exists() or not same:
        write_tokenizer(d, config["vocab_size"])
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None, help="default 3 (61 with --v3tp8)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--v3tp8", action="store_true",
                    help="DeepSeek-V3 on one TP8 rank (--layers, default 61), no weights: serve with --load-format dummy")
    a = ap.parse_args(argv)
    if a.v3tp8:
        make_model_dir(a.dir, v3tp8_config(a.layers or V3TP8_LAYERS), weights=False)
    else:
        make_model_dir(a.dir, model_config(a.heads, a.layers or 3, a.vocab, a.max_positions), device=a.device)
    print(a.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
