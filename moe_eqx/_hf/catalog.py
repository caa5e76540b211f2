"""The documentation's tables of Hugging Face models, generated from the importer's
own family tables (`families.LINEAGES`, `WRAPPERS`, `REFUSED`), so that the README and
the models page list exactly what `config_from_hf` reads and refuses.

    python -m moe_eqx._hf.catalog          # rewrite the tables in README.md and docs/models.md
    python -m moe_eqx._hf.catalog --check  # exit 1 if they are stale (the tests run it)

Each table sits between `<!-- catalog: NAME -->` and `<!-- end catalog -->` lines.
"""

import argparse
import pathlib
import re
import sys

from .families import LINEAGES, REFUSED, WRAPPERS

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_BLOCK = re.compile(
    r"(<!-- catalog: (\w+) -->\n).*?(<!-- end catalog -->)", flags=re.DOTALL
)


def supported_table() -> str:
    """The README's compact table: one row per lineage, its families' `model_type`s
    and the wrappers whose text model is one of them."""
    rows = ["| lineage | `model_type`s | wrappers (-> their text model) |"]
    rows.append("|---|---|---|")
    for lineage, families in LINEAGES.items():
        names = ", ".join(f"`{m}`" for m in sorted(families))
        wrappers = ", ".join(
            f"`{w}` -> `{text}`"
            for w, text in sorted(WRAPPERS.items())
            if text in families
        )
        rows.append(f"| {lineage} | {names} | {wrappers} |")
    return "\n".join(rows) + "\n"


def refused_table() -> str:
    """The families refused, each with its reason."""
    rows = ["| `model_type` | refused because |", "|---|---|"]
    for model_type, why in sorted(REFUSED.items()):
        wrappers = sorted(w for w, text in WRAPPERS.items() if text == model_type)
        names = ", ".join(f"`{n}`" for n in [*wrappers, model_type])
        rows.append(f"| {names} | {why} |")
    return "\n".join(rows) + "\n"


TABLES = {"supported": supported_table, "refused": refused_table}
PAGES = ("README.md", "docs/models.md")


def render(text: str) -> str:
    """`text` with each catalog block's body regenerated."""

    def body(m):
        name = m.group(2)
        if name not in TABLES:
            raise ValueError(f"unknown catalog table {name!r} (known: {list(TABLES)})")
        return m.group(1) + TABLES[name]() + m.group(3)

    return _BLOCK.sub(body, text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="only check, write nothing"
    )
    args = parser.parse_args(argv)
    stale = []
    for page in PAGES:
        path = _ROOT / page
        text = path.read_text()
        if not _BLOCK.search(text):
            raise ValueError(f"{page} has no `<!-- catalog: ... -->` block.")
        new = render(text)
        if new != text:
            stale.append(page)
            if not args.check:
                path.write_text(new)
    if stale and args.check:
        print(
            f"stale model tables in {', '.join(stale)}: run "
            "`python -m moe_eqx._hf.catalog`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
