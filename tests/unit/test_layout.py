"""The library's layout, as docs/architecture.md describes it: who may import whom, no cycles, small files.

Imports are read from the source (ast), those inside functions and under
TYPE_CHECKING included, so a rule cannot be dodged by importing late.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "umakit"
MAX_LINES = 400

# Layers, bottom up; a module may import its own layer and the layers its rule names (always `umakit.errors`).
FOUNDATIONS = ("umakit.errors", "umakit.core")
ARITHMETIC = ("umakit.plan.roofline", "umakit.plan.shapes", "umakit.plan.placement")
SAMPLING = ("umakit.generate.sampling", "umakit.generate.lookup")
ENGINE_BASE = ("=umakit.backends", "umakit.backends.base", "umakit.backends.common")  # "=": that module alone
BELOW_ENGINES = (*FOUNDATIONS, *ARITHMETIC, *SAMPLING, "umakit.hardware", "umakit.checkpoint")
ENGINES = ("umakit.backends.torch", "umakit.backends.mlx", "umakit.backends.transformers", "umakit.backends.distributed")
FEATURES = ("umakit.api", "umakit.generate", "umakit.serve", "umakit.bench", "umakit.evaluate",
            "umakit.quantize.pipeline", "umakit.plan.planner", "umakit.plan.parallel")

# module prefix -> the prefixes it may import (the first rule whose prefix matches a module applies)
RULES = [
    ("umakit.errors", ()),
    ("umakit.core", FOUNDATIONS),
    ("umakit.generate.sampling", FOUNDATIONS),
    ("umakit.generate.lookup", (*FOUNDATIONS, "umakit.generate.sampling")),
    ("umakit.plan.roofline", (*FOUNDATIONS, *ARITHMETIC)),
    ("umakit.plan.shapes", (*FOUNDATIONS, *ARITHMETIC)),
    ("umakit.plan.placement", (*FOUNDATIONS, *ARITHMETIC)),
    ("umakit.hardware", (*FOUNDATIONS, "umakit.hardware")),
    ("umakit.checkpoint", (*FOUNDATIONS, "umakit.checkpoint")),
    ("umakit.evaluate", (*FOUNDATIONS, "umakit.evaluate")),
    ("umakit.quantize.recipes", (*FOUNDATIONS, "umakit.quantize.tensor")),
    ("umakit.quantize.tensor", FOUNDATIONS),
    # an engine: what is below it, the protocol and its own package (mlx also quantizes on load); never
    # another engine's package, never a feature
    ("umakit.backends.torch", (*BELOW_ENGINES, *ENGINE_BASE, "umakit.backends.torch")),
    ("umakit.backends.mlx", (*BELOW_ENGINES, *ENGINE_BASE, "umakit.backends.mlx", "umakit.quantize.recipes")),
    # transformers' model classes with the torch engine's sampler and quantized execution forms around them
    ("umakit.backends.transformers", (*BELOW_ENGINES, *ENGINE_BASE, "umakit.backends.transformers",
                                      "umakit.backends.torch")),
    # the sharded engines extend both engines through their declared hooks
    ("umakit.backends.distributed", (*BELOW_ENGINES, *ENGINE_BASE, *ENGINES)),
    ("umakit.backends.base", (*BELOW_ENGINES, *ENGINE_BASE)),
    ("umakit.backends.common", (*BELOW_ENGINES, *ENGINE_BASE)),
    # the registry reads each engine package's SPEC (importing the engine itself only when chosen)
    ("umakit.backends", (*BELOW_ENGINES, *ENGINE_BASE, *ENGINES)),
    # features: everything below the engines, the registry and the protocol; never an engine's package
    ("umakit.generate", (*BELOW_ENGINES, *ENGINE_BASE, "umakit.generate")),
    ("umakit.api", (*BELOW_ENGINES, *ENGINE_BASE, "umakit.generate", "umakit.plan")),
    ("umakit.plan", (*BELOW_ENGINES, *ENGINE_BASE, "umakit.plan", "umakit.quantize.recipes")),
    ("umakit.evaluate", (*BELOW_ENGINES, "umakit.evaluate")),
    ("umakit.bench", (*BELOW_ENGINES, *ENGINE_BASE, "umakit.api", "umakit.bench", "umakit.plan", "umakit.generate")),
    ("umakit.quantize", (*BELOW_ENGINES, *ENGINE_BASE, "umakit.api", "umakit.quantize", "umakit.evaluate")),
    ("umakit.serve", (*BELOW_ENGINES, *ENGINE_BASE, "umakit.serve", "umakit.generate")),
    # the CLI may import anything in the library; the package's own __init__ (the public API) too
    ("umakit.cli", ("umakit",)),
    ("umakit", ("umakit",)),
]


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


@cache
def imports() -> dict[str, set[str]]:
    """module -> the umakit modules it imports, anywhere in its source."""
    mods = modules()
    out = {}
    for name, f in mods.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    cand = f"{node.module}.{a.name}"
                    found.add(cand if cand in mods else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        out[name] = {t for t in found if t == "umakit" or t.startswith("umakit.")}
    return out


def within(module: str, prefix: str) -> bool:
    if prefix.startswith("="):
        return module == prefix[1:]
    return module == prefix or module.startswith(prefix + ".")


def rule(module: str) -> tuple[str, ...]:
    return next(allowed for prefix, allowed in RULES if within(module, prefix))


def test_every_module_imports_only_what_its_layer_may():
    broken = [f"{m} imports {t}" for m, targets in sorted(imports().items()) for t in sorted(targets)
              if not within(t, m) and not any(within(t, p) for p in (*rule(m), "umakit.errors"))]
    assert broken == []


def test_the_rules_can_fail():
    """A feature importing an engine's package, and an engine importing a feature, are both caught."""
    assert not any(within("umakit.backends.torch.engine", p) for p in rule("umakit.serve.scheduler"))
    assert not any(within("umakit.generate.stream", p) for p in rule("umakit.backends.mlx.engine"))
    assert any(within("umakit.backends.base", p) for p in rule("umakit.serve.scheduler"))


def test_no_import_cycles():
    """Among modules (a package's __init__, which re-exports its children, is not counted as their dependency)."""
    mods = modules()
    inits = {m for m, f in mods.items() if f.name == "__init__.py"}
    graph = {m: {t for t in ts if t in mods and t not in inits and not m.startswith(t + ".")}
             for m, ts in imports().items() if m not in inits}
    seen, stack, cycles = {}, [], []

    def visit(m):  # depth-first; a back edge to a module on the stack closes a cycle
        seen[m] = "open"
        stack.append(m)
        for t in graph.get(m, ()):
            if seen.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in seen:
                visit(t)
        stack.pop()
        seen[m] = "done"

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    assert cycles == []


@pytest.mark.parametrize("name", sorted(modules()))
def test_library_files_stay_small(name):
    lines = modules()[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name}: {lines} lines; split it by concern"


def test_only_the_cli_imports_click_or_prints():
    for name, f in modules().items():
        if within(name, "umakit.cli"):
            continue
        tree = ast.parse(f.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "click" not in imported, name
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        assert not any(c.func.id == "print" for c in calls), name


def test_no_two_modules_share_a_name_unless_they_do_the_same_thing_for_each_engine():
    """A module name used twice names one concern, per engine (each engine's cache, sampler, batch decoder)."""
    by_name: dict[str, list[str]] = {}
    for name in modules():
        if not modules()[name].name == "__init__.py":
            by_name.setdefault(name.rsplit(".", 1)[1], []).append(name)
    repeated = {n: sorted(ms) for n, ms in by_name.items() if len(ms) > 1}
    per_engine = {n: ms for n, ms in repeated.items()
                  if all(m.startswith(("umakit.backends.torch.", "umakit.backends.mlx.", "umakit.backends.transformers."))
                         for m in ms)}
    assert repeated == per_engine
