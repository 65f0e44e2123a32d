"""Which tuned entry a server runs with, and in which order it tries the MLA attention backends:
the plugin's start-up policy, vllm-free. The platform and the attention backends (through
`vllm_metax.backend.served_entry`, which reads vLLM's config), the Triton backend's split counts,
`mla-tune doctor` and the bench scripts all look a config entry up here and nowhere else.

* `entry_for`: the one lookup. An entry serves the model whose key it was tuned for
  (`decisions.model_key`: heads per rank, ranks, dtypes), unless the KV block size was fixed
  (vLLM's --block-size) at another page size than the entry's: every choice in an entry was
  measured at its page size, so then nothing of it serves. Where the user fixed none, the
  platform sets the KV block size to the entry's page size.
* `mla_backend_order`: the tuned entry's backend order first, the defaults after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_metax.core import choices, decisions
from vllm_metax.core.profile import NVIDIA, PROFILES, target_profile
from vllm_metax.core.tuned_config import ModelDims, ModelEntry, TunedConfig

# MLA backends by priority when no tuned config decides, per profile (`Profile.mla_order`). On
# NVIDIA: FLASHINFER_MLA (ours: wrapper-based fa2/fa3), FLASHMLA, TRITON_MLA; on MetaX the vendor
# plugin's order, FLASHMLA then TRITON_MLA, before ours.
DEFAULT_MLA_ORDER = PROFILES[NVIDIA].mla_order


def mla_backend_order(tuned_order: list[str] | None = None, profile=None) -> tuple[list[str], str]:
    """The MLA backends to try, best first, and why: a tuned order first, the profile's defaults
    (default: the active profile's) after it, so a backend the tuned order lists that cannot run
    still has a fallback."""
    prof = target_profile(profile)
    if not tuned_order:
        why = "default MLA order" + (f" ({prof.name} profile)" if prof.name != NVIDIA else "")
        return list(prof.mla_order), why
    return list(dict.fromkeys(list(tuned_order) + list(prof.mla_order))), "tuned config"


@dataclass(frozen=True)
class Served:
    """What `entry_for` found: the entry that serves (None: the server runs untuned) and one line
    saying which, or why none does (for the server log and `mla-tune doctor`)."""

    entry: ModelEntry | None
    why: str


def entry_for(config: TunedConfig, dims: ModelDims, block_size: int | None = None) -> Served:
    """The entry of `config` a model keyed `dims` runs with. `block_size`: the KV block size the
    user fixed (vLLM's --block-size), None where the plugin may set it; a fixed size other than
    the entry's page size serves nothing of the entry."""
    entry = next((m for m in config.models if m.dims == dims), None)
    if entry is None:
        return Served(None, f"{config.path} has no entry for this model ({describe_dims(dims)}; it "
                            f"has {'; '.join(describe_dims(m.dims) for m in config.models) or 'none'}): "
                            "serving untuned")
    if block_size is not None and block_size != entry.page_size:
        return Served(None, f"--block-size {block_size} differs from the page size {entry.page_size} "
                            f"the tuned config {config.path} was measured at: serving untuned (drop "
                            "--block-size to use it)")
    return Served(entry, f"tuned entry {describe_entry(entry)}")


def split_buckets(entry: ModelEntry) -> int:
    """The entry's decode buckets whose FLASHINFER_MLA step runs the split-KV kernel."""
    return side_buckets(entry)[SIDE_KERNEL_NAMES[choices.SPLIT]]


SIDE_KERNEL_NAMES = {choices.SPLIT: "split-KV", choices.FLASHMLA: "FlashMLA", choices.FA3: "vLLM FA3"}


def side_buckets(entry: ModelEntry, profile=None) -> dict[str, int]:
    """Per kernel that FLASHINFER_MLA's decode runs instead of FlashInfer (split-KV, FlashMLA,
    vLLM FA3), how many of the entry's buckets it serves (`decisions.flashinfer_mla_kernel` of a
    step of the bucket at the entry's page size; the rest plan FlashInfer)."""
    counts = dict.fromkeys(SIDE_KERNEL_NAMES.values(), 0)
    for b in entry.buckets:
        served = decisions.flashinfer_mla_kernel(b, b.q_len, page_size=entry.page_size, profile=profile)
        if served.family != choices.FLASHINFER:
            counts[SIDE_KERNEL_NAMES[served.family]] += 1
    return counts


def describe_dims(dims: ModelDims) -> str:
    """A model key for people: heads, ranks, dtypes."""
    return (f"{dims.num_heads} heads, kv_lora_rank {dims.kv_lora_rank}, rope {dims.qk_rope_head_dim}, "
            f"{dims.q_dtype}/{dims.kv_dtype}")


def describe_entry(entry: ModelEntry) -> str:
    """One line: what a tuned entry sets (for the server log and `mla-tune doctor`)."""
    who = f"{entry.model} TP{entry.tp_size}" if entry.model else "no model named"
    return (f"{describe_dims(entry.dims)} ({who}): KV page size {entry.page_size}, backend order "
            f"{' > '.join(entry.backend_order) or 'default'}, {len(entry.buckets)} decode buckets "
            f"({_side_text(entry)}), {len(entry.prefill)} prefill buckets")


def _side_text(entry: ModelEntry) -> str:
    counts = side_buckets(entry)
    rest = len(entry.buckets) - sum(counts.values())
    return ", ".join([f"{name} in {n}" for name, n in counts.items() if n] + [f"FlashInfer in {rest}"])
