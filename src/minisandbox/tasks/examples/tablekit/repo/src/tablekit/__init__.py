"""Render expense reports as plain-text tables."""

from tabulate import tabulate


def totals(rows):
    """Sum the amount column (the last one) of `rows` per category (the first column)."""
    out = {}
    for row in rows:
        out[row[0]] = out.get(row[0], 0) + row[1]
    return out


def render(rows):
    """A table of the rows followed by a TOTAL line."""
    body = [list(r) for r in rows]
    body.append(["TOTAL", "", sum(r[-1] for r in rows)])
    return tabulate(body, headers=["category", "item", "amount"])
