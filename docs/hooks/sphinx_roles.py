r"""Griffe extension for the API pages: Sphinx markup in the package's docstrings, rewritten as Markdown.

The docstrings are Google style with Sphinx roles (``:class:`~a.B```, ``:math:`x```) and ``.. math::`` blocks, which
Markdown would show as written. Cross-reference roles become inline code (``~`` keeps the last name, as in Sphinx);
math becomes arithmatex's ``\(...\)`` and ``$$`` blocks, typeset by MathJax (``mkdocs.yml``).
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|mod|func|meth|attr|data|exc|obj|math):`([^`]+)`")
MATH_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*$")


def _role(match: re.Match[str]) -> str:
    kind, target = match.group(1), match.group(2)
    if kind == "math":
        return rf"\({target}\)"
    text = target.split(".")[-1] if target.startswith("~") else target
    if kind in ("func", "meth") and not text.endswith(")"):
        text += "()"
    return f"`{text}`"


def _math_blocks(text: str) -> str:
    """Turn each ``.. math::`` directive (its body: the more indented lines after it) into a ``$$`` block."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        directive = MATH_DIRECTIVE.match(lines[i])
        if not directive:
            out.append(lines[i])
            i += 1
            continue
        indent, body, i = directive.group("indent"), [], i + 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i])
            i += 1
        math = textwrap.dedent("\n".join(body)).strip("\n")
        if "&" in math:
            math = "\\begin{aligned}\n" + math + "\n\\end{aligned}"
        out += ["", f"{indent}$$", *[f"{indent}{line}" for line in math.splitlines()], f"{indent}$$", ""]
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles and math directives of every docstring Griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring in place, once it is loaded."""
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_role, _math_blocks(obj.docstring.value))
