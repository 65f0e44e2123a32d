"""Where a split program's time per KV tile goes: the served split kernel beside a probe that only
streams the same tiles (TMA copies of the same paged cache, the same grid and split rule) and does
no attention math, beside a device-to-device copy of the same bytes (copy bandwidth: bytes read and
written over its time). The probe consumes a tile either by summing it over its tokens (`rowsum`,
a cross-warp reduction per tile) or by adding it into a register tile reduced once at the end.

    source bench/tools/device-setup.sh && python3 bench/experiments/split_tile_probe.py --out $OUT

Why: on the H200 the split kernel costs ~4 us per 64-token tile and program at batch 8+, and the
32-token, 4-stage pipe with 2 copies in flight (`t32x4`) was no faster per token than the
2-stage one (`t64`) in the 2026-12-05 sweep. If the probe streams at near copy bandwidth, the
attention math (its dots, softmax and their waits) is what bounds the kernel; if the probe is as
slow, one program per SM cannot pull the tiles faster. Times are CUDA-graph replays (median of
`--reps`, warm L2 not flushed: the caches are far larger than L2). Writes
<out>/split_tile_probe_<device>.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from bench.experiments.graph_replay import replay_median_us  # noqa: E402

R, P, PAGE = 512, 64, 64
SHAPES = [  # heads, batch, context, splits (the one-wave count the sweep chose)
    (16, 8, 32768, 16), (16, 1, 32768, 128), (16, 32, 8192, 4), (128, 8, 32768, 8), (128, 1, 32768, 64)]


@triton.jit
def _stream_kernel(CKV_DESC, KPE_DESC, BT, SEQ, OUT, stride_bt, NUM_SPLITS,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                   ROWSUM: tl.constexpr):
    # ROWSUM: each tile summed over its tokens (a cross-warp reduction per tile, as the first
    # version of this probe did); else added into a [BLOCK_N, R] register tile, reduced once at the
    # end: the cheapest consumer of a copy, so the time is the copies'
    split = tl.program_id(0)
    b = tl.program_id(2)
    seq_len = tl.load(SEQ + b)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    pid = (b * NUM_SPLITS + split) * tl.num_programs(1) + tl.program_id(1)
    if ROWSUM:
        acc = tl.zeros([R], tl.float32)
        acc_p = tl.zeros([P], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, R], tl.float32)
        acc_p = tl.zeros([BLOCK_N, P], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        row = tl.load(BT + b.to(tl.int64) * stride_bt + t0 // PAGE) * PAGE + t0 % PAGE
        kv = CKV_DESC.load([row, 0]).to(tl.float32)
        kpe = KPE_DESC.load([row, 0]).to(tl.float32)
        if ROWSUM:
            acc += tl.sum(kv, 0)
            acc_p += tl.sum(kpe, 0)
        else:
            acc += kv
            acc_p += kpe
    if not ROWSUM:
        acc = tl.sum(acc, 0)
        acc_p = tl.sum(acc_p, 0)
    tl.store(OUT + pid * (R + P) + tl.arange(0, R), acc)
    tl.store(OUT + pid * (R + P) + R + tl.arange(0, P), acc_p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    from vllm_metax.ops import split_decode as op
    from vllm_metax.core.split_facts import default_block_h
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    rows, lines = [], [f"# split tile probe on {name}, torch {torch.__version__}, triton {triton.__version__}; "
                       f"page {PAGE}, CUDA-graph replay, median of {args.reps}"]
    for heads, batch, ctx, splits in SHAPES:
        pages = batch * ctx // PAGE
        cache = torch.randn(pages + 8, PAGE, R + P, dtype=torch.bfloat16, device=dev)
        bt = torch.randperm(pages + 8, device=dev)[:pages].to(torch.int32).view(batch, -1).contiguous()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, heads, R + P, dtype=torch.bfloat16, device=dev)
        out = torch.empty(batch, heads, R, dtype=torch.bfloat16, device=dev)
        gbytes = batch * ctx * (R + P) * 2 / 1e9
        row = {"heads": heads, "batch": batch, "context": ctx, "splits": splits, "kv_gb": gbytes}
        for pipe in ("t64", "t32x4"):
            k = op.served(splits, "bfloat16", heads, PAGE, batch, dev, pipe=pipe)
            row[f"{pipe}_us"] = replay_median_us(lambda: k.run(q[..., :R], q[..., R:], cache[..., :R], cache[..., R:],
                                                          bt, lens, 192 ** -0.5, out), args.reps)
        hb = -(-heads // default_block_h(heads))
        flat = cache.view(-1, R + P)
        sink = torch.empty(batch * splits * hb, R + P, dtype=torch.float32, device=dev)
        for bn, stages, rowsum in ((64, 2, True), (64, 2, False), (64, 3, False), (32, 4, False)):
            label = f"stream{'_rowsum' if rowsum else ''}_bn{bn}_st{stages}"
            descs = (TensorDescriptor(flat[:, :R], [flat.shape[0], R], [R + P, 1], [bn, R]),
                     TensorDescriptor(flat[:, R:], [flat.shape[0], P], [R + P, 1], [bn, P]))

            def stream():
                _stream_kernel[(splits, hb, batch)](descs[0], descs[1], bt, lens, sink, bt.stride(0), splits,
                                                    PAGE=PAGE, BLOCK_N=bn, R=R, P=P, ROWSUM=rowsum,
                                                    num_warps=8, num_stages=stages)
            try:
                row[f"{label}_us"] = replay_median_us(stream, args.reps)
            except Exception as e:  # noqa: BLE001 - a probe that does not fit is a row, not the end
                row[f"{label}_us"] = None
                row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        # the copy bound of the same bytes: one device-to-device copy of the cache's used pages
        used = cache[: pages]
        dst = torch.empty_like(used)
        row["copy_us"] = replay_median_us(lambda: dst.copy_(used), args.reps)
        rows.append(row)
        cells = [f"{k[:-3]} {v:.1f} us ({gbytes / v * 1e6:.0f} GB/s, {row['copy_us'] / (2 * v):.0%} of copy bandwidth)"
                 for k, v in row.items() if k.endswith("_us") and v and k != "copy_us"]
        cells.append(f"copy {row['copy_us']:.1f} us ({2 * gbytes / row['copy_us'] * 1e6:.0f} GB/s read+write)")
        lines.append(f"H{heads} B{batch} L{ctx} S{splits} programs {splits * hb * batch}: " + "; ".join(cells))
        print(lines[-1], flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = "h200" if "H200" in name else "h100" if "H100" in name else name.replace(" ", "_")
    (out_dir / f"split_tile_probe_{tag}.txt").write_text("\n".join(lines) + "\n")
    (out_dir / f"split_tile_probe_{tag}.json").write_text(json.dumps({"device": name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
