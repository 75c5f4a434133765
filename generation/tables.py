"""A small table type of the card's statistics, `eval`, `judge-agreement` and `stats`: raw values in, markdown and
CSV out.

Rows keep raw values (numbers, None) so the CSV holds full precision; `formats` decide how markdown shows them.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

from .files import atomic_write_text

MISSING = "–"


@dataclass
class Table:
    columns: list[str]
    rows: list[list] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)  # column -> format spec, e.g. ".3f" or ".1%"

    def cell(self, column: str, value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return MISSING
        spec = self.formats.get(column)
        if spec:
            return format(value, spec)
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        # Text may come from a judge: a cell stays one line (splitlines knows \r, \v, \u2028 ...), a pipe does not
        # end it and "<" opens no HTML on the Hub's page.
        return " ".join(str(value).splitlines()).replace("|", "\\|").replace("<", "&lt;")

    def markdown(self) -> str:
        head = "| " + " | ".join(self.columns) + " |"
        rule = "|" + "|".join("---" for _ in self.columns) + "|"
        body = ["| " + " | ".join(self.cell(c, v) for c, v in zip(self.columns, row)) + " |" for row in self.rows]
        return "\n".join([head, rule, *body])

    def csv_text(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(self.columns)
        writer.writerows([["" if v is None else v for v in row] for row in self.rows])
        return buf.getvalue()

    def write(self, folder: Path, name: str) -> tuple[Path, Path]:
        """`name.md` and `name.csv` in `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        md, data = folder / f"{name}.md", folder / f"{name}.csv"
        atomic_write_text(md, self.markdown() + "\n")  # replaced by a rename, never written through a link
        atomic_write_text(data, self.csv_text())
        return md, data

    def as_dicts(self) -> list[dict]:
        return [dict(zip(self.columns, row)) for row in self.rows]


def mean(values) -> float | None:
    """Mean of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
