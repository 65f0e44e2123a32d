"""`mla-tune doctor`: what the vllm_metax plugin sees on this machine and what it would do.

Which device it sees, whether the platform plugin would activate and why, which MLA attention
backends and FlashInfer backend values are usable here, and which tuned config it would load (or
why none), and the target profile it runs (and whether the config was tuned under another). Nothing here imports vLLM: the checks read package metadata and the plugin's own
vllm-free modules, so the doctor also runs where vLLM is broken.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import asdict, dataclass, field
from importlib import metadata

import vllm_metax
from mla_tune.problem.workload import model_preset
from mla_tune.store.traffic import load_traffic
from mla_tune.validate import InputError
from mla_tune.views.render import Column, OutputFormat, Table, render, to_csv
from mla_tune.views.traffic_view import config_for_traffic, entry_for_traffic, traffic_report
from vllm_metax.core import device as core_device, distribution, serving, tuned_config as tc
from vllm_metax.core.decisions import model_key
from vllm_metax.core.profile import (PROFILE_ENV, active_profile, config_mismatch, config_profile,
                                     profile_source, unservable_choices)
from vllm_metax.core.traffic import TRAFFIC_ENV
from vllm_metax.ops import device_backends, flashinfer_mla, flashinfer_prefill, flashmla

VLLM_VERSION = "0.33.0"
OK, NO, WARN = "ok", "no", "warn"


@dataclass
class Check:
    what: str
    status: str          # ok | no | warn
    detail: str


@dataclass
class Doctor:
    """Everything `mla-tune doctor` prints; `to_json()` for machines, `tables()` for people."""

    device: dict
    plugin: Check
    checks: list = field(default_factory=list)
    attention_backends: list = field(default_factory=list)     # Check per vLLM MLA backend
    flashinfer_backends: list = field(default_factory=list)    # Check per FlashInfer value
    tuned_config: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    def tables(self) -> list[Table]:
        cols = [Column("check", justify="left"), Column("status", justify="left"),
                Column("detail", justify="left", wrap=True)]
        summary = Table("Checks", cols)
        d = self.device
        summary.add("device", OK if d["source"] != "none" else NO,
                    f"{d['name']} (from {d['source']}; MetaX: {'yes' if d['is_metax'] else 'no'}; "
                    f"capability {d['capability'] or '-'}; SMs {d['sm_count'] or '-'})")
        summary.add("platform plugin", self.plugin.status, self.plugin.detail)
        for c in self.checks:
            summary.add(c.what, c.status, c.detail)
        backends = Table("MLA attention backends, in the order the plugin tries them", cols)
        for c in self.attention_backends:
            backends.add(c.what, c.status, c.detail)
        fi = Table("FlashInfer MLA backend values (plan-time choices)", cols)
        for c in self.flashinfer_backends:
            fi.add(c.what, c.status, c.detail)
        t = self.tuned_config
        tuned = Table("Tuned config", [Column("model", justify="left"), Column("tp"),
                                       Column("dims", justify="left"), Column("page size"),
                                       Column("backend order", justify="left"), Column("buckets"),
                                       Column("split-KV / FlashMLA / FA3 buckets"),
                                       Column("not on this profile")],
                      caption=f"{t.get('path') or 'no file'}: {t.get('reason', '')}")
        for e in t.get("entries", []):
            tuned.add(e["model"], e["tp_size"], e["dims"], e["page_size"],
                      " > ".join(e["backend_order"]), e["buckets"],
                      " / ".join(str(n) for n in e.get("side_buckets", {}).values()) or e.get("split_buckets", 0),
                      e.get("unservable", 0))
        return [summary, backends, fi, tuned]

    def render(self, fmt: str | OutputFormat) -> str | list:
        """json, csv, markdown -> text; table -> rich renderables."""
        return render(fmt, self.tables, "vllm_metax doctor", self.to_json,
                      lambda: "".join(to_csv(t) for t in self.tables()))


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _vllm_has_file(prefix: str) -> bool:
    """Whether vllm's installed files include one starting with `prefix` (without importing vllm)."""
    try:
        files = metadata.files("vllm") or []
    except metadata.PackageNotFoundError:
        return False
    return any(str(f).startswith(prefix) for f in files)


def _entry_point_check() -> Check:
    eps = [ep for ep in metadata.entry_points(group="vllm.platform_plugins") if ep.name == "metax"]
    if not eps:
        return Check("vLLM entry point", NO, "vllm.platform_plugins has no 'metax' entry "
                     "(install this project: pip install -e .)")
    values = sorted({ep.value for ep in eps})
    if values != ["vllm_metax:register"]:
        return Check("vLLM entry point", WARN, f"'metax' points at {', '.join(values)} "
                     "(another vllm_metax installed?)")
    return Check("vLLM entry point", OK, "metax = vllm_metax:register")


def _clash_check() -> Check:
    message = distribution.clash_message(distribution.other_owners())
    if message:
        return Check("vllm_metax package", WARN, message)
    return Check("vllm_metax package", OK, "installed by mla-tune only")


def _compiled_ops_check(dev) -> Check:
    """Where vLLM's compiled ops would come from (read from package metadata, nothing loaded)."""
    sources = []
    if dev.is_metax and importlib.util.find_spec("mcoplib") is not None:
        sources.append("mcoplib (MetaX)")
    if _vllm_has_file("vllm/_C_stable_libtorch"):
        sources.append("vllm/_C_stable_libtorch")
    if not sources:
        want = "MetaX's mcoplib" if dev.is_metax else "vllm==0.33.0's vllm/_C_stable_libtorch"
        return Check("compiled ops", NO, f"none installed: serving needs {want}")
    return Check("compiled ops", OK, ", ".join(sources))


def _vllm_check() -> Check:
    v = _version("vllm")
    if v is None:
        return Check("vllm", NO, f"not installed (the plugin targets vllm=={VLLM_VERSION})")
    if v != VLLM_VERSION:
        return Check("vllm", WARN, f"{v} installed; the plugin targets {VLLM_VERSION}")
    return Check("vllm", OK, v)


def _attention_backends(dev, flashinfer_ok: tuple[bool, str], order: list[str]) -> list[Check]:
    cap = dev.capability
    out = []
    for name in order:
        if name == "FLASHINFER_MLA":
            if not flashinfer_ok[0]:
                out.append(Check(name, NO, flashinfer_ok[1]))
            elif cap is not None and tuple(cap) < (8, 0):
                out.append(Check(name, NO, f"needs compute capability 8.0+, device has {cap}"))
            else:
                out.append(Check(name, OK if cap is not None else WARN,
                                 "vllm_metax's wrapper backend over " + flashinfer_ok[1]
                                 + ("" if cap is not None else "; no GPU visible to confirm")))
        elif name == "TRITON_MLA":
            has_triton = importlib.util.find_spec("triton") is not None
            has_vllm = _version("vllm") is not None
            why = "vLLM's Triton MLA with tuned num_kv_splits" if has_triton and has_vllm else \
                "needs " + " and ".join(n for n, ok in (("triton", has_triton), ("vllm", has_vllm)) if not ok)
            out.append(Check(name, OK if has_triton and has_vllm else NO, why))
        elif name == "FLASHMLA":
            out.append(_flashmla_check())
        else:
            out.append(Check(name, WARN, "not checked by the doctor"))
    return out


def _flashmla_check() -> Check:
    """FLASHMLA: the plugin's backend over its FlashMLA op (vLLM's library on Hopper, MetaX's
    flash_mla package on a MetaX GPU), at KV block 64 only."""
    library, why = flashmla.flashmla_library()
    if library is None:
        return Check("FLASHMLA", NO, why)
    where = "vLLM's FlashMLA library" if library == flashmla.VLLM_LIBRARY else "the flash_mla package"
    return Check("FLASHMLA", OK, f"vllm_metax's FlashMLA backend over {where} (KV block {flashmla.PAGE_SIZE})")


def _profile_check(config) -> Check:
    """The target profile the plugin runs (and why), and a config tuned under another one."""
    prof, why = profile_source()
    mismatch = config_mismatch(config, prof) if config is not None else None
    if mismatch:
        return Check("profile", WARN, f"{prof.name} ({why}); {mismatch}")
    return Check("profile", OK, f"{prof.name} ({why}): {prof.target}")


def _flashinfer_backends(probe: bool) -> list[Check]:
    fb = device_backends.device_flashinfer_backends()
    allowed, default = fb.allowed, fb.default
    try:
        accepted = flashinfer_mla.accepted_backends()
    except flashinfer_mla.FlashInferUnavailable as e:
        return [Check(b, NO, str(e)) for b in allowed]
    support = {}
    if probe:
        try:
            support = flashinfer_mla.backend_support()
        except Exception as e:  # a JIT failure is a finding, not a crash of the doctor
            return [Check("probe", NO, f"{type(e).__name__}: {e}")]
    out = []
    for b in accepted:
        tag = " (default)" if b == default else ""
        if b not in allowed:
            out.append(Check(b, NO, "not a plan-time choice on this device" + tag))
        elif probe:
            reason = support.get(b)
            out.append(Check(b, NO if reason else OK, (reason or "planned and ran a tiny batch") + tag))
        else:
            out.append(Check(b, OK, "a plan-time choice here (run with --probe to try it)" + tag))
    return out


def _tuned_config(device_name: str, dims) -> tuple[dict, list[str] | None]:
    res = tc.resolve_tuned_config(device_name)      # strict mode raises TunedConfigError
    info = {"device_name": device_name, "file_name": tc.config_filename(device_name),
            "path": str(res.path) if res.path else None, "reason": res.reason,
            "folders": [f"{why}: {folder}" for folder, why in tc.search_folders()],
            "strict": tc.strict_mode(), "entries": [],
            "profile": config_profile(res.config) if res.config is not None else None}
    order = None
    if res.config is not None:
        for m in res.config.models:
            d = m.dims
            info["entries"].append({
                "model": m.model, "tp_size": m.tp_size, "page_size": m.page_size,
                "dims": f"H{d.num_heads} ckv{d.kv_lora_rank} kpe{d.qk_rope_head_dim} {d.q_dtype}/{d.kv_dtype}",
                "backend_order": list(m.backend_order), "buckets": len(m.buckets),
                # buckets whose decode FLASHINFER_MLA runs with the split-KV Triton kernel
                "split_buckets": serving.split_buckets(m),
                # per kernel, buckets FLASHINFER_MLA's decode runs it in instead of FlashInfer
                "side_buckets": serving.side_buckets(m),
                # choices the active profile's target cannot run: served with the device default
                "unservable": len(unservable_choices(m, active_profile()))})
        if dims is not None:
            entry = serving.entry_for(res.config, dims).entry
            info["entry_for_model"] = entry is not None
            if entry is not None:
                order = list(entry.backend_order)
    return info, order


def model_dims(model: str | None, tp_size: int, dtype: str = "bfloat16"):
    """The tuned-config key of a model preset served at this tensor-parallel size."""
    if model is None:
        return None
    m = model_preset(model)
    return model_key(m.heads_per_rank(tp_size), m.kv_lora_rank, m.qk_rope_head_dim, dtype, dtype)


def traffic_check(path, device_name: str) -> Check:
    """How well the tuned config the plugin loads covers a recorded traffic: a warning where more
    than `traffic_view.WARN_SHARE` of its steps fall outside the tuned buckets or more than a grid
    step from them, or where no config serves it."""
    t = load_traffic(path)          # a bad file is bad input: one line, exit 2
    part = t.select()
    try:
        cfg = config_for_traffic(t.device_name or device_name)
        rep = traffic_report(part, entry_for_traffic(cfg, part), str(cfg.path))
    except InputError as e:
        return Check("traffic", WARN, f"{path}: {e}")
    gain = f"; expected attention {rep.speedup:.2f}x untuned" if rep.speedup else ""
    warning = rep.warning()
    if warning:
        return Check("traffic", WARN, f"{path} ({part.label}, {part.steps} steps): {warning}{gain}")
    return Check("traffic", OK, f"{path} ({part.label}, {part.steps} steps): "
                 f"{100 * rep.far_share:.1f}% of the steps outside or > 1 grid step from the "
                 f"tuned buckets{gain}")


def diagnose(model: str | None = None, tp_size: int = 1, probe: bool = False,
             traffic=None) -> Doctor:
    """Run every check (probing FlashInfer backends on the GPU only when asked; `traffic`: a
    recorded traffic file to judge the tuned config against, `traffic_check`)."""
    dims = model_dims(model, tp_size)
    dev = core_device.detect_device()
    active, why = vllm_metax.should_activate()
    device = {"name": dev.name, "source": dev.source, "is_metax": dev.is_metax,
              "sm_count": dev.sm_count,
              "capability": ".".join(map(str, dev.capability)) if dev.capability else None}
    names = (core_device.FORCE_ENV, tc.FOLDER_ENV, tc.STRICT_ENV, PROFILE_ENV, TRAFFIC_ENV)
    env = ", ".join(f"{k}={os.environ[k]}" for k in names if k in os.environ)
    checks = [_entry_point_check(), _clash_check(), _vllm_check(), _compiled_ops_check(dev),
              Check("environment", OK, env or f"none of {', '.join(names)} set")]
    fi = flashinfer_mla.flashinfer_available()
    checks.append(Check("flashinfer", OK if fi[0] else NO, fi[1]))
    pf = flashinfer_prefill.prefill_available()
    if pf[0]:
        pb = device_backends.device_prefill_backends()
        pf_detail = (f"{pf[1]}: plans {pb.default} untuned; a tuned config may choose "
                     f"{', '.join(pb.allowed)}")
    else:
        pf_detail = f"{pf[1]}: vLLM's torch prefill (slow) instead"
    checks.append(Check("MLA prefill", OK if pf[0] else WARN, pf_detail))

    tuned, tuned_order = _tuned_config(dev.name, dims)
    checks.append(_profile_check(tc.resolve_tuned_config(dev.name).config if tuned["path"] else None))
    order, _ = serving.mla_backend_order(tuned_order)
    if dims is not None:
        checks.append(Check("model", OK if tuned_order else WARN,
                            f"{model} at TP {tp_size}: H{dims.num_heads} per rank; "
                            + ("tuned entry found" if tuned_order else "no tuned entry: default order")))
    if traffic is not None:
        checks.append(traffic_check(traffic, dev.name))
    return Doctor(device, Check("platform plugin", OK if active else NO,
                                ("would activate: " if active else "would not activate: ") + why),
                  checks, _attention_backends(dev, fi, order), _flashinfer_backends(probe), tuned)
