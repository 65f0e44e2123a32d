"""One definition of each family's knobs (vllm_metax.core.choices): the tuner's candidate check, bench,
the tuned-config reader and the plugin's typed choices agree, and the split kernel's facts are
the kernel's own (vllm_metax.core.split_facts), not restated."""

import ast
from pathlib import Path

import pytest

from mla_tune.families import Candidate, check_candidate
from mla_tune.tune.bench import parse_candidates
from mla_tune.validate import InputError
from vllm_metax.core import choices
from vllm_metax.core import tuned_config as tc
from vllm_metax.core import split_facts

ROOT = Path(__file__).resolve().parent.parent


def test_bench_takes_the_kv_chunk_candidates_the_sweep_measures():
    cands = parse_candidates(["flashinfer/fa3/p64/kv_chunk=x0.5", "flashinfer/fa2/p64/kv_chunk=none",
                              "flashinfer/fa3/p64"])
    assert [c.key for c in cands] == ["flashinfer/fa3/p64/kv_chunk=x0.5", "flashinfer/fa2/p64/kv_chunk=none",
                                      "flashinfer/fa3/p64"]
    with pytest.raises(InputError, match=r"kv_chunk must be one of x0.25, x0.5, x2, x4, none, got 'x3'"):
        parse_candidates(["flashinfer/fa3/p64/kv_chunk=x3"])
    with pytest.raises(InputError, match=r"'stages'.*flashinfer/<backend>/p<page>\[/kv_chunk="):
        parse_candidates(["flashinfer/fa3/p64/stages=3"])


def test_every_candidate_the_sweep_can_declare_is_a_config_the_plugin_serves():
    """A candidate's plan params ({"backend", **knobs}) pass the tuned-config check and read into
    the same typed choice that `mla-tune emit` writes back."""
    texts = [f"flashinfer/{b}/p64/kv_chunk={k}" for b in ("fa2", "fa3") for k in choices.KV_CHUNKS]
    texts += [f"split/triton/p64/num_splits=8,partial={p},pipe={pipe}"
              for p in choices.SPLIT_PARTIALS for pipe in choices.SPLIT_PIPES]
    texts += ["triton/triton/p16/num_kv_splits=8", "triton/triton/p16/num_kv_splits=4,rule=vllm",
              "flashmla/flashmla/p64", "flashinfer/fa3/p16"]
    for text in texts:
        c = check_candidate(Candidate.parse(text))
        params = {"backend": c.backend, **c.params}
        typed = choices.candidate_choice(c.family, c.backend, c.params, text)
        assert tc.check_params(c.family, dict(params), text) == params
        assert choices.check_params(c.family, typed.to_params(), text) == typed
        if c.family != "flashmla":
            assert choices.family_choice(c.family, params) == typed


@pytest.mark.parametrize("family, params, bad, legal", [
    ("flashinfer", {"backend": "fa9"}, "'fa9'", "fa2, fa3"),
    ("flashinfer", {"backend": "fa3", "kv_chunk": "x8"}, "'x8'", "x0.25, x0.5"),
    ("split", {"backend": "triton", "num_splits": 8, "partial": "fp8"}, "'fp8'", "bfloat16, float32"),
    ("split", {"backend": "triton", "num_splits": 8, "partial": "float32", "pipe": "t16"}, "'t16'",
     "t64, t32x4, t64-pdl, t32x4-pdl"),
    ("split", {"backend": "triton", "num_splits": 5000, "partial": "float32"}, "5000", "1..1056"),
    ("triton", {"num_kv_splits": 300}, "300", "1..256"),
    ("triton", {"num_kv_splits": 8, "rule": "mine"}, "'mine'", "'vllm'"),
    ("flashmla", {"backend": "fa3"}, "'fa3'", "'flashmla'"),
])
def test_refusals_are_one_line_naming_the_value_and_the_legal_ones(family, params, bad, legal):
    with pytest.raises(choices.ChoiceError) as e:
        choices.check_params(family, params, "here")
    msg = str(e.value)
    assert "\n" not in msg and bad in msg and legal in msg and msg.startswith("here: ")
    with pytest.raises(tc.TunedConfigError, match="^here: "):
        tc.check_params(family, params, "here")


def test_the_split_kernel_facts_have_one_definition():
    from vllm_metax.ops import split_decode
    assert split_decode.PIPES is split_facts.PIPES and split_decode.MAX_PROGRAMS == choices.MAX_SPLITS
    assert choices.SPLIT_PIPES == tuple(split_facts.PIPES) and choices.DEFAULT_SPLIT_PIPE == split_facts.SERVED_PIPE
    assert choices.SPLIT_PARTIALS is split_facts.PARTIAL_DTYPES
    # no other module assigns these names
    for path in [*(ROOT / "vllm_metax").rglob("*.py"), *(ROOT / "mla_tune").rglob("*.py")]:
        if path.name == "split_facts.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                assert not names & {"MAX_PROGRAMS", "PIPES", "SERVED_PIPE", "PARTIAL_DTYPES"}, path


# ---------------------------------------------------------------- the spec of each kernel family

@pytest.mark.parametrize("backend", ["auto", "cutlass", "trtllm-gen"])
def test_a_kv_chunk_with_a_backend_that_ignores_it_is_refused_not_dropped(backend):
    """kv_chunk is the plugin's own schedule for fa2/fa3 (`KernelSpec.chunked_backends`): with any
    other backend it would be ignored at plan time, so the reader and the candidate check refuse it;
    the lenient reading serves the backend without it."""
    params = {"backend": backend, "kv_chunk": "x2"}
    with pytest.raises(tc.TunedConfigError, match=r"kv_chunk is taken by backend fa2 or fa3 only"):
        tc.check_params("flashinfer", dict(params), "bucket")
    with pytest.raises(ValueError, match=r"kv_chunk is taken by backend fa2 or fa3 only"):
        check_candidate(Candidate.parse(f"flashinfer/{backend}/p64/kv_chunk=x2"))
    assert choices.family_choice("flashinfer", params) == choices.FlashInferChoice(backend)


@pytest.mark.parametrize("text, rule", [("triton/triton/p8/num_kv_splits=4", "a multiple of 16"),
                                        ("fa3_mla/fa3/p8/num_splits=0", "a multiple of 16"),
                                        ("flashmla/flashmla/p16", "64")])
def test_the_candidate_check_applies_each_kernels_page_rule(text, rule):
    with pytest.raises(ValueError, match=f"runs at page {rule}, not"):
        check_candidate(Candidate.parse(text))


def test_every_reader_takes_the_page_rule_and_chunked_backends_from_the_spec():
    """One spec per kernel family: the ops, the families, the sweep's JIT prebuild and the
    attention-backend order read it (no second copy to drift)."""
    from mla_tune.families import fa3_mla as fa3_family, flashinfer as fi_family, split, triton_mla
    from mla_tune.measure import jit_prebuild
    from mla_tune.tune import choose
    from vllm_metax.ops import fa3_mla, fast_replan, flashmla
    spec = choices.SPECS
    assert flashmla.PAGE_SIZE == spec["flashmla"].page.only == 64
    assert fa3_mla.PAGES is spec["fa3_mla"].page is fa3_family.SPEC.page
    assert triton_mla.PAGES is spec["triton"].page and split.PAGE == 64
    assert fast_replan.BACKENDS is fi_family.SPEC.chunked_backends
    assert set(jit_prebuild.BACKENDS) >= set(fast_replan.BACKENDS)    # the modules it plans are built
    assert choose.backend_order(("flashinfer", "triton", "flashmla"), 64) == \
        ("FLASHINFER_MLA", "TRITON_MLA", "FLASHMLA")
    assert choose.backend_order(("flashinfer", "triton", "flashmla"), 8) == ("FLASHINFER_MLA",)
    assert [s.family for s in spec.values() if s.decode_lse] == ["flashinfer"]
