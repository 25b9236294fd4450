"""Peak RSS (bench/run.sh section memory): one model's peak memory per rank on 1, 2 and 4
ranks, one variant per process, against the ideal ZeRO-3 model."""

from reporting.formatting import MIB, fmt, ratio

TITLE = "Peak RSS"
TARGETS = ("peak RSS", "peak <= ideal", "RAF=true below")


def activation_bytes(model):
    """fp32 bytes autograd keeps from forward to backward for one sequence batch of
    models/transformer.h (`bench/fsdp2_bench.py` is the same model), counted from its
    forward: per block 2 per RMSNorm (normalized, scaled), q, k, v and the merged heads
    (4), the residual sum and the block output (2): 10 x [B, T, d]; the SwiGLU's w1, silu,
    w3 and product: 4 x [B, T, ffn]; the softmax probabilities [B, heads, T, T]. Outside
    the blocks: the embedding sum, the final norm's 2, logits and log-softmax [B, T, vocab]."""
    b, t, d = model["batch"], model["seq"], model["dim"]
    per_block = 10 * b * t * d + 4 * b * t * model["ffn"] + b * model["heads"] * t * t
    outside = 3 * b * t * d + 2 * b * t * model["vocab"]
    return 4 * (model["layers"] * per_block + outside)


def ideal_zero3_mib(r, ranks, base_mib):
    """The ideal ZeRO-3 peak of one rank: 16 bytes per parameter (fp32 parameter, gradient
    and AdamW's two moments) / N, two blocks unsharded with their gradients (8 bytes per
    parameter: the block computing and the one prefetched or still reducing), activations,
    and the process baseline. On one rank nothing is unsharded beyond the state itself."""
    unsharded = 2 * 8 * r["block_params"] if ranks > 1 else 0
    return base_mib + (16 * r["params"] / ranks + unsharded + activation_bytes(r["model"])) / MIB


def rss_ok(r):
    return not r.get("error") and bool(r.get("peak_rss_mib"))


def rss_summary(r):
    """(peak, baseline, peak - baseline, boundary - baseline): max over ranks, MiB."""
    peaks, bases = r["peak_rss_mib"], r["base_rss_mib"]
    bounds = r.get("boundary_rss_mib") or []
    return (
        max(peaks),
        max(bases),
        max(a - b for a, b in zip(peaks, bases)),
        max((a - b for a, b in zip(bounds, bases)), default=None),
    )


def write(rep, args):
    runs = rep.runs("memory/")
    if not runs:
        return
    ref = next((r for r in runs if r.get("model") and r.get("params")), None)
    rep.section(TITLE)
    if ref is None:
        rep.p("No memory run succeeded; see `build/bench/results/log.txt`.")
        rep.p()
        return
    model_text(rep, ref)
    columns_text(rep, args, ref)
    found = table(rep, ref)
    freed_target = raf_text(rep, ref)
    for n in (1, 2, 4):
        ideal_targets(rep, found, n)
        raf_target(rep, found, n, ref, freed_target)
        fsdp2_target(rep, found, n)


def model_text(rep, ref):
    model, params, block = ref["model"], ref["params"], ref["block_params"]
    rep.p(
        f"Memory scaling of one model: dim {model['dim']}, **{model['layers']} blocks**, "
        f"{model['heads']} heads, ffn {model['ffn']}, vocabulary {model['vocab']}: "
        f"**{params / 1e6:.1f} M parameters** ({block / 1e6:.2f} M per block), "
        f"**{16 * params / MIB:.0f} MiB of fp32 training state** (parameter, gradient, two "
        f"AdamW moments: 16 bytes per parameter) when nothing is sharded. {model['batch']} "
        f"sequence of {model['seq']} tokens per rank, 1 warm-up + 1 timed step (the second "
        "step runs with the optimizer state in place). Every model is built with deferred "
        "initialization (`hp_bench --deferred-init`: `hp::deferred_init`, fully_shard, "
        "`hp::materialize`; FSDP2: the meta device, `fully_shard`, `to_empty`, init), so no "
        "rank ever holds the whole model; the DDP baseline materializes it whole, as it must. "
        "One variant per process, so the process's high-water mark (VmHWM) is the variant's. "
        + rep.made_by("memory")
    )
    rep.p()


def columns_text(rep, args, ref):
    block = ref["block_params"]
    rep.p(
        "`baseline`: RSS after start-up (LibTorch, Gloo, the process groups; for Python also "
        "the interpreter and its imports), before any model exists. `above baseline`: max "
        "over ranks of (VmHWM - baseline). `at fwd/bwd`: RSS at the end of the last "
        "step's forward, minus the baseline (max over ranks): what is held between forward "
        "and backward. `ideal ZeRO-3` = baseline + 16 bytes x parameters / N + 2 blocks "
        f"unsharded with their gradients (8 bytes x {block / 1e6:.2f} M x 2 = "
        f"{16 * block / MIB:.0f} MiB; none on 1 rank) + activations "
        f"({activation_bytes(ref['model']) / MIB:.0f} MiB, "
        "counted from the model's forward: `activation_bytes` in `bench/sections/memory.py`). It "
        "applies to the variants that reshard after forward (hp, hp comm_fusion). Peak-RSS "
        f"runs set `GLIBC_TUNABLES={args.memory_malloc}`: blocks of 128 KiB or more are "
        "mapped on allocation and unmapped on free, so RSS follows the live tensors."
    )
    rep.p()


def table(rep, ref):
    """The table of every run; returns (ranks, variant) -> (peak, base, above, boundary,
    ideal)."""
    rep.p(
        "| ranks | variant | peak RSS MiB (max rank) | baseline MiB | above baseline MiB | "
        "at fwd/bwd MiB | ideal ZeRO-3 MiB | peak / ideal |"
    )
    rep.p("|---:|---|---:|---:|---:|---:|---:|---:|")
    found = {}
    for n in (1, 2, 4):
        label = f"memory/d{ref['model']['dim']}L{ref['model']['layers']}/1x{n}"
        for src, variant, title, r in rep.rows(label, columns=8, prefix=f"{n} | ", good=rss_ok):
            peak, base, above, boundary = rss_summary(r)
            ideal = None
            if variant in ("hp", "hp:fusion") and r.get("params"):
                ideal = ideal_zero3_mib(r, n, base)
            found[(n, variant)] = (peak, base, above, boundary, ideal)
            rep.p(
                f"| {n} | {title} | {fmt(peak)} | {fmt(base)} | {fmt(above)} | {fmt(boundary)} "
                f"| {fmt(ideal)} | {fmt(ratio(peak, ideal), 2)} |"
            )
    rep.p()
    return found


def raf_text(rep, ref):
    """What RAF=true frees against RAF=false, and the issue's bound on it (returned, MiB)."""
    layers, block = ref["model"]["layers"], ref["block_params"]
    freed_target = 0.8 * (layers - 2) * 4 * block / MIB
    rep.p(
        f"RAF=false keeps every block's parameters unsharded from its forward to its "
        f"backward ({layers} x {4 * block / MIB:.0f} MiB); RAF=true frees them after each "
        f"block's forward and holds about 2. The issue's bound on the difference: 80% of "
        f"({layers}-2)/{layers} of the blocks' unsharded bytes = **{freed_target:.0f} MiB**. "
        "The `at fwd/bwd` column is where that difference is made; the peak of RAF=true "
        "comes later (where `above baseline` exceeds `at fwd/bwd`: in backward, with the "
        "gradients arriving, or in the optimizer step), when RAF=false has resharded the "
        "blocks it finished too, so the peaks differ by less than the boundary does. The "
        "DDP baseline also holds one flat copy of all gradients for its all-reduce "
        "(`hp_bench`'s `ddp`); FSDP2's Python process starts about 165 MiB higher, so "
        "its rows compare best on `above baseline`."
    )
    rep.p()
    return freed_target


def ideal_targets(rep, found, n):
    for variant in ("hp", "hp:fusion"):
        got = found.get((n, variant))
        if got and got[4]:
            r = got[0] / got[4]
            rep.target(
                (
                    f"peak <= ideal ZeRO-3 + 10%, `{variant}`, {n} rank(s)",
                    f"{fmt(got[0], 0)} vs {fmt(got[4], 0)} MiB = {fmt(r, 2)}",
                    "met" if r <= 1.1 else f"missed by {fmt(got[0] - 1.1 * got[4], 0)} MiB",
                )
            )


def raf_target(rep, found, n, ref, freed_target):
    hp_, keep = found.get((n, "hp")), found.get((n, "hp:keep"))
    if not (n > 1 and hp_ and keep):
        return
    layers, block = ref["model"]["layers"], ref["block_params"]
    peak_gap, bound_gap = keep[0] - hp_[0], None
    if keep[3] is not None and hp_[3] is not None:
        bound_gap = keep[3] - hp_[3]
    # What RAF frees exists between forward and backward, so the bound applies at
    # that boundary. The peaks come later and differ by less even ideally: RAF=true
    # peaks with every sharded gradient present (4 bytes x parameters / N) and 2
    # blocks unsharded, when RAF=false has freed its first blocks already.
    peak_bound = 4 * block * (layers - 4) / MIB - 4 * ref["params"] / n / MIB
    at_boundary = bound_gap is not None and bound_gap >= freed_target
    if not at_boundary:
        verdict = f"missed at fwd/bwd by {fmt(freed_target - (bound_gap or 0), 0)} MiB"
    else:
        verdict = "met" if peak_gap > 0 else "missed: the peak is not lower"
    rep.target(
        (
            f"RAF=true below RAF=false by >= {freed_target:.0f} MiB, {n} ranks",
            f"at fwd/bwd {fmt(bound_gap, 0)} MiB lower; peak {fmt(hp_[0], 0)} vs "
            f"{fmt(keep[0], 0)} MiB: {fmt(peak_gap, 0)} MiB lower (the ideal model "
            f"allows {fmt(peak_bound, 0)} MiB at peak)",
            verdict,
        )
    )


def fsdp2_target(rep, found, n):
    keep, f2 = found.get((n, "hp:keep")), found.get((n, "fsdp2"))
    if not (keep and f2):
        return
    verdict = "met" if keep[0] <= f2[0] else "missed"
    verdict += ", also above baseline" if keep[2] <= f2[2] else ", but not above baseline"
    rep.target(
        (
            f"peak RSS <= FSDP2's at RAF=false, {n} rank(s)",
            f"{fmt(keep[0], 0)} vs {fmt(f2[0], 0)} MiB; above baseline "
            f"{fmt(keep[2], 0)} vs {fmt(f2[2], 0)} MiB",
            verdict,
        )
    )
