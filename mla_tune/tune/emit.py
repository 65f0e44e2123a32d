"""results.db -> the tuned config the vllm_metax plugin loads (configs/device_name=<device>.json).

Winners and the global choice are `mla_tune.tune.choose`'s; this module only translates a
`choose.Choice` into `vllm_metax.core.tuned_config.TunedConfig` (the one schema shared with the reader)
with its provenance: the device name as the plugin sees it (the name `vllm_metax.core.device` recorded
in the run), SM count, FlashInfer / torch / CUDA versions, the date, the rules, and the results.db
runs the numbers came from. `mla-tune emit` and the sweep both call `emit_config`. The prefill
section of each entry comes from the device's stored prefill trials (`mla_tune.tune.prefill`,
the same significance rule).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from pathlib import Path

from mla_tune import __version__
from mla_tune.tune import choose as choosing
from mla_tune.problem.workload import WorkloadMix
from mla_tune.problem.units import us_text
from mla_tune.store.records import TrialRecord
from mla_tune.store.selection import CPU_RUN_KIND, TrialFilter, device_key, run_profile, select_trials
from mla_tune.validate import is_packaged_configs
from vllm_metax.core import choices, decisions, tuned_config as tc
from vllm_metax.core import device as core_device
from vllm_metax.core.profile import PROVENANCE_KEY, get_profile

CPU_NOTE = ("measured with the CPU torch reference (no GPU): the page size exercises the pipeline; "
            "no kernel-family choices, backend order is the profile's untuned one, not a measurement")
RUN_FIELDS = ("sm_count", "flashinfer", "torch", "cuda", "driver", "vllm", "capability")


class EmitError(ValueError):
    """Nothing (or something ambiguous) to emit; the message says what to do."""


def devices_in(records: list[TrialRecord]) -> list[str]:
    return sorted({r.device_name for r in records})


def pick_device(records: list[TrialRecord], device: str | None = None) -> str:
    """The device to emit for: the named one, else the only one, else this machine's if measured."""
    names = devices_in(records)
    if device:
        hit = [n for n in names if device_key(n) == device_key(device)]
        if not hit:
            raise EmitError(f"no trials for device {device!r}; measured devices: "
                            f"{', '.join(map(repr, names))}")
        return hit[0]
    if len(names) == 1:
        return names[0]
    here = core_device.detect_device().name
    hit = [n for n in names if device_key(n) == device_key(here)]
    if hit:
        return hit[0]
    raise EmitError(f"trials of several devices ({', '.join(map(repr, names))}) and none is this "
                    f"machine's ({here!r}): name one with --device, or use --all-devices")


def _collapse(values: list):
    vals = list(dict.fromkeys(v for v in values if v not in (None, "")))
    return None if not vals else vals[0] if len(vals) == 1 else vals


def provenance(device_name: str, runs: list[dict], choice: choosing.Choice, results_db: str | None,
               mix: WorkloadMix | None, notes: list[str]) -> dict:
    """Where a config's numbers come from: device, environment of the runs, rules, date."""
    p = {"device_name": device_name, "kind": choice.kind or _collapse([r.get("kind") for r in runs])}
    # the target profile the numbers were measured under: what the plugin compares with its own
    p[PROVENANCE_KEY] = _collapse([run_profile(r) for r in runs])
    for k in RUN_FIELDS:
        p[k] = _collapse([r.get(k) for r in runs])
    p.update({
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "results_db": results_db,
        "runs": sorted(r["id"] for r in runs),
        "run_started": _collapse([r.get("started_at") for r in runs]),
        "hosts": _collapse([r.get("host") for r in runs]),
        "trials": choice.n_trials,
        "rules": {"metric": choice.metric, "p_threshold": choice.p_threshold,
                  "min_ratio": choice.min_ratio, "default_page_size": choice.default_page_size,
                  "test": "one-sided Mann-Whitney U on raw samples, plus a minimum median ratio"},
        "mix": "uniform" if mix is None or not mix.weights else (
            {"traffic": mix.source, "keys": len(mix.weights)} if mix.snap
            else [[*k, w] for k, w in sorted(mix.weights.items())]),
        "mla_tune": __version__,
        "notes": list(dict.fromkeys(list(choice.notes) + notes)),
    })
    return p


def _bucket(b: choosing.BucketChoice) -> tc.Bucket:
    fams = {}
    for f, v in b.families.items():
        if f not in tc.FAMILIES or v.chosen is None:
            continue
        # written as the plugin reads it: the family's typed choice, "keep vLLM's rule" included
        typed = choices.family_choice(f, v.chosen.plan_params)
        if typed is not None:
            fams[f] = tc.FamilyChoice(typed.to_params(), v.time_us, v.default_time_us,
                                      bool(v.significant))
    best = b.best_family if b.best_family in fams else (
        min(fams, key=lambda f: fams[f].time_us or float("inf")) if fams else None)
    # keyed by the context the plugin looks a batch up by (the mean per-request length): the
    # bucket's context for uniform lengths, the measured lengths' mean for ragged ones
    return tc.Bucket(b.batch_size, b.lookup_context or b.context_len, b.q_len, fams, best)


def served_order(m: choosing.ModelChoice, buckets: list, profile) -> tuple[list, str | None]:
    """The entry's attention-backend order and, where it differs from the families' ranking, why.

    The families are ranked by their own weighted totals (`choose`), but FLASHINFER_MLA's decode
    also runs the split kernel, FlashMLA and vLLM's FA3 in the buckets `decisions.side_kernel`
    gives them: its total is that of what it serves per bucket. Where that beats a backend ranked
    ahead of it (on a MetaX-profile sweep FlashMLA alone can rank first, while FLASHINFER_MLA
    serves FlashMLA's buckets and the split kernel's), FLASHINFER_MLA moves ahead of it. `buckets`
    are `m.buckets` as written (`_bucket`); an incomplete bucket keeps the ranking. The side kernels
    are those the target `profile` (the config's, not this machine's) serves."""
    order, fi = list(m.backend_order), choosing.ATTENTION_BACKEND[choices.FLASHINFER]
    if fi not in order or order[0] == fi:
        return order, None
    served = 0.0
    for bc, b in zip(m.buckets, buckets):
        if bc.weight <= 0:
            continue
        side = decisions.side_kernel(b, profile, page_size=m.page_size)
        fc = b.families.get(side[0] if side else choices.FLASHINFER)
        if fc is None or not fc.time_us:
            return order, None
        served += bc.weight * fc.time_us
    totals = {choosing.ATTENTION_BACKEND[t.family]: t for t in m.totals if t.page_size == m.page_size
              and t.family in choosing.ATTENTION_BACKEND and t.complete}
    ahead = [b for b in order[:order.index(fi)] if b in totals and totals[b].total_us > served]
    if not ahead:
        return order, None
    rest = [b for b in order if b != fi]
    rest.insert(rest.index(ahead[0]), fi)
    return rest, (f"FLASHINFER_MLA ahead of {' and '.join(ahead)}: what its decode serves per bucket "
                  f"(split-KV, FlashMLA, vLLM FA3 or FlashInfer) totals {us_text(served)}, "
                  f"{ahead[0]} alone {us_text(totals[ahead[0]].total_us)}")


def model_entries(choice: choosing.Choice, notes: list[str],
                  profile: str | None = None) -> list[tc.ModelEntry]:
    """One tuned-config entry per model dims; entries that cannot be written are noted, not written.

    The config keys entries by dims (heads per rank, ranks, dtypes) only. Of the choices with the
    same dims, the uniform-length one with the most buckets makes the entry (page size, backend
    order); the buckets of the same model measured with ragged lengths (a distribution or a
    recorded trace) are merged into it, each keyed by its lookup statistic (the mean length the
    plugin looks a batch up by), where their page size is the entry's. On a shared key (same
    batch, q_len and lookup context) the ragged bucket wins: its lengths are what a server sees,
    while equal lengths are rare in serving. Other same-dims choices (another preset, a ragged
    choice at another page size) are noted, not written. An entry whose sweep measured no vLLM
    attention-backend family gets the untuned order of the target `profile` (`Profile.mla_order`;
    None: the one the device name implies).
    """
    target = get_profile(profile or run_profile({"device_name": choice.device_name}))
    by_dims: dict = {}
    ordered = sorted(choice.models, key=lambda m: (m.ragged != "uniform", -len(m.buckets), m.model))
    for m in ordered:
        label = f"{m.model} H{m.num_heads} ({m.ragged})"
        if m.page_size is None:
            notes.append(f"{label}: no valid candidate, not written")
            continue
        dims = decisions.model_key(m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.q_dtype,
                                   m.kv_dtype)
        if dims in by_dims:
            base = by_dims[dims]
            if m.ragged != "uniform" and m.model == base.model and m.page_size == base.page_size:
                keyed = {(b.batch_size, b.context_len, b.q_len): b for b in base.buckets}
                mine = [_bucket(b) for b in m.buckets]
                shared = sum((b.batch_size, b.context_len, b.q_len) in keyed for b in mine)
                keyed.update({(b.batch_size, b.context_len, b.q_len): b for b in mine})
                merged = sorted(keyed.values(), key=lambda b: (b.q_len, b.batch_size, b.context_len))
                by_dims[dims] = tc.ModelEntry(base.dims, base.page_size, base.backend_order, merged,
                                              base.model, base.tp_size,
                                              base.reason + f"; {len(mine)} buckets measured with "
                                              f"{m.ragged} context lengths")
                notes.append(f"{label}: {len(mine)} ragged buckets merged into the entry by mean "
                             f"length ({shared} replace a uniform bucket at the same key)")
                continue
            notes.append(f"{label}: same dims as {base.model} "
                         f"({base.reason.split(';')[0]}...), not written")
            continue
        buckets = [_bucket(b) for b in m.buckets]
        order, served_note = served_order(m, buckets, target)
        reason = f"{m.page_reason}; {m.order_reason}" + (f"; {served_note}" if served_note else "")
        if m.ragged != "uniform":
            reason += f"; measured with {m.ragged} context lengths"
        if not order:
            order = list(target.mla_order)
            reason += "; no vLLM attention-backend family measured: backend order not tuned"
        by_dims[dims] = tc.ModelEntry(dims, int(m.page_size), order, buckets, m.model, m.tp_size, reason)
    return list(by_dims.values())


def config_from_choice(choice: choosing.Choice, runs: list[dict], results_db: str | None = None,
                       mix: WorkloadMix | None = None) -> tc.TunedConfig:
    """A TunedConfig for `choice`'s device; `runs` are the run rows its trials came from."""
    notes: list[str] = []
    if choice.kind == CPU_RUN_KIND or device_key(choice.device_name) == "cpu":
        notes.append(CPU_NOTE)
    profiles = {run_profile(r) for r in runs}
    entries = model_entries(choice, notes, profiles.pop() if len(profiles) == 1 else None)
    if not entries:
        raise EmitError(f"nothing to emit for {choice.device_name!r}: "
                        + ("; ".join(notes) or "no model entry has a valid candidate"))
    return tc.TunedConfig(choice.device_name,
                          provenance(choice.device_name, runs, choice, results_db, mix, notes),
                          entries)


def build_tuned_config(store, flt: TrialFilter = TrialFilter(), mix: WorkloadMix | None = None,
                       **choose_kw) -> tc.TunedConfig:
    """The tuned config of one device from the trials `flt` selects (device picked by pick_device;
    the target profile `flt.profile`, else the only one its trials were measured under).

    Every model measured on the device goes into its one file, not only the latest sweep's.
    """
    records = select_trials(store, flt)
    device = pick_device(records, flt.device)
    records = [r for r in records if r.device_name == device]
    flt = dataclasses.replace(flt, profile=flt.profile or only_profile(store, records, device))
    if mix is not None and mix.weights:     # the config's page size must see every weight
        mix.check_covers({r.stored.bucket[:2] for r in records},
                         f"the buckets measured on {device}")
    choice = choosing.choose(records, mix, device_name=device, **choose_kw)
    run_ids = {r.run_id for r in choosing.latest_trials(records)}
    prefill = store.records(*TrialFilter(device, flt.model, flt.runs, flt.profile).where(), prefill=True)
    run_ids |= {r.run_id for r in choosing.latest_trials(prefill)}
    runs = [r for r in store.runs() if r["id"] in run_ids]
    cfg = config_from_choice(choice, runs, Path(store.path).name, mix)
    return with_prefill(cfg, prefill, **{k: v for k, v in choose_kw.items()
                                         if k in ("p_threshold", "min_ratio")})


def only_profile(store, records: list[TrialRecord], device: str) -> str:
    """The one target profile `records` were measured under (`run_profile`); EmitError naming
    them where there are several: one config holds one target's choices."""
    profiles = {r["id"]: run_profile(r) for r in store.runs()}
    found = sorted({profiles.get(r.run_id, "") for r in records} - {""})
    if len(found) > 1:
        raise EmitError(f"the trials of {device} were measured under several profiles "
                        f"({', '.join(found)}): name one with --profile")
    return found[0] if found else ""


def with_prefill(cfg: tc.TunedConfig, prefill: list, **choose_kw) -> tc.TunedConfig:
    """`cfg` with each model entry's prefill section chosen from `prefill` (the device's prefill
    TrialRecords); prefill measured for dims without a decode entry is noted, not written."""
    if not prefill:
        return cfg
    # lazy: the prefill choice imports the measuring side (torch), which a decode-only emit never needs
    from mla_tune.tune.prefill import choose_prefill, prefill_buckets
    sections = {dims: prefill_buckets(vs) for dims, vs in choose_prefill(prefill, **choose_kw).items()}
    notes = cfg.provenance.setdefault("notes", [])
    models = []
    for m in cfg.models:
        buckets = sections.pop(m.dims, None)
        models.append(dataclasses.replace(m, prefill=buckets) if buckets else m)
    for dims in sections:
        notes.append(f"prefill measured for H{dims.num_heads} (kv_lora_rank {dims.kv_lora_rank}, "
                     f"{dims.q_dtype}) but no decode entry has those dims: its prefill section is "
                     "not written (sweep decode for it first)")
    cfg.provenance["prefill_trials"] = len(choosing.latest_trials(prefill))
    return dataclasses.replace(cfg, models=models)


def config_to_emit(source, out_dir: str | Path = "configs", *, store=None,
                   device: str | None = None, model: str | None = None, runs=(),
                   mix: WorkloadMix | None = None, cpu_ok: bool = False, profile: str | None = None,
                   **choose_kw) -> tuple[tc.TunedConfig, Path]:
    """The tuned config `emit_config` would write and where, both checked; nothing is written.

    `source` is a ResultsStore: the choice is made here from its trials (filtered by device,
    model, runs and target profile). Or it is a `choose.Choice` already made (the sweep's): with `store=` the file
    is rebuilt from every trial of the choice's device under the choice's rules, so one device's
    file keeps the models earlier sweeps measured; without a store the choice is written as is.
    """
    if isinstance(source, choosing.Choice):
        if store is None:
            cfg = config_from_choice(source, [], None, mix)
        else:
            rules = dict(p_threshold=source.p_threshold, min_ratio=source.min_ratio,
                         default_page_size=source.default_page_size, metric=source.metric)
            cfg = build_tuned_config(store, TrialFilter(source.device_name, model, tuple(runs), profile),
                                     mix, **{**rules, **choose_kw})
    else:
        cfg = build_tuned_config(source, TrialFilter(device, model, tuple(runs), profile), mix,
                                 **choose_kw)
    if not cpu_ok and device_key(cfg.device_name) == "cpu" and is_packaged_configs(out_dir):
        raise EmitError(f"not writing the CPU reference's config into the packaged {out_dir} (the "
                        "vLLM plugin loads it; the CPU is not a serving device): name the folder "
                        "explicitly (--configs-dir) to write it anyway")
    tc.parse_tuned_config(cfg.to_json(), "<new config>")
    return cfg, tc.check_config_target(cfg.device_name, out_dir)


def emit_config(source, out_dir: str | Path = "configs", **kw) -> Path:
    """Write configs/device_name=<device>.json and return its path (`config_to_emit` says what
    goes in and takes the same arguments)."""
    cfg, _ = config_to_emit(source, out_dir, **kw)
    return tc.write_tuned_config(cfg, out_dir)


def config_summary(cfg: tc.TunedConfig, path=None, verb: str = "wrote") -> list[str]:
    """A few lines saying what a written config holds (what `mla-tune emit` prints); `verb` and
    `path` for one not written (--dry-run: "would write")."""
    runs = ", ".join(map(str, cfg.provenance.get("runs") or [])) or "-"
    out = [f"{verb} {path or cfg.path} ({cfg.device_name}, runs {runs})"]
    for e in cfg.models:
        n = len(e.buckets)
        pre = f", {len(e.prefill)} prefill bucket{'' if len(e.prefill) == 1 else 's'}" if e.prefill else ""
        out.append(f"  {e.model or '-'} H{e.dims.num_heads}: page {e.page_size}, "
                   f"{' > '.join(e.backend_order)}, {n} bucket{'' if n == 1 else 's'}{pre}")
    out += [f"  note: {n}" for n in cfg.provenance.get("notes") or []]
    return out


def emit_all(store, out_dir: str | Path = "configs", *, model: str | None = None, runs=(),
             mix: WorkloadMix | None = None, cpu_ok: bool = False, **choose_kw) -> list[Path]:
    """One file per device measured in the selection."""
    return [tc.write_tuned_config(cfg, out_dir) for cfg, _ in
            configs_to_emit(store, out_dir, model=model, runs=runs, mix=mix, cpu_ok=cpu_ok,
                            **choose_kw)]


def configs_to_emit(store, out_dir: str | Path = "configs", *, model: str | None = None, runs=(),
                    **kw) -> list[tuple[tc.TunedConfig, Path]]:
    """`config_to_emit` for every device measured in the selection."""
    records = select_trials(store, TrialFilter(None, model, tuple(runs), kw.get("profile")))
    return [config_to_emit(store, out_dir, device=d, model=model, runs=runs, **kw)
            for d in devices_in(records)]


__all__ = ["EmitError", "build_tuned_config", "config_from_choice", "config_summary",
           "config_to_emit", "configs_to_emit", "emit_all", "emit_config", "model_entries", "pick_device", "provenance"]
