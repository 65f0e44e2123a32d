"""The tuner's defaults, written once: the KV page sizes a sweep measures, the default page, and
the sample metrics a winner is chosen by and a plan is timed by."""

from __future__ import annotations

SWEEP_PAGE_SIZES = (1, 16, 64)   # KV page (vLLM block) sizes a default sweep measures
DEFAULT_PAGE_SIZE = 64           # what vLLM's MLA backends use unless told otherwise
KERNEL_METRIC = "kernel_us"      # samples of one kernel call (us): what winners are chosen by
PLAN_METRIC = "plan_us"          # samples of one plan (us)

__all__ = ["DEFAULT_PAGE_SIZE", "KERNEL_METRIC", "PLAN_METRIC", "SWEEP_PAGE_SIZES"]
