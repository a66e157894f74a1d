"""The package's import graph: no circle, no import running up the tier table, test code and frameworks fenced.

Static: every module of octopipe_plugin is parsed with `ast` (nothing imported), and every
import statement counts, at module level or inside a function (a lazy import still runs, only
later). Importing `a.b.c` from outside `a.b` also runs `a.b`'s `__init__`, so that counts as an
edge to the package too. The tier table is the one of docs/design.md ("Layers"): a module may
import its own tier and the tiers below, never one above.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

PKG = "octopipe_plugin"
ROOT = Path(__file__).resolve().parents[1] / PKG

# Tier of each top-level module or sub-package (docs/design.md, "Layers"), following the data:
# model graph -> plan -> executor -> adapter. `testing` is above everything (it may import all).
TIERS = {
    "actions": 0, "errors": 0, "limits": 0, "gpus": 0,  # leaves: vocabulary, errors, bounds, GPU table
    "compat": 0,  # Python 3.11's typing.override, loaded by the venv's .pth into every interpreter
    "formats": 1, "headroom": 1,  # the file formats (model, cluster, plan); usable memory = memory - headroom
    "graph": 2, "partition": 2, "costs": 2,  # model graph, partitions, cost models
    "simulator": 3, "schedules": 3,  # timing a plan; schedule generators and the plan's messages
    "tuner": 4,  # searching plans
    "executor": 5,  # running a plan over torch.distributed (and its dry run)
    "profile": 6, "plan_startup": 6,  # measuring layers with the executor's backward; plan at start-up
    "adapters": 7,  # Megatron-LM and DeepSpeed
    "deepspeed": 8, "cli": 8, "__main__": 8,  # entry points: `import octopipe_plugin.deepspeed`, `octopipe`
    "testing": 9,  # toys, references, checks, stand-ins: never imported by a runtime package
}
FRAMEWORKS = ("megatron", "deepspeed", "transformer_engine", "apex")
MAY_IMPORT_FRAMEWORKS = ("adapters", "testing")

# Circles known when this test was written; each entry must still exist (the test fails once one is gone,
# so whoever merges the fix deletes it here): the set may only shrink. The two Megatron circles went with
# adapters/megatron/mapping.py (the pure plan -> Megatron mapping) and hooks.py.
KNOWN_CYCLES: set[frozenset] = set()
# Runtime -> testing imports known to be on their way out (none left). Same rule: may only shrink.
KNOWN_TESTING_IMPORTS: set[str] = set()


def _short(name: str) -> str:
    return name[len(PKG) + 1:] if name.startswith(PKG + ".") else name


@cache
def modules() -> dict[str, Path]:
    """Dotted name (package for an __init__) -> file, for every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(name: str, path: Path, node: ast.AST) -> list[str]:
    """The absolute names one import statement asks for (a module, or a name inside a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        if node.module:
            base.append(node.module)
        pkg = ".".join(base)
    else:
        pkg = node.module
    return [f"{pkg}.{a.name}" for a in node.names] + [pkg]


def _owning_module(target: str) -> str | None:
    """The package module `target` names or lies in (None outside the package)."""
    mods = modules()
    while target not in mods:
        if "." not in target:
            return None
        target = target.rsplit(".", 1)[0]
    return target


@cache
def imports() -> dict[str, dict[str, int]]:
    """Module -> {imported package module: line of the first such import} (lazy imports included)."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules().items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, path, node):
                mod = _owning_module(target)
                if mod is None or mod == name:
                    continue
                # importing a.b.c from outside a.b runs a.b's __init__ as well
                parts = mod.split(".")
                for i in range(2, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep != name and not name.startswith(dep + ".") and dep in modules():
                        edges.setdefault(dep, node.lineno)
        graph[name] = edges
    return graph


def framework_imports() -> list[tuple[str, int, str]]:
    """(module, line, imported name) for every import of Megatron, DeepSpeed, TE or APEX."""
    out = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            out += [(name, node.lineno, n) for n in names if n.split(".")[0] in FRAMEWORKS]
    return out


def cycles() -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan), as short names."""
    graph = imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(frozenset(_short(c) for c in comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _top(name: str) -> str:
    """The top-level module or sub-package `name` belongs to (its tier-table key)."""
    return _short(name).split(".")[0]


def _where(name: str, line: int) -> str:
    return f"{modules()[name].relative_to(ROOT.parent)}:{line}"


def test_every_module_has_a_tier():
    """A new top-level module or package is placed in the tier table (here and in docs/design.md)."""
    missing = sorted({_top(m) for m in modules() if m != PKG} - set(TIERS))
    assert not missing, f"top-level modules without a tier: {missing}; add them to TIERS and docs/design.md"


def test_no_import_circle():
    """No two modules import each other, directly or through others (lazy imports included)."""
    found = cycles()
    new = found - KNOWN_CYCLES
    gone = KNOWN_CYCLES - found
    assert not new, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in new)
    assert not gone, ("KNOWN_CYCLES lists circles that no longer exist, delete them from tests/test_layering.py: "
                      + "; ".join(" <-> ".join(sorted(c)) for c in gone))


def test_no_import_runs_up_the_tiers():
    """A module imports only its own tier and the tiers below (TIERS, docs/design.md)."""
    bad = []
    for name, edges in imports().items():
        if name == PKG:
            continue
        for dep, line in edges.items():
            if dep == PKG:
                continue
            a, b = _top(name), _top(dep)
            if b == "testing" and _short(name) in KNOWN_TESTING_IMPORTS:
                continue
            if TIERS.get(b, -1) > TIERS.get(a, -1):
                bad.append(f"{_where(name, line)}: {a} (tier {TIERS.get(a)}) imports {_short(dep)} "
                           f"(tier {TIERS.get(b)})")
    assert not bad, "imports running up the tier table:\n" + "\n".join(bad)


def test_runtime_never_imports_testing():
    """Test scaffolding stays out of what a training run loads: only testing/ imports octopipe_plugin.testing."""
    bad, seen = [], set()
    for name, edges in imports().items():
        for dep, line in edges.items():
            if _top(dep) == "testing" and _top(name) != "testing":
                if _short(name) in KNOWN_TESTING_IMPORTS:
                    seen.add(_short(name))
                    continue
                bad.append(f"{_where(name, line)} imports {_short(dep)}")
    assert not bad, "runtime modules importing octopipe_plugin.testing:\n" + "\n".join(bad)
    gone = KNOWN_TESTING_IMPORTS - seen
    assert not gone, f"KNOWN_TESTING_IMPORTS lists {sorted(gone)}, which no longer imports testing: delete it"


def test_only_adapters_import_frameworks():
    """Core imports neither Megatron nor DeepSpeed (nor TE / APEX): only adapters/ (and the test stand-ins)."""
    bad = [f"{_where(m, line)} imports {n}" for m, line, n in framework_imports() if _top(m) not in MAY_IMPORT_FRAMEWORKS]
    assert not bad, "framework imports outside adapters/:\n" + "\n".join(bad)


def test_the_walker_sees_lazy_and_relative_imports():
    """The graph is not vacuous: a known in-function relative import and a package-init edge are found."""
    graph = imports()
    assert f"{PKG}.executor.engine" in graph[f"{PKG}.executor"]  # `from .engine import ...` in an __init__
    assert f"{PKG}.gpus" in graph[f"{PKG}.formats.cluster"]
    # seam_checks' in-function `from ..costs import resolve_model`
    assert f"{PKG}.costs" in graph[f"{PKG}.testing.seam_checks"]
    assert any(m == f"{PKG}.adapters.megatron.wgrad" for m, _, _ in framework_imports())


def test_design_doc_shows_this_tier_table():
    """docs/design.md's "Layers" table names the same tier for every module as TIERS."""
    text = (ROOT.parent / "docs" / "design.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    doc = {}
    for tier, cell in re.findall(r"^\| (\d+) \| ([^|]*) \|", section, flags=re.M):
        for name in re.findall(r"`([\w.]+)/?`", cell):
            doc[name] = int(tier)
    assert doc == TIERS, f"docs/design.md tiers {doc} differ from TIERS {TIERS}"
