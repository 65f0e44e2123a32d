import math

import pytest

from mla_tune.problem.workload import (ModelDims, ProblemError, Workload, WorkloadMix, custom_model, log2_grid,
                              model_preset, preset_names, ragged_lengths, workload_for, yarn_get_mscale)


def test_deepseek_v3_dims_and_yarn_scale():
    m = model_preset("DeepSeek-V3")
    assert (m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim) == (128, 512, 64, 128)
    mscale = 0.1 * 1.0 * math.log(40) + 1.0
    assert m.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert m.softmax_scale != pytest.approx(576 ** -0.5)


def test_presets_present():
    names = preset_names()
    for n in ("deepseek-v3", "deepseek-r1", "deepseek-v2-lite", "kimi-k2"):
        assert n in names
    assert model_preset("deepseek-v2-lite").num_heads == 16
    assert model_preset("kimi-k2").num_heads == 64


def test_tp_divides_heads():
    m = model_preset("deepseek-v3")
    assert m.heads_per_rank(8) == 16
    with pytest.raises(ProblemError, match="does not divide"):
        m.heads_per_rank(3)


def test_unknown_preset():
    with pytest.raises(ProblemError, match="unknown model"):
        model_preset("llama")


def test_yarn_mscale_identity_below_1():
    assert yarn_get_mscale(1.0, 1.0) == 1.0


def test_workload_validation():
    with pytest.raises(ProblemError):
        Workload(16, 512, 64, 0.1, batch_size=0, context_len=10)
    with pytest.raises(ProblemError):
        Workload(16, 512, 64, 0.1, batch_size=1, context_len=10, q_len=11)
    with pytest.raises(ProblemError):
        Workload(16, 512, 64, 0.1, batch_size=1, context_len=10, kv_dtype="int3")


def test_ragged_reproducible_and_bounded():
    a = ragged_lengths("lognormal", 64, 4096, 1, seed=5)
    assert a == ragged_lengths("lognormal", 64, 4096, 1, seed=5)
    assert min(a) >= 1 and max(a) <= 4 * 4096 and len(set(a)) > 10
    u = ragged_lengths("uniform-random", 64, 100, 4, seed=1)
    assert min(u) >= 4 and max(u) <= 196


def test_workload_for_and_custom():
    w = workload_for(model_preset("deepseek-v3"), 8, 32, 4096)
    assert w.num_heads == 16 and w.total_kv_tokens == 32 * 4096
    c = custom_model(num_heads=32, kv_lora_rank=256)
    assert c.kv_lora_rank == 256 and c.softmax_scale == pytest.approx(192 ** -0.5)
    with pytest.raises(ProblemError):
        custom_model(num_heads=0)


def test_log2_grid():
    assert log2_grid(1, 128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert log2_grid(1000, 5000) == [1024, 2048, 4096]
    with pytest.raises(ProblemError):
        log2_grid(8, 4)


def test_workload_mix_file(tmp_path):
    f = tmp_path / "mix.csv"
    f.write_text("batch,context,weight\n1,1024,3\n64,8192,1\n")
    mix = WorkloadMix.from_file(str(f))
    assert mix.weight(1, 1024) == 3 and mix.weight(2, 2) == 0
    f.write_text("1,1024,x\n2,3,4\n")
    with pytest.raises(ProblemError, match="mix.csv:1: expected batch,context,weight"):
        WorkloadMix.from_file(str(f))      # a header has no numbers: this is a bad row
    for bad, why in (("1,1024,nan\n", "weight"), ("1,1024,inf\n", "weight"),
                     ("1,1024,-1\n", "weight"), ("0,1024,1\n", "batch"),
                     ("1," + "9" * 5000 + ",1\n", "expected"), ("1,1024,1\n1,1024,2\n", "twice")):
        f.write_text(bad)
        with pytest.raises(ProblemError, match=why):
            WorkloadMix.from_file(str(f))
    f.write_bytes(b"\xff\xfe1,2,3\n")
    with pytest.raises(ProblemError, match="not UTF-8"):
        WorkloadMix.from_file(str(f))
    with pytest.raises(ProblemError, match="not a regular file"):
        WorkloadMix.from_file("/dev/zero")
    f.write_text("1,2,3\nbad\n")
    with pytest.raises(ProblemError, match="expected batch,context,weight"):
        WorkloadMix.from_file(str(f))
    with pytest.raises(ProblemError, match="cannot read"):
        WorkloadMix.from_file(str(tmp_path / "missing.csv"))
