"""The split-KV decode kernel's facts as plain data (stdlib only): the one definition that the
kernel (`vllm_metax.ops.split_decode`) and the tuned-config knob
domains (`vllm_metax.core.choices`) both import, so the plugin's cheap start-up path reads them without
importing torch or triton."""

from __future__ import annotations

from dataclasses import dataclass

# A launch's programs (splits x head blocks x requests) are capped at 8 waves of an H200's 132 SMs:
# it sizes the served workspace (rows = MAX_PROGRAMS // head blocks) and bounds the tuner's space.
MAX_PROGRAMS = 1056
PARTIAL_DTYPES = ("bfloat16", "float32")


def default_block_h(num_heads: int) -> int:
    """Head rows per program: 16 up to 32 heads (mma with M=16), 64 from 64 heads on (wgmma M=64)."""
    return 16 if num_heads < 64 else 64


@dataclass(frozen=True)
class Pipe:
    """How the served kernel cuts a split into tiles and pipelines their copies: the split
    family's `pipe` knob (`PIPES`), beside the split count and the partials' dtype."""

    block_n: int                # tokens a tile
    num_stages: int             # Triton's software-pipeline stages
    group_pages: int = 0        # page ids loaded this many pages at a time ahead of their tiles
    block_h: int | None = None  # head rows a program (None: default_block_h)
    pdl: bool = False           # the merge kernel as the split kernel's programmatic dependent launch

    @property
    def tma_only(self) -> bool:
        """Grouped page ids are the TMA kernel's, and PDL is Hopper's: no pointer-kernel form."""
        return bool(self.group_pages) or self.pdl

    def head_block(self, num_heads: int) -> int:
        return self.block_h or default_block_h(num_heads)


# The pipes the tuner measures and the plugin serves. "t64" (a tuned config without `pipe`
# names it) is the kernel measured on the H200 (bench/results/small_decode_kernel_h200.txt, run `tma`):
# 64-token tiles, 2 stages, the block-table load in the tile loop, which sm_90a TTGIR (Triton 3.6)
# shows issuing the next tile's copy only after this tile's dots (0 copies in flight during
# them, bench/results/split_kernel_compile_sm90.txt). "t32x4": 32-token tiles at 4 stages with
# 32 pages' ids loaded ahead of their tiles and 64 head rows a program (wgmma's M; 16 heads
# padded): 4 KV buffers, 2 copies in flight during a tile's dots, 216 KB of shared memory, no
# spill (same file). "-pdl": the merge kernel launched as the split kernel's programmatic
# dependent, so its launch overlaps the split grid (one launch latency less at small work).
PIPES = {
    "t64": Pipe(64, 2),
    "t32x4": Pipe(32, 4, group_pages=32, block_h=64),
    "t64-pdl": Pipe(64, 2, pdl=True),
    "t32x4-pdl": Pipe(32, 4, group_pages=32, block_h=64, pdl=True),
}
SERVED_PIPE = "t64"
