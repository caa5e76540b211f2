"""The library's docstrings and comments carry no measurements: times, sizes,
speed-ups and release history belong in docs/measured.md and the commit messages."""

import ast
import io
import pathlib
import re
import tokenize

_PACKAGE = pathlib.Path(__file__).parents[1] / "moe_eqx"
_MEASURED = re.compile(
    r"\b\d+(\.\d+)? ?(ms|µs|us|ns|s|min|MB|GB|MiB|GiB)\b"  # a time or a size
    r"|\b\d+(\.\d+)?x\b"  # a speed-up or a ratio (5x, 1.2x)
    r"|\b\d+(\.\d+)? ?%"  # a share
    r"|previous release|this release"
)


def _docstrings_and_comments(source: str):
    """`(line, text)` of every docstring (module, class, function) and comment."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        ):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def measured_figures(package: pathlib.Path) -> list[str]:
    """`path:line: figure` for each measured figure in the package's docstrings and
    comments."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for line, text in _docstrings_and_comments(path.read_text(encoding="utf-8")):
            for match in _MEASURED.finditer(text):
                at = line + text[: match.start()].count("\n")
                found.append(f"{path.relative_to(package.parent)}:{at}: {match[0]!r}")
    return found


def test_figures_are_found():
    text = '"""Runs in 3.5 ms, 2x faster than the previous release."""\n# 40 MiB, 12%\n'
    assert [m[0] for m in _MEASURED.finditer(text)] == [
        "3.5 ms",
        "2x",
        "previous release",
        "40 MiB",
        "12%",
    ]
    # Shapes, counts and mesh sizes are not measurements.
    for text in ("`[2S, H]`", "`2 S + 4`", "2 x 4 devices", "0x1f", "8 simulated"):
        assert not _MEASURED.search(text), text


def test_no_measurements_in_docstrings_or_comments():
    found = measured_figures(_PACKAGE)
    assert not found, "move these to docs/measured.md:\n" + "\n".join(found)
