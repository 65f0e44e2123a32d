"""The tuned config: one stdlib-only package shared by the writer (`mla-tune emit`) and the reader
(the vLLM plugin, at backend selection and at plan time). Import it as a whole
(`from vllm_metax.core import tuned_config as tc`); its parts:

* `schema`: the dataclasses (TunedConfig, ModelEntry, Bucket, ...), the nearest-bucket lookups
  inside an entry, and the bounds every value is checked against;
* `parse`: a decoded document -> TunedConfig, or one TunedConfigError naming the problem;
* `files`: file names, reading and atomic writing;
* `discovery`: where the plugin finds a device's file, strict mode, the per-process copy.

Which entry of a config a server runs with is decided in `vllm_metax.core.serving`.
"""

from __future__ import annotations

from vllm_metax.core.tuned_config.discovery import (  # noqa: F401
    FOLDER_ENV, PACKAGED_ENV, PACKAGED_FOLDER, STRICT_ENV, Resolution, clear_cache, load_tuned_config,
    resolve_tuned_config, search_folders, strict_mode,
)
from vllm_metax.core.tuned_config.files import (  # noqa: F401
    MAX_CONFIG_BYTES, MAX_JSON_DEPTH, check_config_target, config_filename, creatable_folder,
    is_own_config, read_text_file, read_tuned_config, write_tuned_config,
)
from vllm_metax.core.tuned_config.parse import (  # noqa: F401
    check_device_name, check_page_size, check_params, check_prefill_params, parse_tuned_config,
)
from vllm_metax.core.tuned_config.schema import (  # noqa: F401
    ATTENTION_BACKENDS, DTYPES, FAMILIES, FLASHINFER_PREFILL_BACKENDS, MAX_BATCH, MAX_CONTEXT,
    MAX_HEAD_DIM, MAX_HEADS, MAX_NAME, MAX_PREFILL_TOKENS, MAX_Q_LEN, PAGE_SIZES, PREFILL_BACKENDS,
    SCHEMA_VERSION, VLLM_FA3_PREFILL, Bucket, FamilyChoice, Lookup, ModelDims, ModelEntry,
    PrefillBucket, TunedConfig, TunedConfigError, speedup,
)
