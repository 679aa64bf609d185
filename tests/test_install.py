"""What an install puts into site-packages: one import name of the project's own, `dsv4_serve`.

Issue 48: the distribution had installed the generic top-level names `kernels`, `model` and `service`;
PyPI's `kernels` (transformers brings it, so xgrammar, the test extra and guidellm do) then shadowed ours
and the engine failed to start. pytest runs from the checkout, where the checkout's folders come first on
the path, so only a look at the built wheel and an import from elsewhere shows it. No registry is asked:
the wheel is built with the venv's own setuptools (no build isolation) and imported from its unzipped files.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("service", "model", "kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy of its tracked sources (a build in the checkout would write
    build/ and *.egg-info there)."""
    tmp = tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "dsv4_serve", *SOURCES], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    src = tmp / "src"
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_bytes((ROOT / f).read_bytes())
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "out"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (whl,) = (tmp / "out").glob("dsv4_serve-*.whl")
    return whl


def test_wheel_installs_one_top_level_name(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"dsv4_serve", wheel.name.split("-py3")[0] + ".dist-info"}


def test_wheel_holds_every_source_module(wheel: Path) -> None:
    """Every .py of service/, model/ and kernels/ is in the wheel under dsv4_serve/ (a new subpackage left
    out of pyproject's `packages` would be missing from an install, not from the checkout)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"dsv4_serve/{p.relative_to(ROOT).as_posix()}" for pkg in SOURCES for p in (ROOT / pkg).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sources - names == set()


def _outside(code: str, cwd: Path, pythonpath: str | None = None) -> str:
    """Run `code` with the venv's interpreter from `cwd` (outside the checkout), PYTHONPATH only as given."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


# Prints every module of service/, model/, kernels/ and where it came from (not a walk of dsv4_serve itself:
# in a checkout its path also holds the root); `kernels`, `model`, `service` as found (None: absent).
PROBE = """
import importlib, importlib.util as u, pkgutil
mods = []
for sub in ('service', 'model', 'kernels'):
    pkg = importlib.import_module('dsv4_serve.' + sub)
    mods += [pkg.__name__] + [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.')]
for m in mods:
    print(m, importlib.import_module(m).__file__)
for n in ('kernels', 'model', 'service'):
    s = u.find_spec(n)
    print(n, s.origin if s else None)
"""


def _probe(out: str) -> tuple[dict[str, str], dict[str, str]]:
    rows = dict(line.split(" ", 1) for line in out.splitlines())
    generic = {n: rows.pop(n) for n in SOURCES}
    return rows, generic


def _not_ours(origin: str) -> bool:
    """A generic name is absent or somebody else's package in site-packages."""
    return origin == "None" or ("site-packages" in origin and "dsv4_serve" not in origin)


def test_unpacked_wheel_imports_from_itself_and_leaves_kernels_alone(wheel: Path, tmp_path: Path) -> None:
    """Every module of the wheel imports from the wheel's files, from a directory outside the checkout,
    and `kernels` / `model` / `service` stay what site-packages has (PyPI's `kernels` where installed)."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    ours, generic = _probe(_outside(PROBE, tmp_path, pythonpath=str(site)))
    assert "dsv4_serve.kernels.cuda" in ours and "dsv4_serve.service.api.app" in ours
    assert all(f.startswith(str(site)) for f in ours.values()), ours
    assert all(_not_ours(o) for o in generic.values()), generic


def test_venv_install_outside_the_checkout(tmp_path: Path) -> None:
    """The venv's own install of the project (CI's editable `pip install -e`), imported from elsewhere
    without PYTHONPATH: `dsv4_serve.kernels` is the checkout's kernels/, and the generic names are not ours."""
    ours, generic = _probe(_outside(PROBE, tmp_path))
    assert Path(ours["dsv4_serve.kernels"]) == ROOT / "kernels" / "__init__.py"
    assert all(Path(f).is_relative_to(ROOT) for f in ours.values()), ours
    assert all(_not_ours(o) for o in generic.values()), generic
