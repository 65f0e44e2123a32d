"""How vLLM's Triton MLA decode kernels may be launched, as plain data (stdlib only): the one
definition that the launcher (`vllm_metax.ops.triton_launch`), the tuned-config knob domain
(`vllm_metax.core.choices.TRITON_VARIANTS`) and the profiles (`vllm_metax.core.profile`) import.

vLLM 0.33's `decode_attention_fwd` fixes its launch inside the function: 32-token tiles
(`BLOCK_N`), 2 software-pipeline stages, 4 warps, and for a 576-wide MLA key the 512 + 64 split
of the dot product into a latent and a rope tile. No caller can set them. MetaX's vendor plugin
(vLLM-metax master, `vllm_metax/v1/attention/ops/triton_decode_attention.py`) launches the same
kernels hard-coded for MACA, "due to the limit of shmem": 16-token tiles, one stage, 4 warps,
and the tile widths from the general rule (next power of two of the latent width, and of the
rope width) instead of vLLM's named 576/288 cases. For DeepSeek's 512 + 64 the general rule
gives the same two tiles; it differs for head widths that are not powers of two.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TritonLaunch:
    """One launch of vLLM's stage-1 MLA decode kernel (`_fwd_grouped_kernel_stage1`); the stage-2
    merge is always vLLM's own."""

    block_n: int            # KV tokens a tile
    num_stages: int         # Triton's software-pipeline stages
    num_warps: int
    named_head_split: bool  # vLLM's 576 -> 512 + 64 (288 -> 256 + 32) tiles; else the general rule
    # Triton compile options only the vendor's Triton build knows; passed where that build runs
    vendor_options: tuple = ()
    vendor_triton: str = ""     # the Triton version label that build carries ("+metax")


# variant name -> its launch. "vllm" (vLLM's own `decode_attention_fwd`) is not listed: it is
# vLLM's code, launched as vLLM launches it.
LAUNCHES = {
    "metax": TritonLaunch(block_n=16, num_stages=1, num_warps=4, named_head_split=False,
                          vendor_options=(("scenario", "mla"),), vendor_triton="+metax"),
}


def head_tiles(launch: TritonLaunch | None, key_width: int, value_width: int) -> tuple[int, int]:
    """(BLOCK_DMODEL, BLOCK_DPE) of an MLA launch: the latent tile and the rope tile widths."""
    if launch is None or launch.named_head_split:
        if key_width == 576:
            return 512, 64
        if key_width == 288:
            return 256, 32
    rope = key_width - value_width
    return _next_power_of_2(value_width), _next_power_of_2(rope) if rope > 0 else 0


def _next_power_of_2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()
