"""The layering holds: no import cycle among `service`, `model` and `kernels` (every import counts, at module
level or inside a function, and `importlib.import_module("...")` of a literal name), and the HTTP side
(`service/api`) never imports MLX: the engine thread does.

Modules are named as in the checkout (`kernels.cuda`); the sources import them under the installed namespace
(`dsv4_serve.kernels.cuda`, pyproject's package-dir), and a source that imports a bare `kernels`, `model` or
`service` fails here: installed, that name is somebody else's package (PyPI's `kernels`) or nothing.

The graph is built from the sources (ast), not from what one run happens to import. `from pkg import name`
depends on the submodule `pkg.name` where there is one, else on `pkg/__init__.py`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "model", "kernels")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


NS = "dsv4_serve."


def imported_names(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every module name `name` imports (resolved when relative; the `dsv4_serve.` namespace taken off).
    `from pkg import x` names `pkg.x` where that is a module of `mods`, else `pkg` (x is defined in
    pkg/__init__.py)."""
    return {n.removeprefix(NS) for n in raw_imports(name, path, mods)}


def raw_imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """imported_names as written in the source (the namespace kept)."""
    mods = {**mods, **{NS + k: v for k, v in mods.items()}}
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            for a in node.names:
                out.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):  # fmt: skip
            out.add(node.args[0].value)
    return out


def graph() -> dict[str, set[str]]:
    """Module -> the modules of service / model / kernels it imports (a name below a module, such as a
    function's, counts as that module); imports of other packages are left out."""
    mods = modules()
    g: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for imp in imported_names(name, path, mods):
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                deps.add(imp)
        g[name] = deps
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g[v]:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_graph_sees_known_edges() -> None:
    """The builder finds the imports it must: a module-level one, a function-local one, an import_module."""
    g = graph()
    assert "service.engine.engine" in g["service.engine.follower"]  # module level
    assert "model.loader" in g["service.engine.build"]  # inside build_engine
    assert "kernels.cuda" in g["kernels"]  # importlib.import_module("dsv4_serve.kernels.cuda"), the fast loader
    assert "kernels.cuda.common" in g["kernels.cuda.attention"]  # from kernels.cuda import common
    assert "kernels.cuda" not in g["kernels.cuda.attention"]  # ... which is not kernels/cuda/__init__.py


def test_every_import_goes_through_the_namespace() -> None:
    """No source of the project (the packages, tests, bench, tools) imports a bare `service`, `model` or
    `kernels`: installed, those are not ours (issue: PyPI's `kernels`, brought by transformers, shadowed ours)."""
    bad = []
    for p in sorted(ROOT.glob("*/**/*.py")):
        if p.relative_to(ROOT).parts[0] not in (*PACKAGES, "tests", "bench", "tools", "dsv4_serve"):
            continue
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        bad += [f"{p.relative_to(ROOT)}: {imp}" for imp in raw_imports(name, p, {}) if imp.split(".")[0] in PACKAGES]
    assert not bad, bad


def test_cycle_detection_finds_a_planted_cycle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_service_api_imports_no_mlx_in_its_sources() -> None:
    bad = []
    for p in sorted((ROOT / "service" / "api").rglob("*.py")):
        names = imported_names(".".join(p.relative_to(ROOT).with_suffix("").parts), p, {})
        bad += [f"{p.relative_to(ROOT)}: {n}" for n in names if n == "mlx" or n.startswith("mlx.")]
    assert not bad, bad


def test_building_the_app_loads_no_mlx() -> None:
    """Importing the HTTP side and building its app (not started: the engine thread is what imports MLX)
    leaves mlx out of sys.modules, in a fresh interpreter."""
    code = ("import sys\nfrom dsv4_serve.service.api.app import create_app\n"
            "from dsv4_serve.service.settings import Settings\n"
            "create_app(Settings())\nprint(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
