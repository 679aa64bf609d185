"""The CUDA kernels' code as MLX gets it (kernels/cuda/include.py): an include file with the body as a
macro, and a stub source. On the CPU: the macro gives back the body, the stub names what MLX must pass, and
every failure keeps the code inline. (The PTX of both forms is equal: bench/ptx_diff.py; the gpu tests run
the include form.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels.cuda import attention, common, compressor, compressor_inplace, hc, include, indexer_one_src, indexer_src
from kernels.cuda.select import HELPERS

BODIES = {"one": indexer_one_src.ONE, "segment": indexer_src.SEGMENT, "merge": indexer_src.MERGE,
          "wide": attention.WIDE, "dsplit": attention.DSPLIT, "partial": attention.PARTIAL,
          "combine": attention.COMBINE, "compressor": compressor.SOURCE, "inplace": compressor_inplace.SOURCE,
          "hc": hc.SOURCE}  # fmt: skip
INPUTS = ["positions", "q_rows", "table", "q", "window", "indices", "sinks", "part", "slots", "h", "keys"]


def unsplice(text: str, name: str) -> list[str]:
    """The lines of macro `name` in `text`, as the preprocessor sees them, pragmas as `#pragma` again."""
    m = re.search(rf"^#define {name} \\\n(.*)\Z", text, re.S | re.M)
    assert m is not None, f"no macro {name}"
    lines = m.group(1).rstrip("\n").split(" \\\n")
    return [re.sub(r'^_Pragma\("(.*)"\)$', r"#pragma \1", ln) for ln in lines]


@pytest.mark.parametrize("name", sorted(BODIES))
def test_macro_is_the_body(name: str) -> None:
    body = common.minify(BODIES[name])
    text = include.macro("DSV4_BODY_x", body)
    assert text is not None
    assert all(include.strip_comment(ln) == ln for ln in text.splitlines())  # no comment swallows a splice
    want = [include.strip_comment(ln) for ln in body.splitlines()]
    assert unsplice(text, "DSV4_BODY_x") == [ln for ln in want if ln]


def test_split_writes_the_code_and_a_stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_CUDA_INCLUDE_DIR", str(tmp_path / "inc"))
    head = common.minify(common.HEADER + HELPERS) + "\n"
    body = common.minify(attention.COMBINE)
    got = include.split("dsv4_attn_combine_0123456789", INPUTS, head, body)
    assert got is not None
    header, stub = got
    path = tmp_path / "inc" / "dsv4_attn_combine_0123456789.cuh"
    assert header == f'#include "{path}"\n'
    text = path.read_text()
    assert text.startswith(head)
    assert unsplice(text, "DSV4_BODY_dsv4_attn_combine_0123456789") == [ln for ln in body.splitlines() if ln]
    assert stub.startswith("DSV4_BODY_dsv4_attn_combine_0123456789 /* ")
    # MLX passes <input>_shape / _strides / _ndim when its source names them: the stub names exactly those
    for n in INPUTS:
        for s in include.SUFFIXES:
            assert (n + s in stub) == (n + s in body), n + s
    assert "part_shape" in stub and "sinks_shape" in stub  # COMBINE reads both
    assert include.split("dsv4_attn_combine_0123456789", INPUTS, head, body) == got  # rewritten: same


def test_inline_when_off_or_unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DSV4_CUDA_INCLUDE_DIR", str(blocker / "inc"))  # a folder under a file: OSError
    assert include.split("k_0123456789", ["q"], "", "int i = 0;") is None
    name, head, body = common.mlx_texts("merge", ["positions"], indexer_src.MERGE, HELPERS)
    assert name.startswith("dsv4_merge_") and body == common.minify(indexer_src.MERGE)
    assert head == common.minify(common.HEADER + HELPERS) + "\n"
    monkeypatch.setenv("DSV4_CUDA_INCLUDE_DIR", str(tmp_path / "inc"))
    monkeypatch.setattr(include, "ENABLED", False)
    assert include.split("k_0123456789", ["q"], "", "int i = 0;") is None
    assert not (tmp_path / "inc").exists()


def test_include_form_names_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSV4_CUDA_INCLUDE_DIR", str(tmp_path))
    name, head, body = common.mlx_texts("merge", ["positions", "q_rows", "cand"], indexer_src.MERGE, HELPERS)
    edited, _, _ = common.mlx_texts("merge", ["positions", "q_rows", "cand"], indexer_src.MERGE + "\n;", HELPERS)
    assert name != edited  # the name (MLX's module and PTX-cache key) carries the code's digest
    assert head == f'#include "{tmp_path / (name + ".cuh")}"\n'
    assert body == f"DSV4_BODY_{name} /* positions_shape */"
    assert len(head) + len(body) < 200  # what MLX hashes per launch, against ~8 KB inline


@pytest.mark.parametrize(
    ("line", "want"),
    [('asm("a // b"); // c', 'asm("a // b");'), ("x = '\"'; // q", "x = '\"';"), ("a = b; // c", "a = b;"),
     (r'p("\"//"); // c', r'p("\"//");'), ("no comment", "no comment")],
)  # fmt: skip
def test_strip_comment(line: str, want: str) -> None:
    assert include.strip_comment(line) == want


def test_macro_refuses_other_directives() -> None:
    assert include.macro("M", "int a;\n#define X 1\nint b;") is None
    assert include.macro("M", "#pragma unroll 4\nfor (;;) {}") == '#define M \\\n_Pragma("unroll 4") \\\nfor (;;) {}\n'
