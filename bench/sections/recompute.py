"""Activation recomputation (bench/run.sh section recompute): 4 decoder blocks in one
process without recomputation, recomputed whole, and with early stop."""

from reporting.formatting import fmt

TITLE = "Activation recomputation"
TARGETS = ()

# The recompute_bench variants, in table order: (variant, title).
ROWS = [
    ("none", "no recomputation"),
    ("whole", "every block recomputed, whole reruns (`early_stop = false`)"),
    ("early_stop", "every block recomputed, early stop (the default)"),
]


def write(rep, args):
    runs = rep.runs("recompute/")
    if not runs:
        return
    p = rep.p
    rep.section(TITLE)
    rep.failed(runs)
    r = next((x for x in runs if not x.get("error")), None)
    if r is None:
        return
    v = r["variants"]
    p(
        f"`hp::recompute` around each of {r['model']} (`models::DecoderBlock`: attention, "
        "then a SwiGLU MLP), in one process with "
        f"{r['threads']} threads, no communication (`bench/recompute_bench`): the three "
        f"variants run in turn within each step, means of {r['steps']} steps after 1 warm-up "
        "step. Early stop ends a block's rerun once it has saved the last tensor its forward "
        "saved: the input of the MLP's down projection, which the matmul saves before it "
        "computes, so the rerun skips that matmul and the residual add. " + rep.made_by("recompute")
    )
    p()
    base = v["none"]
    p("| variant | forward ms | backward ms | step ms | vs no recomputation |")
    p("|---|---:|---:|---:|---:|")
    for key, title in ROWS:
        x = v[key]
        step = x["forward_ms"] + x["backward_ms"]
        p(
            f"| {title} | {fmt(x['forward_ms'])} | {fmt(x['backward_ms'])} | **{fmt(step)}** | "
            f"{fmt(step / (base['forward_ms'] + base['backward_ms']), 2)}x |"
        )
    p()
    whole = v["whole"]["backward_ms"] - base["backward_ms"]
    early = v["early_stop"]["backward_ms"] - base["backward_ms"]
    sums = {x["input_grad_abs_sum"] for x in v.values()}
    p(
        f"The rerun's cost (backward minus the backward without recomputation): "
        f"**{fmt(whole)} ms** whole, **{fmt(early)} ms** with early stop "
        f"({fmt(early / whole, 2) if whole > 0 else '–'}x). The down projection is about a "
        "quarter of a block's matmul work at ffn = 4·dim (dim·ffn of 4·dim² + 3·dim·ffn "
        "multiply-adds per token, attention's scores aside), so a rerun that skips it costs "
        "about 3/4 of a whole one. The input's gradient is "
        + (
            "the same in the three variants (sum of its magnitudes); the tests compare "
            "every gradient bit for bit."
            if len(sums) == 1
            else "**not the same** in the three variants: " + ", ".join(map(str, sorted(sums)))
        )
    )
    p()
