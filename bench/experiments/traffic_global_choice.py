"""Can a server's recorded traffic move a tuned config's global choices (issue 54)?

`emit --traffic` picks the one KV page size of a model entry by the smallest weighted total over
the recorded steps, and orders its backends by the recorded steps too. A mix is a nonnegative
weighting of the measured cells, so where one page size (and one order) wins for a traffic that
puts all of its steps in any single cell, it wins for every mix of those cells. This script runs
the real `mla-tune emit --traffic` once per measured cell of each device, on a traffic file that
holds that cell only (written as the plugin's recorder writes it), and says where the choice
differs from the untuned-weight config's.

    python3 bench/experiments/traffic_global_choice.py results.db --heads 16 \
        > bench/results/traffic_global_choice.md

(CPU only: it reads the stored measurements. It takes about 5 s per cell and device.)
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_metax.core import traffic as rec
from vllm_metax.core.tuned_config import ModelDims


def cells(db: str, heads: int) -> dict[str, list[tuple[int, int]]]:
    """Per device, the (batch, context) decode cells measured at q_len 1 for `heads` heads."""
    out: dict[str, list] = {}
    for dev, b, c in sqlite3.connect(db).execute("""
            select distinct r.device_name, w.batch_size, w.context_len
            from trials t join workloads w on w.id = t.workload_id join runs r on r.id = t.run_id
            where w.num_heads = ? and w.q_len = 1 and w.ragged = 'uniform' and t.family != 'flashinfer_prefill'
            order by 1, 2, 3""", (heads,)):
        out.setdefault(dev, []).append((b, c))
    return out


def emit(db: str, device: str, traffic: Path | None, out: Path) -> dict:
    """The global choice of the `heads` entry in the config `emit` writes for `device`."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "mla_tune", "emit", "--db", db, "--out", str(out), "--device", device]
    if traffic is not None:
        cmd += ["--traffic", str(traffic)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    cfg = json.loads(next(out.glob("device_name=*.json")).read_text())
    return cfg["models"]


def global_of(models: list, heads: int) -> tuple:
    for m in models:
        if m["dims"]["num_heads"] == heads:
            g = m["global"]
            return g["page_size"], tuple(g["backend_order"])
    raise SystemExit(f"no {heads}-head entry in the emitted config")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("db")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-lora", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    args = ap.parse_args()
    dims = ModelDims(args.heads, args.kv_lora, args.rope, "bfloat16", "bfloat16")
    print(f"# Can recorded traffic move the global choice? ({args.db}, {args.heads} heads)\n")
    print("One `mla-tune emit --traffic` per measured decode cell, on a traffic file holding "
          "1000 steps in that cell only (q_len 1 and q_len 2).\n")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for device, measured in cells(args.db, args.heads).items():
            base = global_of(emit(args.db, device, None, tmp / "base"), args.heads)
            moved = []
            for b, c in measured:
                for q in (1, 2):
                    path = tmp / f"t_{b}_{c}_{q}.db"
                    rec.write_counts(str(path), dims, {(b, q, rec.fine_bin(c)): 1000}, {},
                                     device_name=device)
                    got = global_of(emit(args.db, device, path, tmp / f"c_{b}_{c}_{q}"), args.heads)
                    if got != base:
                        moved.append((b, c, q, got))
            print(f"## {device}\n")
            print(f"- untuned weights: page {base[0]}, order {' > '.join(base[1])}")
            print(f"- cells tried: {len(measured)} x q_len 1, 2; the choice moves in {len(moved)}")
            for b, c, q, got in moved:
                print(f"  - batch {b}, context {c}, q_len {q}: page {got[0]}, order {' > '.join(got[1])}")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
