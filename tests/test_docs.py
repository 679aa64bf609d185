"""The docs describe code that exists: every repository path that ARCHITECTURE.md, README.md or a docs/ page
names (in backticks, in a link or in a code block) exists, every link's target and anchor resolves, and a path
given as `REV:path` (a script gone from the tree, named by the commit that still has it) is in that commit. And
the map is whole: every module of service/, model/ and kernels/ is named, by its path, in ARCHITECTURE.md or in
a docs page it links."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "model", "kernels")
# Top-level names a path in the docs starts with (a path elsewhere, such as /v1/chat or ../shared, is not ours).
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} - {"build", "dsv4_serve.egg-info"}
MAP = ROOT / "ARCHITECTURE.md"

PATH = re.compile(r"(?:(?P<rev>[0-9a-f]{7,40}\^?):)?(?P<path>[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TICKS = re.compile(r"`([^`\n]+)`")


def ignored(path: str) -> bool:
    """A path git ignores is one the user or a tool makes (`deploy/secrets/`, `build/`): named, not shipped."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():  # a copy of the tree: .gitignore's folders
        rules = [r.strip().lstrip("/") for r in (ROOT / ".gitignore").read_text().splitlines()]
        return any(r.endswith("/") and path.startswith(r) for r in rules)
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def docs() -> list[Path]:
    return [MAP, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def spans(text: str) -> list[str]:
    """The backticked spans and the lines of fenced code blocks: where the docs name paths."""
    out, fence = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if fence:
            out.append(line)
        else:
            out += TICKS.findall(line)
    return out


def named_paths(text: str) -> set[tuple[str | None, str]]:
    """(revision or None, path) for every token of a span that starts with a top-level name of the repository
    and has a slash or is a top-level file; templates (`kernels/<op>.py`) and globs (`gpu_*.sh`) are not paths."""
    found = set()
    for span in spans(text):
        for m in PATH.finditer(span):
            start = m.start("rev") if m.group("rev") else m.start("path")
            if start and (span[start - 1] in "</{*.-_" or span[start - 1].isalnum()):
                continue  # inside a template, a glob or a longer token
            end = m.end()
            if end < len(span) and span[end] in "<{*":
                continue
            path = m.group("path").rstrip(".")
            if path.split("/")[0] not in TOP or ("/" not in path and not (ROOT / path).is_file()):
                continue
            found.add((m.group("rev"), path))
    return found


def anchors(md: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in md.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def linked_pages(md: Path) -> list[Path]:
    """The local markdown pages `md` links."""
    out = []
    for target in LINK.findall(md.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        page = (md.parent / target.split("#")[0]).resolve()
        if page.suffix == ".md" and page.is_file():
            out.append(page)
    return out


def test_the_path_finder_sees_the_map() -> None:
    """The checks below are only as good as the extraction: it finds the paths the map names, and none of a
    template, a glob or an endpoint."""
    found = {p for _, p in named_paths(MAP.read_text())}
    assert {"service/engine/worker.py", "model/state.py", "kernels/cuda/"} <= found
    sample = "`kernels/<op>.py` `gpu_*.sh` `/v1/completions` `909d875:bench/host_cost.py` `tests/` `README.md`"
    assert named_paths(sample) == {("909d875", "bench/host_cost.py"), (None, "tests/"), (None, "README.md")}


@pytest.mark.parametrize("md", docs(), ids=lambda p: p.name)
def test_every_path_the_docs_name_exists(md: Path) -> None:
    missing = sorted(p for rev, p in named_paths(md.read_text())
                     if rev is None and not (ROOT / p).exists() and not ignored(p))  # fmt: skip
    assert not missing, f"{md.name} names paths that are gone: {missing}"


@pytest.mark.parametrize("md", docs(), ids=lambda p: p.name)
def test_every_link_resolves(md: Path) -> None:
    bad = []
    for target in LINK.findall(md.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        page = (md.parent / file).resolve() if file else md
        if not page.exists():
            bad.append(target)
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            bad.append(target)
    assert not bad, f"{md.name}: links that resolve to nothing: {bad}"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git history")
def test_paths_named_by_commit_are_in_that_commit() -> None:
    named = {(rev, p) for md in docs() for rev, p in named_paths(md.read_text()) if rev is not None}
    assert named, "the docs name no gone script by its commit: drop this test or the REV:path form"
    bad = [f"{rev}:{p}" for rev, p in sorted(named)
           if subprocess.run(["git", "cat-file", "-e", f"{rev}:{p.rstrip('/')}"], cwd=ROOT).returncode]
    assert not bad, f"not in those commits: {bad}"


def test_every_module_is_on_the_map_or_a_page_it_links() -> None:
    """Each module of service/, model/ and kernels/ by its path, in ARCHITECTURE.md or a page it links; an
    __init__.py with nothing in it is not a module to describe."""
    text = "\n".join(p.read_text() for p in [MAP, *linked_pages(MAP)])
    modules = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
               if not (p.name == "__init__.py" and not p.read_text().strip())]  # fmt: skip
    missing = [str(p.relative_to(ROOT)) for p in modules if str(p.relative_to(ROOT)) not in text]
    assert not missing, f"modules on no map: {missing}"
