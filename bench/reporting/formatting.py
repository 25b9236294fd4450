"""Numbers as the report writes them, and the verdicts of its targets table."""

MIB = 2**20


def fmt(x, digits=1):
    return "–" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or not b else a / b


def step_cell(r):
    """A result's median step in bold, with its 25th–75th percentile where it has one."""
    if r.get("step_p25_ms") is None:
        return f"**{fmt(r['step_ms'])}**"
    return f"**{fmt(r['step_ms'])}** ({fmt(r['step_p25_ms'], 0)}–{fmt(r['step_p75_ms'], 0)})"


def ms_list(values):
    return ", ".join(fmt(v, 0) for v in values or []) or "–"


def per_rank(values, digits=0):
    return " / ".join(fmt(x, digits) for x in values)


def table_row(cells):
    return "| " + " | ".join(cells) + " |"


def at_most(value, bound, digits=2):
    """The verdict on `value <= bound`: met, or by how much it missed."""
    return "met" if value <= bound else f"missed by {fmt(value - bound, digits)}"


def at_least(value, bound, digits=2):
    """The verdict on `value >= bound`: met, or by how much it missed."""
    return "met" if value >= bound else f"missed by {fmt(bound - value, digits)}"
