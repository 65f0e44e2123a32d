"""The fast re-plan of FlashInfer 0.7's fa2/fa3 MLA decode: the part that reads private attributes.

Every decode step re-plans. FlashInfer's public `plan()` spends most of its ~0.5 ms validating in
Python; when a step's plan arguments other than the metadata equal the last public plan's,
`MLADecodeKernel` (vllm_metax/ops/flashinfer_mla.py) calls `replan` here instead: FlashInfer's
compiled MLAPlan (or the numpy schedule of `vllm_metax.ops.mla_schedule`), the staging upload and
the kv_indices hand-over, as vLLM's `fast_plan_decode` does for FlashInfer's decode wrapper.

Everything here depends on FlashInfer internals (`INTERNALS`); it is used only where the planned
backend object has all of them, and any surprise switches it off for that kernel. One switch
turns it off everywhere: `VLLM_METAX_FAST_REPLAN=0` in the environment (read once, at import) or
`MLADecodeKernel(fast_replan=False)`; every plan then goes through FlashInfer's public `plan()`
(and a tuned `kv_chunk` is not applied: only the numpy schedule can cut KV chunks).

Who makes the schedule, per fast re-plan (`SCHEDULES` counts them):

* "numpy": from batch `SCHEDULE_MIN_BATCH` on, MLAPlan's work items with better balanced
  clusters (`mla_schedule`), once the buffer layout has been learnt from a native plan whose
  schedule the numpy one matched (`_learn_layout`);
* "chunked": a tuned `kv_chunk` (any batch size): the numpy schedule with that KV chunk limit;
* "mlaplan": FlashInfer's C++ MLAPlan (small batches, unlearnt layouts, batches the numpy
  schedule cannot hold).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from vllm_metax.core.choices import FLASHINFER, SPECS
from vllm_metax.core.log import get_logger
from vllm_metax.ops import mla_schedule as ms
from vllm_metax.ops.paged_metadata import PagedMetadata

logger = get_logger(__name__)

ENABLED = os.environ.get("VLLM_METAX_FAST_REPLAN", "1").strip() not in ("0", "false", "no", "off")

# What the fast re-plan reads or writes on FlashInfer 0.7's planned fa2/fa3 backend object.
INTERNALS = ("_cached_module", "_float_workspace_buffer", "_int_workspace_buffer",
             "_pin_memory_int_workspace_buffer", "_use_cuda_graph", "_kv_indices_buf",
             "_plan_info", "device")
# the backends whose schedule the plugin computes (and that take kv_chunk): the FlashInfer spec's
BACKENDS = SPECS[FLASHINFER].chunked_backends

# The numpy schedule from this batch size on (without a tuned kv_chunk). Measured on the H200
# (bench/results/plan_floor_h200.txt): its cluster balance makes the decode
# kernel 16-30% faster on ragged batches of 32-128 requests (e.g. 223 -> 158 us at 16 heads,
# B128), and a decode step that reuses the previous schedule costs ~35 us on the host against
# MLAPlan's 66-122 us at B = 32-256. Below 16 requests both balance alike (about one chunk per
# cluster) and MLAPlan is cheaper than a fresh numpy schedule.
SCHEDULE_MIN_BATCH = 16
# layout key -> (ScheduleLayout, FlashInfer's own plan-info object) once learnt; None where the
# numpy schedule disagreed with MLAPlan (that key then always plans natively)
_LAYOUTS: dict = {}
SCHEDULES = {"numpy": 0, "chunked": 0, "mlaplan": 0}   # fast re-plans by who made the schedule


def capable(wrapper) -> bool:
    """Whether `wrapper` (a planned BatchMLAPagedAttentionWrapper) is one the fast re-plan
    understands: FlashInfer 0.7's planned fa2/fa3 backend object with every internal it uses."""
    be = getattr(wrapper, "_planned_backend", None)
    return getattr(be, "_backend", None) in BACKENDS and all(hasattr(be, n) for n in INTERNALS)


def usable(meta: PagedMetadata, num_heads: int, causal: bool, device) -> bool:
    """Whether the checks FlashInfer's plan() makes provably pass for this batch, so they may be
    skipped: the native work-item capacity cannot be reached, and a causal plan has a head count
    dividing the 64-row query tile (FlashInfer's partial-tile check cannot fire)."""
    batch = meta.kv_len.shape[0]
    if batch == 0 or (causal and 64 % num_heads):
        return False
    # MLAPlan makes sum_r ceil(len_r / L) work items with L >= total / clusters: at most one per
    # query tile plus one per cluster (<= one per SM); tiles counted at the smallest (64)
    tiles = batch * -(-meta.q_len * num_heads // 64)
    return tiles + sm_count(device) <= ms.MAX_WORK_ITEMS


def replan(wrapper, meta: PagedMetadata, num_heads: int, head_dim_ckv: int, causal: bool,
           kv_chunk: float | None = None) -> str | None:
    """Re-plan `wrapper` (planned publicly with the same arguments but the metadata) for `meta`.

    run() reads the plan info, the int workspace (which the schedule fills, indptr and lengths
    included) and kv_indices, so those are all that change; the wrapper's host-side indptr/len
    mirrors keep the last public plan's values. Returns who made the schedule ("numpy",
    "chunked", "mlaplan"), or None when this batch must go through the public plan() (outside
    `usable`, or a graph buffer too small). Raises when the internals are not as expected.
    """
    be = wrapper._planned_backend
    if not usable(meta, num_heads, causal, be.device):
        return None
    if be._use_cuda_graph:
        kvi = be._kv_indices_buf
        n = meta.kv_indices.shape[0]
        if kvi is None or kvi.shape[0] < n:
            return None
    plan_info, staged, made_by = plan_schedule(be, meta, num_heads, head_dim_ckv, causal, kv_chunk)
    if be._use_cuda_graph:
        if meta.kv_indices.data_ptr() != kvi.data_ptr():
            kvi[:n].copy_(meta.kv_indices, non_blocking=True)
    else:
        kvi = meta.kv_indices
        be._kv_indices_buf = kvi if kvi.device == be.device else kvi.to(be.device, non_blocking=True)
    be._plan_info = plan_info
    be._staged_int_workspace_bytes = staged
    wrapper._plan_info = plan_info
    SCHEDULES[made_by] += 1
    return made_by


def plan_schedule(be, meta: PagedMetadata, num_heads: int, head_dim_ckv: int, causal: bool,
                  kv_chunk: float | None = None):
    """FlashInfer's fa2/fa3 plan for planned backend `be`: (plan info, staged bytes, made by).

    The schedule (which cluster runs which KV chunk of which request) goes into a page-locked
    buffer, which must then reach the device int workspace. FlashInfer 0.7's module proxy copies
    it (~600 KB, fixed by the 16384-work-item layout) into a freshly allocated pinned tensor before
    the async upload, so the next plan cannot overwrite it in flight. Here it is written into the
    next buffer of a ring instead, uploaded straight from there; an event per buffer guards its
    reuse: no allocation and no host copy. The numpy schedule needs the buffer layout of a native
    plan of the same cluster shape, learnt the first time (`_learn_layout`); a tuned `kv_chunk`
    is applied from then on, the learning step included. Other module shapes go through the
    module's own entry point.
    """
    args = (be._float_workspace_buffer, be._int_workspace_buffer, be._pin_memory_int_workspace_buffer,
            meta.qo_indptr, meta.kv_indptr, meta.kv_len, num_heads, head_dim_ckv, causal)
    mod = be._cached_module
    if not hasattr(mod, "plan_with_staged_workspace_bytes"):
        return mod.plan(*args), 0, "mlaplan"
    native = getattr(getattr(mod, "_module", None), "plan", None)
    device_ws = be._int_workspace_buffer
    if native is None or device_ws.device.type != "cuda":
        return (*mod.plan_with_staged_workspace_bytes(*args), "mlaplan")
    ring = _staging_ring(device_ws)
    host = ring.acquire()
    planned = _numpy_plan(be, meta, num_heads, head_dim_ckv, causal, ring, kv_chunk)
    if planned is None:
        ring.holds[ring.next] = None
        plan_info, staged = native(*args[:2], host, *args[3:])
        staged = int(staged)
        if not 0 <= staged <= host.numel():
            raise RuntimeError(f"MLAPlan staged {staged} bytes into a {host.numel()}-byte buffer")
        made_by = "mlaplan"
        if _learn_layout(be, meta, num_heads, head_dim_ckv, causal, plan_info, staged,
                         ring.views[ring.next]) and kv_chunk is not None:
            planned = _numpy_plan(be, meta, num_heads, head_dim_ckv, causal, ring, kv_chunk)
    if planned is not None:
        plan_info, staged, made_by = planned
    ring.upload(device_ws, staged)
    return plan_info, staged, made_by


def _layout_key(be, head_dim_ckv: int, q_len: int, num_heads: int) -> tuple:
    return (str(be.device), getattr(be, "_backend", None), be._float_workspace_buffer.nbytes,
            be._int_workspace_buffer.nbytes, head_dim_ckv, ms.cluster_size(q_len * num_heads))


def _numpy_plan(be, meta: PagedMetadata, num_heads: int, head_dim_ckv: int, causal: bool, ring,
                kv_chunk: float | None = None):
    """(plan info, staged bytes, made by) with the schedule computed here and written into the
    ring's acquired staging buffer, or None: plan natively. A tuned `kv_chunk` the batch cannot
    take (its schedule would not fit the buffers) gives the untuned schedule."""
    if kv_chunk is None and meta.kv_len.shape[0] < SCHEDULE_MIN_BATCH:
        return None
    learnt = _LAYOUTS.get(_layout_key(be, head_dim_ckv, meta.q_len, num_heads))
    if learnt is None:
        return None
    layout, plan_info = learnt
    lens = (meta.qo_indptr.numpy(), meta.kv_indptr.numpy(), meta.kv_len.numpy())
    sched, made_by = None, "numpy"
    if kv_chunk is not None:
        sched = ms.mla_schedule(*lens, num_heads, causal, layout.num_sm, q_len=meta.q_len,
                                kv_chunk=kv_chunk)
        made_by = "chunked"
    if sched is None:
        if meta.kv_len.shape[0] < SCHEDULE_MIN_BATCH:
            return None
        sched = ms.mla_schedule(*lens, num_heads, causal, layout.num_sm, q_len=meta.q_len)
        made_by = "numpy"
    if sched is None:
        return None
    i = ring.next
    layout.write(sched, ring.views[i], holds=ring.holds[i])
    ring.holds[i] = sched.structure
    return plan_info, layout.staged_bytes, made_by


def _learn_layout(be, meta, num_heads, head_dim_ckv, causal, plan_info, staged, host) -> bool:
    """After a native MLAPlan: the first time for this layout key, check that the numpy schedule
    for the same batch gives the kernel exactly the work MLAPlan gave it, and keep the layout.
    Returns whether the layout is known (now or before)."""
    key = _layout_key(be, head_dim_ckv, meta.q_len, num_heads)
    if key in _LAYOUTS:
        return _LAYOUTS[key] is not None
    num_sm = sm_count(be.device)
    ours = ms.mla_schedule(meta.qo_indptr.numpy(), meta.kv_indptr.numpy(), meta.kv_len.numpy(),
                           num_heads, causal, num_sm, q_len=meta.q_len)
    if ours is None:                      # beyond the numpy schedule's capacity: learn later
        return False
    try:
        diff = ms.same_schedule(ours, ms.read_schedule(plan_info, host, num_sm))
    except Exception as e:  # noqa: BLE001 - an unexpected plan-info shape is a mismatch too
        diff = f"{type(e).__name__}: {e}"
    if diff is not None:
        logger.warning("vllm_metax MLA: the numpy schedule differs from FlashInfer's MLAPlan (%s); "
                       "planning with MLAPlan", diff)
        _LAYOUTS[key] = None
        return False
    _LAYOUTS[key] = (ms.ScheduleLayout(tuple(int(x) for x in plan_info), staged, num_sm), plan_info)
    return True


class _StagingRing:
    """`depth` pinned host buffers the size of a device int workspace (MLAPlan never stages more
    than that: its allocator is bounded by the device workspace), used round-robin; each carries
    the event of the upload that last read it. Plans run on one host thread."""

    def __init__(self, nbytes: int, device_index: int, depth: int = 4):
        self.device_index = device_index
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        self.views = [b.numpy().view(np.int32) for b in self.buffers]   # the same memory
        self.holds: list = [None] * depth     # the numpy schedule structure each buffer holds
        self._uploads: dict = {}              # (buffer, bytes) -> (device ws, its bytes, buffer's)
        self.events: list = [None] * depth
        self.next = 0
        self.waits = 0            # acquisitions that found their buffer still being uploaded

    def acquire(self) -> torch.Tensor:
        ev = self.events[self.next]
        if ev is not None and not ev.query():
            self.waits += 1
            ev.synchronize()
        return self.buffers[self.next]

    def upload(self, device_ws: torch.Tensor, nbytes: int) -> None:
        """Copy the acquired buffer's first `nbytes` into `device_ws` on the current stream, and
        release the buffer. The byte views of both sides are kept (one upload per step)."""
        i = self.next
        views = self._uploads.get((i, nbytes))
        if views is None or views[0] is not device_ws:
            views = self._uploads[(i, nbytes)] = (device_ws, device_ws.view(torch.uint8)[:nbytes],
                                                  self.buffers[i][:nbytes])
        views[1].copy_(views[2], non_blocking=True)
        self.release(torch.cuda.current_stream(self.device_index))

    def release(self, stream) -> None:
        ev = self.events[self.next]
        if ev is None:
            ev = self.events[self.next] = torch.cuda.Event()
        ev.record(stream)
        self.next = (self.next + 1) % len(self.buffers)


_STAGING: dict = {}


def _staging_ring(device_ws: torch.Tensor) -> _StagingRing:
    nbytes = device_ws.numel() * device_ws.element_size()
    key = (str(device_ws.device), nbytes)
    ring = _STAGING.get(key)
    if ring is None:
        index = device_ws.device.index
        ring = _STAGING[key] = _StagingRing(nbytes, torch.cuda.current_device() if index is None else index)
    return ring


_SM_COUNT: dict = {}


def sm_count(device) -> int:
    key = str(device)
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[key]


__all__ = ["BACKENDS", "ENABLED", "INTERNALS", "SCHEDULES", "SCHEDULE_MIN_BATCH", "capable",
           "plan_schedule", "replan", "sm_count", "usable"]
