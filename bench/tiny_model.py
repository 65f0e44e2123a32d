"""A DeepSeek-V2-shaped model directory made locally, with nothing downloaded: config.json, seeded
safetensors weights (MLA attention, dense MLP layers) and a tokenizer built with `tokenizers`.

    python3 bench/tiny_model.py DIR [--heads 16] [--layers 27]

Used by bench/serve_e2e.py (vLLM's engine) and bench/serve_bench.py (`vllm serve`). The attention
dims are DeepSeek-V2/V3's (kv_lora_rank 512, rope 64, nope 128, v 128), so the tuned config's model
entry for that head count applies; hidden size, MLP and vocabulary are small. The tokenizer is a
word-level one over `vocab_size` made-up words: every id decodes to one word and the text
re-encodes to the same ids, which vLLM's random dataset relies on when it sizes prompts.
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


def make_model_dir(d: Path, config: dict, seed: int = 20261203, device: str = "cpu") -> Path:
    """Write config.json, weights and tokenizer into `d` (weights kept when config.json is the
    same: a rerun reuses them)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "config.json"
    same = cfg_path.exists() and json.loads(cfg_path.read_text()) == config
    cfg_path.write_text(json.dumps(config))
    if not (same and (d / "model.safetensors").exists()):
        write_weights(d, config, seed, device)
    if not (d / "tokenizer.json").exists() or not same:
        write_tokenizer(d, config["vocab_size"])
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    make_model_dir(a.dir, model_config(a.heads, a.layers, a.vocab, a.max_positions), device=a.device)
    print(a.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
