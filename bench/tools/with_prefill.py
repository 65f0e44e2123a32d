"""A tuned config with its prefill sections re-chosen from a prefill-only results DB (a device run of
`mla-tune prefill-sweep` against a packaged config whose decode trials live in the main results.db,
too big to carry): `python3 bench/tools/with_prefill.py CONFIG.json PREFILL.db OUT_DIR`. The
choice is emit's (`mla_tune.tune.emit.with_prefill`: the decode rule per bucket); prints each
model's prefill backends."""

import collections
import sys

from mla_tune.store.results import ResultsStore
from mla_tune.tune.emit import with_prefill
from vllm_metax.core import tuned_config as tc


def main(config: str, db: str, out: str) -> int:
    cfg = tc.read_tuned_config(config)
    with ResultsStore(db, create=False) as store:
        records = [r for r in store.records(prefill=True) if r.device_name == cfg.device_name]
    if not records:
        print(f"no prefill trials of {cfg.device_name} in {db}", file=sys.stderr)
        return 1
    new = with_prefill(cfg, records)
    path = tc.write_tuned_config(new, out)
    for m in new.models:
        c = collections.Counter(b.backend for b in m.prefill)
        print(f"H{m.dims.num_heads}: {len(m.prefill)} prefill buckets: "
              + ", ".join(f"{k} {n}" for k, n in c.most_common()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(*sys.argv[1:]))
