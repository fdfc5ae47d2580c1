"""Tiny HTML builders for the reports: a self-contained page of headings, tables and figures (relative PNGs)."""

from __future__ import annotations

import html
from collections.abc import Sequence

_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:4px 10px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%}
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


def table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure(src: str, caption: str) -> str:
    return f'<figure><img src="{esc(src)}" alt="{esc(caption)}"><figcaption>{esc(caption)}</figcaption></figure>'


def page(title: str, parts: Sequence[str]) -> str:
    """A complete HTML document; `parts` are already-rendered HTML fragments."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{_CSS}</style>"
            f"</head><body><h1>{esc(title)}</h1>\n" + "\n".join(parts) + "\n</body></html>\n")
