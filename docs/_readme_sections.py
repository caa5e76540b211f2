"""mkdocs hook: the README is the one source of the overview pages.

A line `<!-- readme: Title -->` in a page is replaced by the body of the README's
`## Title` section (up to the next `## ` heading, without the heading itself);
`<!-- readme: intro -->` is the text between the README's title and its first `## `
heading. A title the README does not have fails the build, naming it.
"""

import re
from pathlib import Path

_README = Path(__file__).resolve().parent.parent / "README.md"
_DIRECTIVE = re.compile(r"^<!-- readme: (.+?) -->[ \t]*$", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~)")


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
        return sections[title]

    return _DIRECTIVE.sub(replace, markdown)
