"""Tables that read well in both places they are shown: as text within 120 columns (a long cell wraps at its
words, inside its own column) for the CLI and `print`, and as an HTML table in Jupyter."""

from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass, field

WIDTH = 120  # columns of a text line: a terminal's or a notebook's output area without wrapping
GAP = "  "  # between two columns
MIN_WRAP = 12  # a wrapped column is never narrower (unless its text is)
LONG_WORD = 30  # a wrapped column is at least as wide as its longest word, up to this many columns


@dataclass
class Table:
    """Rows of text cells under a header. `right`: the columns aligned right (numbers); they never wrap.
    `footer`: lines of text after the rows (a sum, a note)."""

    header: list[str]
    rows: list[list[str]]
    right: set[int] = field(default_factory=set)
    caption: str = ""
    footer: list[str] = field(default_factory=list)
    indent: int = 0  # spaces before each text line
    rule: bool = True  # a line of dashes under the header in the text form

    def widths(self, width: int = WIDTH) -> list[int]:
        """Each column's width in the text form: its longest cell when the table fits `width`, else the
        right-aligned columns keep theirs and the others share what is left, the narrow ones whole first."""
        cells = [self.header] + self.rows
        natural = [max(len(r[j]) for r in cells) for j in range(len(self.header))]
        room = width - self.indent - len(GAP) * (len(natural) - 1)
        if sum(natural) <= room:
            return natural
        out = list(natural)
        left = room - sum(natural[j] for j in self.right)
        todo = [j for j in range(len(natural)) if j not in self.right]
        floor = {j: min(natural[j], max(MIN_WRAP, min(LONG_WORD, _longest_word(r[j] for r in cells))))
                 for j in todo}
        while todo:  # water-filling: a column that needs less than an equal share keeps its width
            share = left // len(todo)
            whole = [j for j in todo if max(natural[j], floor[j]) <= share or floor[j] > share]
            if not whole:
                for j in todo:
                    out[j] = share
                break
            for j in whole:  # narrow enough to keep whole, or its longest word makes it wider than a share
                out[j] = natural[j] if natural[j] <= share else floor[j]
                left -= out[j]
                todo.remove(j)
        wrap = [j for j in range(len(out)) if j not in self.right]
        while wrap and sum(out) > room and max(out[j] for j in wrap) > MIN_WRAP:  # long words made it too wide:
            out[max(wrap, key=lambda j: out[j])] -= 1  # the widest gives a column (its longest word breaks)
        return out

    def text(self, width: int = WIDTH) -> str:
        w = self.widths(width)
        pad = " " * self.indent
        lines = [wrap_line(self.caption, width)] if self.caption else []
        for i, row in enumerate([self.header] + self.rows):
            parts = [textwrap.wrap(c, w[j], break_on_hyphens=False) or [""] if j not in self.right else [c]
                     for j, c in enumerate(row)]
            for k in range(max(len(p) for p in parts)):
                cells = [(p[k] if k < len(p) else "").rjust(w[j]) if j in self.right else
                         (p[k] if k < len(p) else "").ljust(w[j]) for j, p in enumerate(parts)]
                lines.append((pad + GAP.join(cells)).rstrip())
            if i == 0 and self.rule:
                lines.append(pad + GAP.join("-" * x for x in w))
        lines += [wrap_line(pad + line, width, pad + "  ") for line in self.footer]
        return "\n".join(lines)

    def html(self) -> str:
        def row(cells, tag):
            return "<tr>" + "".join(f"<{tag} style='text-align:{'right' if j in self.right else 'left'}'>"
                                    f"{html.escape(c)}</{tag}>" for j, c in enumerate(cells)) + "</tr>"

        cap = f"<caption style='text-align:left'>{html.escape(self.caption)}</caption>" if self.caption else ""
        foot = "".join(f"<tr><td colspan='{len(self.header)}'>{html.escape(f)}</td></tr>" for f in self.footer)
        return (f"<table>{cap}<thead>{row(self.header, 'th')}</thead><tbody>"
                + "".join(row(r, "td") for r in self.rows) + f"</tbody><tfoot>{foot}</tfoot></table>")

    def __str__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return self.html()


class Report(str):
    """Text with an HTML form: lines of prose and tables, in order. It *is* the text (print it, search it,
    write it to a file: every line within `WIDTH` columns); Jupyter shows it as HTML tables."""

    blocks: tuple

    def __new__(cls, blocks):
        blocks = tuple(blocks)
        obj = super().__new__(cls, "\n".join(b.text() if isinstance(b, Table) else str(b) for b in blocks))
        obj.blocks = blocks
        return obj

    def __repr__(self) -> str:  # the plain-text view of a notebook or a console shows the text, not a literal
        return str.__str__(self)

    def _repr_html_(self) -> str:
        return "".join(b.html() if isinstance(b, Table) else f"<p>{html.escape(str(b))}</p>" for b in self.blocks)


def _longest_word(texts) -> int:
    return max((len(w) for t in texts for w in t.split()), default=0)


def wrap_line(text: str, width: int = WIDTH, indent: str = "  ") -> str:
    """One line of prose within `width` columns: it wraps at words, the next lines indented."""
    return "\n".join(textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False)) or text
