"""How the ledger writes numbers: the minus sign, signs on differences, bold on intervals that
exclude 0, and the parsers of what it wrote."""

from __future__ import annotations

import re

from fedderm.ledger.sources import Cell, Diff

MINUS = "\u2212"


def num(x: float | None, digits: int = 2, sign: bool = False) -> str:
    if x is None:
        return "–"
    if round(x, digits) == 0:
        x = 0.0  # no "−0.00"
    text = f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"
    return text.replace("-", MINUS)


def fmt_mean(c: Cell, digits: int) -> str:
    if c.mean is None:
        return "n/a"
    return num(c.mean, digits) + (f" ± {num(c.sd, digits)}" if c.sd is not None else "")


def fmt_diff(d: Diff, digits: int, bold: bool = True) -> str:
    if not d.n or d.mean is None:
        return "n/a"
    if d.ci is None:
        return f"{num(d.mean, digits, True)} (n = {d.n})"
    text = f"{num(d.mean, digits, True)} [{num(d.ci[0], digits, True)}, {num(d.ci[1], digits, True)}]"
    return f"**{text}**" if bold and d.excludes_zero else text


def _parse_number(text: str) -> float | None:
    text = text.strip().strip("*").replace(MINUS, "-").strip()
    if text in ("–", "-", "n/a", ""):
        return None
    return float(text)


_DIFF = re.compile(
    r"^\**(?P<m>[+\-−]?\d+(?:\.\d+)?)(?: \[(?P<lo>[+\-−]?\d+(?:\.\d+)?), (?P<hi>[+\-−]?\d+(?:\.\d+)?)\])?"
    r"(?: \(n = (?P<n>\d+)\))?\**$"
)
_MEAN = re.compile(
    r"^(?P<m>[+\-−]?\d+(?:\.\d+)?)(?: ± (?P<sd>\d+(?:\.\d+)?))?(?: \((?P<k>\d+)/(?P<r>\d+)\))?(?P<c> ≈chance)?$"
)


def _digits(text: str) -> int:
    m = re.search(r"\.(\d+)", text)
    return len(m.group(1)) if m else 0
