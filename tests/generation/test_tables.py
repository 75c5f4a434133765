"""The markdown of `Table`: text from a judge's reasons stays inside its cell."""

from __future__ import annotations

import math

from medbanana.generation.tables import MISSING, Table


def test_hostile_text_stays_in_one_cell_and_opens_no_html():
    hostile = "looks | fake\r\nsecond line\u2028third\x0b<img src=x onerror=alert(1)>"
    table = Table(["reason", "count"], [[hostile, 1234], [None, math.nan]])
    lines = table.markdown().splitlines()
    assert len(lines) == 4  # head, rule, two rows: no line break leaked out of a cell
    row = lines[2]
    # split on the unescaped separators only: the row has exactly its two cells
    cells = [c.strip() for c in row.replace("\\|", "\x00").strip("|").split("|")]
    assert cells == ["looks \x00 fake second line third &lt;img src=x onerror=alert(1)>", "1,234"]
    assert "<img" not in table.markdown()
    assert lines[3] == f"| {MISSING} | {MISSING} |"


def test_csv_keeps_raw_text():
    text = "a | b\nc <d>"
    assert Table(["reason"], [[text]]).csv_text() == f'reason\n"{text}"\n'
