"""On a real Hopper GPU (pytest -m gpu): the modules FlashInfer loads when the plugin's kernels plan
every value a shipped config serves are exactly the ones `mla-tune prebuild` names, so a prebuild
leaves nothing for the server to compile (the names, dtypes and index types cannot drift)."""

from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

CONFIG = Path(__file__).resolve().parent.parent / "vllm_metax" / "configs" / "device_name=NVIDIA_H200.json"


def test_the_plugins_plans_load_exactly_the_prebuilt_modules(monkeypatch):
    if torch.cuda.get_device_capability(0)[0] != 9:
        pytest.skip("the shipped configs are Hopper's")
    from flashinfer import prefill
    from flashinfer.jit import core
    from flashinfer.mla._batch_mla._backends import _fa_common

    from mla_tune.measure import served_prebuild as sp
    from vllm_metax.core import tuned_config as tc
    from vllm_metax.ops.flashinfer_mla import MLADecodeKernel, make_workspace
    from vllm_metax.ops.flashinfer_prefill import MLAPrefillKernel
    from vllm_metax.ops.paged_metadata import build_paged_metadata

    modules = sp.served_modules(tc.read_tuned_config(CONFIG).models,
                                sp.resolve_target(None))
    loaded, build_and_load = [], core.JitSpecNvcc.build_and_load

    def recording(spec):
        loaded.append(spec.name)
        return build_and_load(spec)

    monkeypatch.setattr(core.JitSpecNvcc, "build_and_load", recording)
    _fa_common.get_batch_mla_module.cache_clear()       # load again, through the recorder
    prefill.get_batch_prefill_module.cache_clear()
    ws = make_workspace("cuda")
    for m in modules:
        if m.kind == "decode":
            table = torch.arange(8, dtype=torch.int32, device="cuda").reshape(2, 4)
            meta = build_paged_metadata(table, np.array([100, 200], dtype=np.int32), 64, 1)
            MLADecodeKernel(ws, m.backend).plan(meta, 16, *m.dims, 64, False, 0.1,
                                                torch.bfloat16, torch.bfloat16)
        else:
            qo = torch.tensor([0, 37, 300], dtype=torch.int32)
            MLAPrefillKernel(ws, m.backend).plan(qo, qo, 16, *m.dims, True, 0.1, torch.bfloat16,
                                                 torch.bfloat16)
    assert sorted(set(loaded)) == sorted(m.name for m in modules)
    assert all(m.built() for m in modules)
