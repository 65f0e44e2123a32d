"""How the split-KV TMA kernel compiles for a GPU target, without a GPU: registers, spills, shared
memory, KV buffers, and how many tiles' copies are in flight while a tile's dots run.

    python3 bench/experiments/split_kernel_compile.py [--arch 90] [--out bench/results]

Compiles `vllm_metax.ops.split_kernels.tma_kernel` ahead of time with the installed Triton
(the GPU image's Triton 3.6 is what the H200 runs: `PYTHONPATH=<its wheel, unpacked>` picks it)
for each variant in VARIANTS, reads registers and stack from the cubin (`cuobjdump
--dump-resource-usage`, shipped with Triton), and reads the pipelined loop from the TTGIR: the
KV tile buffers, the copies issued before the tile loop, and whether the loop issues the next
copy before or after its dots. Copies in flight during a tile's dots = prologue copies - 1, + 1
where the next copy is issued before the dots. A memory-bound loop with 0 in flight waits for
every tile's copy after its dots (the kernel as served on the H200 through 2026-12-04).

Writes <out>/split_kernel_compile_sm<arch>.{txt,json}. It times nothing: what a variant gains is
for bench/experiments/small_decode_kernel.py --pipe on the GPU to measure.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (heads, block_h, block_n, num_warps, num_stages, transposed, group_pages); the first of each head
# count is what split_decode.served() runs at page 64 for the pipe "t64", the last for "t32x4"
# (split_decode.PIPES)
VARIANTS = [
    (16, 16, 64, 8, 2, True, 0), (16, 16, 64, 8, 2, True, 32), (16, 16, 64, 8, 3, True, 32),
    (16, 64, 32, 8, 3, False, 32), (16, 64, 32, 8, 4, False, 32),
    (128, 64, 64, 8, 2, False, 0), (128, 64, 64, 8, 2, False, 32), (128, 64, 32, 8, 3, False, 0),
    (128, 64, 32, 8, 3, False, 32), (128, 64, 32, 8, 4, False, 32),
]
PAGE, R, P = 64, 512, 64
# the most dynamic shared memory one program may use on sm_90 (227 KiB)
SMEM_LIMIT = {90: 232448}


def signature(kernel, const: dict, block_n: int) -> dict:
    ptr = {"QN": "*bf16", "QP": "*bf16", "CKV_DESC": f"tensordesc<bf16[{block_n},{R}]>",
           "KPE_DESC": f"tensordesc<bf16[{block_n},{P}]>", "BT": "*i32", "SEQ": "*i32", "OUT": "*bf16",
           "WS_ACC": "*bf16", "WS_LSE": "*fp32", "qk_scale": "fp32"}
    return {n: "constexpr" if n in const else ptr.get(n, "i32") for n in kernel.arg_names}


def loop_shape(ttgir: str) -> dict:
    """The tile loop (the innermost scf.for holding the first dot): KV buffers, copies issued
    before it, and whether its body issues the next copy before its first dot."""
    lines = ttgir.splitlines()
    bufs = [int(m.group(1)) for m in re.finditer(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x%d" % R, ttgir)]
    dot_at = next(i for i, ln in enumerate(lines) if "warp_group_dot " in ln or "tt.dot " in ln)
    fors = [i for i in range(dot_at) if "scf.for" in lines[i]]
    loop_at = fors[-1]
    outer_at = fors[-2] if len(fors) > 1 else 0

    def ckv_copy(ln):
        return "async_tma_copy_global_to_local %CKV" in ln

    prologue = sum(ckv_copy(lines[i]) for i in range(outer_at, loop_at))
    indent = len(lines[loop_at]) - len(lines[loop_at].lstrip())
    body_end = next(i for i in range(loop_at + 1, len(lines))
                    if lines[i].strip().startswith("}") and len(lines[i]) - len(lines[i].lstrip()) == indent)
    copy_at = next((i for i in range(loop_at, body_end) if ckv_copy(lines[i])), None)
    before = copy_at is not None and copy_at < dot_at
    return {"kv_buffers": max(bufs) if bufs else 0, "prologue_copies": prologue,
            "next_copy": "none" if copy_at is None else ("before the dots" if before else "after the dots"),
            "copies_in_flight_during_dots": max(0, prologue - 1 + int(before))}


def compile_one(kernel, variant, arch: int, cuobjdump: str, tmp: Path) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    heads, bh, bn, warps, stages, trans, group = variant
    # the workspace holds the real heads (the merge kernel's layout, split_decode.SplitDecode.ws_heads)
    const = dict(H=heads, HP=heads, R=R, P=P, PAGE=PAGE, BLOCK_H=bh, BLOCK_N=bn,
                 TRANS=trans, GROUP_PAGES=group, PDL=False)
    row = {"heads": heads, "block_h": bh, "block_n": bn, "num_warps": warps, "num_stages": stages,
           "transposed": trans, "group_pages": group}
    try:
        c = triton.compile(ASTSource(kernel, signature(kernel, const, bn), const),
                           target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not the end
        return dict(row, status="compile error", message=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    cubin = tmp / "k.cubin"
    cubin.write_bytes(c.asm["cubin"])
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    smem = int(c.metadata.shared)
    limit = SMEM_LIMIT.get(arch)
    row.update(status="ok", registers=regs, stack_bytes=stack, shared_bytes=smem,
               fits=limit is None or smem <= limit, **loop_shape(c.asm["ttgir"]))
    return row


def label(r: dict) -> str:
    return (f"H{r['heads']} bh{r['block_h']} bn{r['block_n']} w{r['num_warps']} st{r['num_stages']}"
            f"{' T' if r['transposed'] else ''} g{r['group_pages']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    ap.add_argument("--out", default="bench/results", help="folder for split_kernel_compile_sm<arch>.{txt,json}")
    args = ap.parse_args(argv)
    try:
        import triton
    except ImportError as e:
        ap.error(f"needs triton ({e})")
    from vllm_metax.ops import split_decode as sd, split_kernels
    if sd._TensorDescriptor is None:
        ap.error(f"Triton {triton.__version__} has no tensor descriptors: the TMA kernel does not compile")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        ap.error(f"no cuobjdump at {cuobjdump} (Triton's NVIDIA backend ships it)")
    lines = [f"# tma_kernel compiled for sm_{args.arch}a by Triton {triton.__version__} (no GPU: "
             f"ptxas via Triton, cuobjdump resource usage, the TTGIR's tile loop); page {PAGE}, rank {R}, rope {P}",
             f"{'variant':<36} {'regs':>4} {'stack':>5} {'smem KB':>7} {'fits':>4} {'bufs':>4} "
             f"{'prologue':>8} {'in flight':>9}  next copy"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in VARIANTS:
            r = compile_one(split_kernels.tma_kernel, v, args.arch, str(cuobjdump), Path(tmp))
            rows.append(r)
            if r["status"] != "ok":
                lines.append(f"{label(r):<36} {r['status']}: {r['message']}")
            else:
                lines.append(f"{label(r):<36} {r['registers']:>4} {r['stack_bytes']:>5} "
                             f"{r['shared_bytes'] / 1024:>7.1f} {'yes' if r['fits'] else 'NO':>4} "
                             f"{r['kv_buffers']:>4} {r['prologue_copies']:>8} "
                             f"{r['copies_in_flight_during_dots']:>9}  {r['next_copy']}")
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"split_kernel_compile_sm{args.arch}"
    stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"triton": triton.__version__, "arch": args.arch,
                                                     "rows": rows}, indent=1))
    print(f"wrote {stem}.txt/.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
