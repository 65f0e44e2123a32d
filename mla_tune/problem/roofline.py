"""Roofline of absorbed MLA decode: the fewest bytes and the FLOPs of a workload, the device's
ceilings (measured, not datasheet), and how close a time is to the floor they imply.

Per query token and head, absorbed MLA scores every visible KV position against the latent
(kv_lora_rank R) and rope (P) parts, then sums R-wide latent rows: 2*(R+P) + 2*R FLOPs per
position. For DeepSeek-V3 (R=512, P=64) that is B*H*L*(2*576 + 2*512) (docs/tuning.md, "The roofline"). With q_len > 1
the queries of a request are its last q_len tokens and attend causally, so query i sees
L - q_len + 1 + i positions.

Bytes: every KV row of every request read once (R+P values in kv_dtype), the queries read once,
the output (R values in q_dtype) written once. Page-table metadata is negligible and left out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from mla_tune.problem.workload import Workload

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def _visible_positions(workload: Workload) -> int:
    """Sum over all query tokens of the KV positions each one attends to."""
    q = workload.q_len
    return sum(q * n - q * (q - 1) // 2 for n in workload.seq_lens)


def workload_flops(workload: Workload) -> int:
    """Matmul FLOPs of one decode step (QK over R+P, PV over R), all heads."""
    R, P, H = workload.kv_lora_rank, workload.qk_rope_head_dim, workload.num_heads
    return H * _visible_positions(workload) * (2 * (R + P) + 2 * R)


def workload_bytes(workload: Workload) -> int:
    """Fewest bytes one step must move: KV read once, q read once, output written once."""
    R, P, H = workload.kv_lora_rank, workload.qk_rope_head_dim, workload.num_heads
    kv = workload.total_kv_tokens * (R + P) * _ITEMSIZE[workload.kv_dtype]
    tokens = workload.batch_size * workload.q_len
    q = tokens * H * (R + P) * _ITEMSIZE[workload.q_dtype]
    out = tokens * H * R * _ITEMSIZE[workload.q_dtype]
    return kv + q + out


def arithmetic_intensity(workload: Workload) -> float:
    """FLOPs per byte; compare with the device's ridge point matmul/copy."""
    return workload_flops(workload) / workload_bytes(workload)


@dataclass(frozen=True)
class Floor:
    """The two lower bounds on one step's time (us): the fewest bytes at the copy ceiling, the
    FLOPs at the matmul ceiling; the step can beat neither."""

    memory_us: float
    compute_us: float

    @property
    def us(self) -> float:
        return max(self.memory_us, self.compute_us)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_us >= self.compute_us else "compute"


def floor_of(workload: Workload, copy_gbps: float, matmul_tflops: float) -> Floor:
    """The two lower bounds on one step's time in microseconds."""
    return Floor(workload_bytes(workload) / (copy_gbps * 1e3),
                 workload_flops(workload) / (matmul_tflops * 1e6))


def pct_of_floor(time_us: float, workload: Workload, copy_gbps: float | None,
                 matmul_tflops: float | None) -> float | None:
    """100 * floor / time (100 = at the roofline); None without ceilings or time."""
    if not time_us or not copy_gbps or not matmul_tflops:
        return None
    return 100.0 * floor_of(workload, copy_gbps, matmul_tflops).us / time_us


def achieved(time_us: float, workload: Workload) -> tuple[float, float]:
    """(GB/s of the fewest bytes, TFLOP/s) at `time_us`."""
    return workload_bytes(workload) / (time_us * 1e3), workload_flops(workload) / (time_us * 1e6)


def measure_ceilings(device="cuda", copy_bytes: int = 2 << 30, matmul_n: int = 8192,
                     reps: int = 20) -> dict:
    """Measured device ceilings: {"copy_gbps", "matmul_tflops"} (medians over `reps`).

    Copy: device-to-device tensor copy, counting bytes read plus bytes written. Matmul: bf16
    n x n x n on random data (zeros run faster than real data). Times with CUDA events after a
    warm-up; each replicate is its own launch.
    """
    import torch    # lazy: the store and the CLI read problem/ without torch

    dev = torch.device(device)
    n = copy_bytes // 2
    src = torch.randn(n, device=dev, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = _event_median(lambda: dst.copy_(src), reps, dev)
    del src, dst
    a = torch.randn(matmul_n, matmul_n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(matmul_n, matmul_n, device=dev, dtype=torch.bfloat16)
    mm_ms = _event_median(lambda: torch.matmul(a, b), reps, dev)
    del a, b
    torch.cuda.empty_cache()
    return {
        "copy_gbps": 2 * n * 2 / (copy_ms * 1e-3) / 1e9,
        "matmul_tflops": 2 * matmul_n ** 3 / (mm_ms * 1e-3) / 1e12,
        "copy_ms": copy_ms, "matmul_ms": mm_ms,
        "method": f"median of {reps} event-timed launches; copy {copy_bytes >> 20} MiB bf16; "
                  f"matmul bf16 {matmul_n}^3 random",
    }


def _event_median(fn, reps: int, dev) -> float:

    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        times.append((s, e))
    torch.cuda.synchronize(dev)
    return statistics.median(s.elapsed_time(e) for s, e in times)
