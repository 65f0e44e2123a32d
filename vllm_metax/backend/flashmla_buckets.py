"""FlashMLA in the decode buckets of FLASHINFER_MLA that a tuned config gives it
(`decisions.flashmla_serves`): the part of FLASHINFER_MLA's metadata builder that runs them.

Its ops (`vllm_metax.ops.flashmla.FlashMLADecode`: one for eager steps, one shared by every
captured CUDA graph) are made with the builder, before vLLM captures any graph. A step of such a
bucket runs `FlashMLAStep` on the builder's own paged cache: the step marks the op's schedule
stale, its first layer computes FlashMLA's tile schedule from the step's sequence lengths and
every later layer reuses it, as the FLASHMLA backend does (inside a captured graph the schedule
is recomputed by the replay itself). Where FlashMLA cannot run here (no library, a KV block size
other than 64, dims or dtypes it does not take), one warning turns it off for the process: those
buckets run the next kernel that serves them (`decisions.side_kernel`: vLLM's FA3, else
FlashInfer).
"""

from __future__ import annotations

import torch

from vllm_metax.backend.plan_choice import PlanChoice
from vllm_metax.core import choices
from vllm_metax.ops import flashmla as flashmla_op


class FlashMLABuckets:
    """FlashMLA's ops for the builder's FlashMLA buckets, and a step for each of them."""

    def __init__(self, choice: PlanChoice, device: torch.device, sm_scale: float, num_heads: int,
                 kv_lora_rank: int, rope_dim: int, page_size: int, q_dtype: torch.dtype,
                 kv_dtype: torch.dtype, full_cudagraph: bool):
        self.choice = choice
        self._ops: dict[bool, flashmla_op.FlashMLADecode] = {}     # graph? -> op
        if not choice.serves_flashmla():
            return
        why = None
        try:
            ok, why = flashmla_op.flashmla_available(device)
            why = why if not ok else flashmla_op.check_shapes(num_heads, kv_lora_rank, rope_dim,
                                                              page_size, q_dtype, kv_dtype)
            if why is None:
                for graph in (False, True) if full_cudagraph else (False,):
                    # causal as vLLM's FlashMLA passes it: a no-op at q_len 1, the draft rows' mask above
                    self._ops[graph] = flashmla_op.FlashMLADecode(sm_scale, causal=True)
        except Exception as e:  # noqa: BLE001 - a config this device cannot run must not crash vLLM
            why = f"{type(e).__name__}: {e}"
        if why:
            self._ops.clear()
            choice.turn_off(choices.FLASHMLA, why)

    def op(self, graph: bool) -> flashmla_op.FlashMLADecode | None:
        """The op eager steps (`graph` False) or captured graphs run; None where FlashMLA is off."""
        return self._ops.get(graph) if self.choice.flashmla_enabled else None

    def step(self, graph: bool, block_table: torch.Tensor, seq_lens: torch.Tensor,
             q_len: int) -> flashmla_op.FlashMLAStep | None:
        """FlashMLA's step on these rows (the builder asks `PlanChoice.kernel` whether FlashMLA
        serves it); None where FlashMLA is off here."""
        kernel = self.op(graph)
        if kernel is None:
            return None
        return flashmla_op.FlashMLAStep(kernel, block_table, seq_lens, q_len)
