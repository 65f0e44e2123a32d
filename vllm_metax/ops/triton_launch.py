"""vLLM's Triton MLA decode kernels launched with a vendor's settings (`vllm_metax.core.triton_facts`):
the "metax" Triton variant that TRITON_MLA serves and the tuner's triton family measures.

vLLM fixes the stage-1 launch (tile size, pipeline stages, head tiles) inside
`_decode_grouped_att_m_fwd`, so no caller of `decode_attention_fwd` can change it. This module
launches vLLM's own `@triton.jit` kernels (`_fwd_grouped_kernel_stage1`, and the stage-2 merge
through vLLM's `_decode_softmax_reducev_fwd`, unchanged) with the launch a `TritonLaunch`
describes; nothing of the kernels is copied. The arguments are those of vLLM's
`decode_attention_fwd`, so the two are interchangeable per call. vLLM's names used here are
private to its module: a vLLM that renames them makes this variant unavailable (ImportError at
import, which the tuner records as a refusal), never wrong.
"""

from __future__ import annotations

import torch

from vllm.triton_utils import triton
import vllm.v1.attention.ops.triton_decode_attention as vllm_decode

from vllm_metax.core.triton_facts import LAUNCHES, TritonLaunch, head_tiles

_stage1 = vllm_decode._fwd_grouped_kernel_stage1
_merge = vllm_decode._decode_softmax_reducev_fwd
_page_stride = vllm_decode._page_stride


def vendor_options(launch: TritonLaunch) -> dict:
    """The launch's vendor compile options where the installed Triton is that vendor's build."""
    label = launch.vendor_triton
    return dict(launch.vendor_options) if label and label in str(triton.__version__) else {}


def decode_attention_fwd(q, k_buffer, v_buffer, o, lse, req_to_token, b_seq_len, attn_logits,
                         num_kv_splits, sm_scale, page_size=1, logit_cap=0.0, k_scale=None,
                         v_scale=None, is_mla=False, *, variant: str):
    """vLLM's `decode_attention_fwd` for grouped-query (MLA) decode, its stage 1 launched as
    `variant` (a key of `triton_facts.LAUNCHES`) launches it."""
    launch = LAUNCHES[variant]
    if num_kv_splits != attn_logits.shape[2]:
        raise ValueError(f"num_kv_splits {num_kv_splits} != attn_logits' {attn_logits.shape[2]}")
    kv_group_num = q.shape[1] // v_buffer.shape[-2]
    if kv_group_num == 1:
        raise ValueError(f"the {variant} Triton launch is for grouped-query (MLA) decode")
    one = None
    if k_scale is None or v_scale is None:
        one = torch.tensor(1.0, dtype=torch.float32, device=q.device)
    _launch_stage1(launch, q, k_buffer, v_buffer, attn_logits, req_to_token, b_seq_len,
                   num_kv_splits, sm_scale, page_size, logit_cap, one if k_scale is None else k_scale,
                   one if v_scale is None else v_scale, is_mla, kv_group_num)
    _merge(attn_logits, q, o, lse, v_buffer, b_seq_len, num_kv_splits)


def _launch_stage1(launch: TritonLaunch, q, k_buffer, v_buffer, att_out, req_to_tokens, b_seq_len,
                   num_kv_splits, sm_scale, page_size, logit_cap, k_scale, v_scale, is_mla,
                   kv_group_num):
    """vLLM's `_decode_grouped_att_m_fwd` argument for argument, with `launch`'s tile size,
    stages, warps and head tiles."""
    lk, lv = k_buffer.shape[-1], v_buffer.shape[-1]
    if is_mla:
        block_dmodel, block_dpe = head_tiles(launch, lk, lv)
    else:
        block_dmodel, block_dpe = triton.next_power_of_2(lk), 0
    block_h = 16                       # vLLM's and the vendor's: one mma M of heads a program
    batch, head_num = q.shape[0], q.shape[1]
    grid = (batch, triton.cdiv(head_num, min(block_h, kv_group_num)), num_kv_splits)
    _stage1[grid](
        q, k_buffer, v_buffer, sm_scale, req_to_tokens, b_seq_len, att_out,
        req_to_tokens.stride(0), q.stride(0), q.stride(1),
        _page_stride(k_buffer, page_size), k_buffer.stride(-3), k_buffer.stride(-2),
        _page_stride(v_buffer, page_size), v_buffer.stride(-3), v_buffer.stride(-2),
        att_out.stride(0), att_out.stride(1), att_out.stride(2), k_scale, v_scale,
        kv_group_num=kv_group_num, q_head_num=head_num, BLOCK_DMODEL=block_dmodel,
        BLOCK_DPE=block_dpe, BLOCK_DV=triton.next_power_of_2(lv), BLOCK_N=launch.block_n,
        BLOCK_H=block_h, NUM_KV_SPLITS=num_kv_splits, PAGE_SIZE=page_size, logit_cap=logit_cap,
        num_warps=launch.num_warps, num_stages=launch.num_stages, Lk=lk, Lv=lv, IS_MLA=is_mla,
        **vendor_options(launch))
