"""Tiny HTML builders for the reports: a self-contained page of headings, tables and figures (relative PNGs).

The page is at most 1400 px wide (prose at most 1100 px, for its line length). Every table sits in a container that
scrolls sideways rather than widening the page; headers wrap between words, and the cells of a `numeric` table do
not wrap, so that a number or an interval such as [0.52, 0.61] stays on one line.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

_CSS = """body{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;color:#222}
p,figcaption{max-width:1100px}.scroll{max-width:100%;overflow-x:auto}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 10px;text-align:right}
th{background:#f3f3f3;white-space:normal;vertical-align:bottom}td:first-child,th:first-child{text-align:left}
table.numeric td{white-space:nowrap}img{max-width:100%}
figure{margin:1.5em 0}figcaption{color:#555;font-size:90%}.note{color:#555}"""


def esc(text) -> str:
    return html.escape(str(text))


def fmt(value, digits: int = 4) -> str:
    """A table cell: floats to `digits` significant digits, None/nan as an em dash."""
    if value is None or (isinstance(value, float) and value != value):
        return "\u2014"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence], numeric: bool = False) -> str:
    """A table in its sideways-scrolling container; `numeric`: cells never wrap (numbers, intervals)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    cls = " class='numeric'" if numeric else ""
    return f"<div class='scroll'><table{cls}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def figure(src: str, caption: str) -> str:
    return f'<figure><img src="{esc(src)}" alt="{esc(caption)}"><figcaption>{esc(caption)}</figcaption></figure>'


def page(title: str, parts: Sequence[str]) -> str:
    """A complete HTML document; `parts` are already-rendered HTML fragments."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{_CSS}</style>"
            f"</head><body><h1>{esc(title)}</h1>\n" + "\n".join(parts) + "\n</body></html>\n")
