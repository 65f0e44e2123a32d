"""Pack vLLM's compiled ops for the lent H200 (no package access there, 64 MiB per transfer).

    python3 bench/tools/prepare_device_ops.py          # here, after installing the vllm extra
    # there (carry ".ops"):  xz -dc .ops/_C_stable_libtorch.abi3.so.xz > /tmp/site/vllm/_C_stable_libtorch.abi3.so

`vllm/_C_stable_libtorch.abi3.so` (92 MB) is mostly a CUDA fat binary of already compressed cubins
for sm_75..sm_120 and PTX, which xz cannot shrink (63 MB). The H200 loads only the sm_90 cubins
(and the sm_90 PTX), so this strips the host symbol table and zeroes the payloads of every other
architecture's entry in place (headers and sizes unchanged, so the ELF layout is untouched): 26 MB
after xz. The result is for sm_90 devices only.
"""

from __future__ import annotations

import argparse
import lzma
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KEEP_ARCH = 90
KIND_PTX, KIND_ELF = 1, 2


def fatbin_section(path: Path) -> tuple[int, int]:
    out = subprocess.check_output(["readelf", "-S", "-W", str(path)], text=True)
    for line in out.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{path}: no .nv_fatbin section")


def keep_only_arch(data: bytearray, offset: int, size: int, arch: int = KEEP_ARCH) -> dict:
    """Zero every fat-binary entry payload not built for `arch`; returns bytes kept/zeroed."""
    stats = {"kept": 0, "zeroed": 0}
    pos, end = offset, offset + size
    while pos < end:
        magic, _version, header, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8            # fat binaries are 8-byte aligned inside the section
            continue
        p, stop = pos + header, pos + header + fat_size
        while p < stop:
            kind, _u, entry_header, payload = struct.unpack_from("<HHIQ", data, p)
            entry_arch = struct.unpack_from("<I", data, p + 28)[0]
            if kind in (KIND_PTX, KIND_ELF) and entry_arch != arch:
                data[p + entry_header:p + entry_header + payload] = bytes(payload)
                stats["zeroed"] += payload
            else:
                stats["kept"] += payload
            p += entry_header + payload
        pos = stop
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".ops", help="folder for the packed ops (default .ops, which "
                                                  "the device call carries)")
    args = ap.parse_args(argv)
    import vllm

    src = Path(vllm.__file__).parent / "_C_stable_libtorch.abi3.so"
    dest = Path(args.out)
    dest.mkdir(exist_ok=True)
    exclude = Path(".git/info/exclude")
    if exclude.exists() and "/.ops/" not in exclude.read_text().split():
        with exclude.open("a") as f:
            f.write("/.ops/\n")
    with tempfile.TemporaryDirectory() as tmp:
        stripped = Path(tmp) / src.name
        subprocess.check_call(["strip", "--strip-unneeded", "-o", str(stripped), str(src)])
        data = bytearray(stripped.read_bytes())
        stats = keep_only_arch(data, *fatbin_section(stripped))
        out = dest / (src.name + ".xz")
        out.write_bytes(lzma.compress(bytes(data), preset=6))
    print(f"{src} ({os.path.getsize(src) / 1e6:.1f} MB) -> {out} ({out.stat().st_size / 1e6:.1f} MB); "
          f"sm_{KEEP_ARCH} payload kept {stats['kept'] / 1e6:.1f} MB, other archs zeroed "
          f"{stats['zeroed'] / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
