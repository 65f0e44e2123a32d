"""Dependencies point down only (README.md, "Layout"): every import of every module, the lazy
ones inside functions included, is checked against the layer order of the folders."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# mla_tune's layers, lowest first: a module may import its own layer and the ones before it.
MLA_TUNE_LAYERS = ["validate", "faults", "fault_points", "problem", "families", "measure", "store", "tune", "views", "cli"]
# vllm_metax, by folder (a new module is checked by the rules of the folder it lands in):
# core/ is vllm-free and cheap to import (the plugin reads its config at start-up, `import
# vllm_metax` registers it): the standard library only at module level, nothing of the plugin
# outside core/; ops/ is the vllm-free kernel path (torch, triton, FlashInfer): it imports core/
# and ops/ only (and vLLM's Triton MLA kernels, `VLLM_KERNELS`); the rest (the package's entry points, platform.py, worker.py, kernels.py,
# backend/) is the vLLM glue.
VLLM_FREE = ["vllm_metax.core", "vllm_metax.ops"]
STDLIB_ONLY = ["vllm_metax.core"]
# vLLM's own Triton MLA kernels, which ops/triton_launch.py launches unchanged with a vendor's
# settings (the tuner measures them so): the one part of vLLM an op may import, never its engine
VLLM_KERNELS = ["vllm.triton_utils", "vllm.v1.attention.ops.triton_decode_attention"]


def _modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _import_statements(name: str, path: Path, top_only: bool = False):
    """(line, absolute module name, names taken from it: None for `import m`) of every import
    statement in the file (`top_only`: only those run when the module is imported, not the lazy
    ones inside functions)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in (_run_at_import(tree) if top_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            yield node.lineno, mod, [a.name for a in node.names]


def _imports(name: str, path: Path, top_only: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the file (`top_only`: only
    those run when the module is imported, not the lazy ones inside functions)."""
    out = []
    for line, mod, names in _import_statements(name, path, top_only):
        # `from pkg import sub` imports pkg.sub when sub is a module
        out += [(line, mod)] if names is None else [(line, f"{mod}.{n}") for n in names] + [(line, mod)]
    return out


def _run_at_import(tree: ast.AST):
    """Every node executed when the module is imported: all but function bodies."""
    for child in ast.iter_child_nodes(tree):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from _run_at_import(child)


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "mla_tune":
        return None
    if len(parts) == 1 or parts[1] in ("__main__",):
        return len(MLA_TUNE_LAYERS)          # the package itself and `python -m mla_tune`: the top
    return MLA_TUNE_LAYERS.index(parts[1]) if parts[1] in MLA_TUNE_LAYERS else None


def _under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


MLA = _modules("mla_tune")
PLUGIN = _modules("vllm_metax")


def test_every_mla_tune_module_has_a_layer():
    loose = [m for m in MLA if _layer(m) is None]
    assert not loose, f"modules outside the layer folders {MLA_TUNE_LAYERS}: {loose}"


@pytest.mark.parametrize("name", sorted(MLA))
def test_mla_tune_imports_point_down(name):
    own = _layer(name)
    up = [f"line {line}: {mod}" for line, mod in _imports(name, MLA[name])
          if (lay := _layer(mod)) is not None and lay > own and not name.startswith(mod + ".")]
    assert not up, (f"{name} ({MLA_TUNE_LAYERS[own] if own < len(MLA_TUNE_LAYERS) else 'top'}) "
                    f"imports a higher layer: {up}")


@pytest.mark.parametrize("name", sorted(MLA))
def test_mla_tune_never_imports_vllm_at_module_level(name):
    bad = [line for line, mod in _imports(name, MLA[name], top_only=True) if _under(mod, ["vllm"])]
    assert not bad, f"{name} imports vllm at module level (lines {bad}); import it lazily"


@pytest.mark.parametrize("name", sorted(PLUGIN))
def test_plugin_never_imports_the_tuner(name):
    bad = [f"line {line}: {mod}" for line, mod in _imports(name, PLUGIN[name]) if _under(mod, ["mla_tune"])]
    assert not bad, f"{name} imports mla_tune: {bad}"


@pytest.mark.parametrize("name", sorted(m for m in PLUGIN if _under(m, VLLM_FREE)))
def test_vllm_free_plugin_modules(name):
    bad = [f"line {line}: {mod}" for line, mod in _imports(name, PLUGIN[name])
           if (_under(mod, ["vllm"]) and not _under(mod, VLLM_KERNELS))
           or (_under(mod, ["vllm_metax"]) and not _under(mod, VLLM_FREE))]
    assert not bad, f"{name} must stay vllm-free (and import only vllm-free modules): {bad}"


@pytest.mark.parametrize("name", sorted(m for m in PLUGIN if _under(m, STDLIB_ONLY)))
def test_stdlib_only_plugin_modules(name):
    bad = [f"line {line}: {mod}" for line, mod in _imports(name, PLUGIN[name], top_only=True)
           if mod.split(".")[0] not in sys.stdlib_module_names and mod != "__future__"
           and not _under(mod, STDLIB_ONLY)]
    assert not bad, f"{name} must import the standard library only: {bad}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check itself can fail: a lazy import of the CLI inside a problem-layer function."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from mla_tune.cli.app import app\n    from . import workload\n")
    found = _imports("mla_tune.problem.m", f)
    assert (2, "mla_tune.cli.app") in found and (3, "mla_tune.problem.workload") in found
    assert _layer("mla_tune.cli.app") > _layer("mla_tune.problem.m")


# ---------------------------------------------------------------- cycles and sizes (issue #40)

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _dependencies(name: str, path: Path, modules) -> set[str]:
    """The modules of `modules` that `name` imports, the lazy imports inside functions included:
    `from pkg import sub` depends on the module pkg.sub, `from pkg import thing` on pkg."""
    out = set()
    for _, mod, names in _import_statements(name, path):
        subs = [f"{mod}.{n}" for n in names] if names else []
        out.update(s for s in subs if s in modules)
        if names is None or any(s not in modules for s in subs):
            out.add(mod)
    return (out & set(modules)) - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", ["mla_tune", "vllm_metax"])
def test_no_import_cycle(package):
    """No two modules of a package import each other, directly or round a longer loop, the lazy
    imports inside functions counted too: within one folder as much as across folders (in
    vllm_metax: the package's entry points and the modules below them included)."""
    modules = {"mla_tune": MLA, "vllm_metax": PLUGIN}[package]
    graph = {name: _dependencies(name, path, modules) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, f"import cycles among {package} modules: " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_cycle(tmp_path):
    """The check itself can fail: a lazy import back from a module that the first imports, in one
    folder, and `from pkg import sub` counted as an import of the module pkg.sub."""
    (tmp_path / "a.py").write_text("from mla_tune.tune import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from mla_tune.tune.a import thing\n")
    mods = {"mla_tune.tune.a": tmp_path / "a.py", "mla_tune.tune.b": tmp_path / "b.py",
            "mla_tune.tune": tmp_path / "__init__.py"}
    graph = {n: _dependencies(n, p, mods) for n, p in mods.items() if p.exists()}
    assert graph == {"mla_tune.tune.a": {"mla_tune.tune.b"}, "mla_tune.tune.b": {"mla_tune.tune.a"}}
    assert _cycles(graph) == [["mla_tune.tune.a", "mla_tune.tune.b"]]
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []


def test_the_cycle_check_sees_a_name_taken_from_a_package(tmp_path):
    """vllm_metax's old cycle: a module takes a constant from the package (`from pkg import
    thing` depends on pkg), whose entry point imports that module back inside a function."""
    (tmp_path / "__init__.py").write_text("def register():\n    from vllm_metax.platform import f\n")
    (tmp_path / "platform.py").write_text("from vllm_metax import FLASHINFER_MLA_CLASS\n")
    mods = {"vllm_metax": tmp_path / "__init__.py", "vllm_metax.platform": tmp_path / "platform.py"}
    graph = {n: _dependencies(n, p, mods) for n, p in mods.items()}
    assert _cycles(graph) == [["vllm_metax", "vllm_metax.platform"]]


def _sizes(path: Path) -> tuple[int, list[tuple[str, int, int]]]:
    """The module's line count and (name, first line, lines) of every function and method in it."""
    text = path.read_text()
    funcs = [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
             for node in ast.walk(ast.parse(text, str(path)))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return len(text.splitlines()), funcs


@pytest.mark.parametrize("name", sorted({**MLA, **PLUGIN}))
def test_modules_and_functions_stay_small(name):
    """A module holds one idea and a function one step, in mla_tune and vllm_metax alike: no
    module over MAX_MODULE_LINES lines, no function (methods, Triton kernels) over
    MAX_FUNCTION_LINES (split by idea, not by cutting anywhere)."""
    lines, funcs = _sizes({**MLA, **PLUGIN}[name])
    long = [f"{f} (line {at}: {n} lines)" for f, at, n in funcs if n > MAX_FUNCTION_LINES]
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines (at most {MAX_MODULE_LINES})"
    assert not long, f"{name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_size_check_sees_a_long_function(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "\n\nclass C:\n    def g(self):\n        pass\n")
    lines, funcs = _sizes(f)
    assert lines == MAX_FUNCTION_LINES + 6
    assert ("f", 1, MAX_FUNCTION_LINES + 1) in funcs and ("g", MAX_FUNCTION_LINES + 5, 2) in funcs


@pytest.mark.parametrize("name", sorted({**MLA, **PLUGIN}))
def test_no_module_hands_out_other_modules_names(name):
    """No facade: a module-level __getattr__ would serve names defined elsewhere past the import
    checks above; every caller imports a name from the module that defines it (mla_tune and
    vllm_metax alike)."""
    tree = ast.parse({**MLA, **PLUGIN}[name].read_text())
    assert not [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"], \
        f"{name} defines a module-level __getattr__"


@pytest.mark.parametrize("name", sorted({**MLA, **PLUGIN}))
def test_no_private_name_crosses_a_module(name):
    """A name another module needs is public in the module that defines it: no mla_tune or
    vllm_metax module imports an underscore name from another of its package."""
    package = name.split(".")[0]
    bad = [f"line {line}: {mod}.{n}" for line, mod, names in _import_statements(name, {**MLA, **PLUGIN}[name])
           if _under(mod, [package]) for n in names or ()
           if n.startswith("_") and not n.startswith("__")]
    assert not bad, f"{name} imports private names: {bad}"
