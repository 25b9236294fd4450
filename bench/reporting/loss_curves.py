"""A loss-curve plot as SVG, written without a plotting library."""


def loss_curves_svg(runs, path):
    """Training loss (lines) and validation loss (dots) of each run against the step."""
    width, height, left, right, top, bottom = 720, 360, 60, 150, 20, 40
    points = [(m["step"], m["loss"]) for _, ms in runs for m in ms]
    if not points:
        return False
    max_step = max(s for s, _ in points)
    lo = min(l for _, l in points)
    hi = max(l for _, l in points)
    x = lambda step: left + (width - left - right) * step / max_step  # noqa: E731
    y = lambda loss: top + (height - top - bottom) * (hi - loss) / (hi - lo)  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
        f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle">step</text>',
        f'<text x="{left - 6}" y="{y(hi) + 4}" text-anchor="end">{hi:.2f}</text>',
        f'<text x="{left - 6}" y="{y(lo) + 4}" text-anchor="end">{lo:.2f}</text>',
        f'<text x="{x(max_step)}" y="{height - bottom + 16}" text-anchor="middle">{max_step}</text>',
    ]
    for (_, records), color in zip(runs, colors):
        train = " ".join(f"{x(m['step']):.1f},{y(m['loss']):.1f}" for m in records)
        out.append(
            f'<polyline points="{train}" fill="none" stroke="{color}" stroke-width="1.2" opacity="0.8"/>'
        )
        for m in records:
            if "validation_loss" in m:
                out.append(
                    f'<circle cx="{x(m["step"]):.1f}" cy="{y(m["validation_loss"]):.1f}" r="3.5" fill="{color}"/>'
                )
    for i, ((name, _), color) in enumerate(zip(runs, colors)):
        ly = top + 20 + 18 * i
        out.append(
            f'<line x1="{width - right + 10}" y1="{ly}" x2="{width - right + 30}" y2="{ly}" stroke="{color}" stroke-width="2"/>'
        )
        out.append(f'<text x="{width - right + 36}" y="{ly + 4}">{name}</text>')
    out.append(
        f'<text x="{width - right + 10}" y="{top + 20 + 18 * len(runs) + 8}">lines: training</text>'
    )
    out.append(
        f'<text x="{width - right + 10}" y="{top + 20 + 18 * len(runs) + 24}">dots: validation</text>'
    )
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return True
