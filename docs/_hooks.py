"""mkdocs hooks (mkdocs.yml `hooks:`).

1. The pages under docs/ are the documentation's source; the home page shows the
   README's landing sections, included from it. A line `<!-- readme: Title -->` in a
   page is replaced by the body of the README's `## Title` section (up to the next
   `## ` heading, without the heading itself); `<!-- readme: intro -->` is the text
   between the README's title and its first `## ` heading. A title the README does
   not have fails the build, naming it. The README links to the pages as
   `docs/page.md` (from the repository's root); included, they become `page.md`.
2. Every public name has an API page. The public names are those `moe_eqx/__init__.py`,
   `moe_eqx/internal.py` and `moe_eqx/train/__init__.py` re-export
   (`from ._x import name as name`) and the
   `__all__` of the public modules among them (`moe_eqx.workloads`); each needs a
   `::: moe_eqx.name` line under `docs/api/`; a missing one is a warning, so
   `mkdocs build --strict` fails on it. (A line for a name that no longer exists fails
   the build in mkdocstrings already.)
"""

import ast
import logging
import re
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_README = _ROOT / "README.md"
_PACKAGES = ("moe_eqx", "moe_eqx.internal", "moe_eqx.train")  # re-exports documented
_DIRECTIVE = re.compile(r"^<!-- readme: (.+?) -->[ \t]*$", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~)")
_DOCS_LINK = re.compile(r"\]\(docs/")  # a README link into docs/, made page-relative
_ENTRY = re.compile(r"^::: (moe_eqx[\w.]*)[ \t]*$", re.MULTILINE)

log = logging.getLogger("mkdocs.hooks.moe_eqx")


# --- README sections ---------------------------------------------------------------


def _sections(text: str) -> dict[str, str]:
    """Maps "intro" and each `## ` title to its body; `## ` inside code fences is
    code, not a heading."""
    sections: dict[str, list[str]] = {"intro": []}
    current = None  # before the `# ` title
    in_fence = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("# ") and current is None:
            current = "intro"
            continue
        elif not in_fence and line.startswith("## "):
            current = line[3:].strip()
            sections[current] = []
            continue
        if current is not None:
            sections[current].append(line)
    return {title: "\n".join(lines).strip("\n") for title, lines in sections.items()}


def on_config(config, **kwargs):
    config.watch.append(str(_README))  # `mkdocs serve` rebuilds when the README changes
    return config


def on_page_markdown(markdown, page, **kwargs):
    if "<!-- readme:" not in markdown:
        return markdown
    sections = _sections(_README.read_text(encoding="utf-8"))

    def replace(match: re.Match) -> str:
        title = match.group(1).strip()
        if title not in sections:
            known = ", ".join(repr(t) for t in sections)
            raise ValueError(
                f"{page.file.src_path}: README.md has no section {title!r} "
                f"(it has {known})."
            )
        return _DOCS_LINK.sub("](", sections[title])

    return _DIRECTIVE.sub(replace, markdown)


# --- every public name documented ---------------------------------------------------


def _module_file(dotted: str) -> Path:
    path = _ROOT.joinpath(*dotted.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


def _public_names() -> set[str]:
    """Dotted public names, read from the sources (nothing is imported)."""
    names = set()
    for package in _PACKAGES:
        tree = ast.parse(_module_file(package).read_text(encoding="utf-8"))
        for node in tree.body:
            if not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue
            for alias in node.names:
                if alias.asname != alias.name:  # `import x as x` marks a re-export
                    continue
                dotted = f"{package}.{alias.name}"
                names.add(dotted)
                if node.module is None and dotted not in _PACKAGES:  # a submodule
                    sub = ast.parse(_module_file(dotted).read_text(encoding="utf-8"))
                    names.update(f"{dotted}.{name}" for name in _all(sub))
    return names


def on_files(files, config, **kwargs):
    documented = set()
    for file in files.documentation_pages():
        if file.src_uri.startswith("api/"):
            text = Path(file.abs_src_path).read_text(encoding="utf-8")
            documented.update(_ENTRY.findall(text))
    for name in sorted(_public_names() - documented):
        if not _module_file(name).exists():  # a public module needs no line of its own
            log.warning(f"public name {name} has no `::: {name}` line under docs/api/")
    return files
