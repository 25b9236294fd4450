"""Pipeline schedules (bench/run.sh section pipeline): GPipe, 1F1B and interleaved 1F1B
on 4 ranks with timed sleeping work, against their theory (step, bubble, waits,
activations held), and the cost of a zero-bubble schedule's split backward."""

import os

from reporting.formatting import fmt, per_rank

TITLE = "Pipeline schedules"
TARGETS = ("1F1B peak activations", "interleaved step", "measured bubble")

# The pipeline runs of bench/run.sh (section pipeline), in table order: (schedule, title).
SCHEDULES = (
    ("gpipe", "GPipe"),
    ("1f1b", "1F1B"),
    ("interleaved", "interleaved 1F1B"),
)


def pipeline_actions(r):
    """Forwards and backwards of one rank in a step: 2 per microbatch and chunk."""
    return 2 * r["microbatches"] * r["virtual_stages"]


def pipeline_theory_step(r):
    """The step the theory predicts: a rank's compute over the share of the step it is busy."""
    return r["compute_ms"] / (1 - r["theoretical_bubble"])


def pipeline_theory_wait(r, rank):
    """What rank `rank` waits for its receives in a step, in theory. Its step starts with
    the others' (a barrier) and ends with its last backward: rank r starts computing r
    forward hops after rank 0 (F/V each) and finishes r backward hops (2F/V each) before it,
    so of the bubble (S-1)(F+2F)/V that the slowest rank (0) waits, rank r waits
    (S-1)·3F/V - r·2F/V."""
    s, v, f = r["stages"], r["virtual_stages"], r["forward_ms"]
    return (s - 1) * 3 * f / v - rank * 2 * f / v


def pipeline_theory_activations(r, rank):
    """The most activations (MiB) rank `rank` holds at once, in theory: GPipe all M
    microbatches', 1F1B min(S - r, M) (its warm-up forwards and one more), interleaved
    ((S-r-1)·2 + (V-1)·S + 1) chunks of A/V each (Megatron-LM's warm-up and one more),
    never more than M·A, and M·A when M = S (Megatron-LM's rule, which the schedule
    follows: no steady phase, every forward first)."""
    s, m, v, a = r["stages"], r["microbatches"], r["virtual_stages"], r["activation_mib"]
    if r["schedule"] == "gpipe":
        return m * a
    if r["schedule"] == "1f1b":
        return min(s - rank, m) * a
    if m == s:
        return m * a
    return min(((s - rank - 1) * 2 + (v - 1) * s + 1) * a / v, m * a)


def cost_per_action(r):
    """The step's excess over the theory, spread over a rank's actions."""
    return (r["step_ms"] - pipeline_theory_step(r)) / pipeline_actions(r)


def write(rep, args):
    runs = rep.runs("pipeline/")
    if not runs:
        return
    rep.section(TITLE)
    sched = [r for r in runs if r.get("schedule") and not r.get("error")]
    split = next((r for r in runs if r.get("split_backward") and not r.get("error")), None)
    ref = sched[0] if sched else None
    if ref:
        setup_text(rep, ref, sched)
        columns_text(rep)
    found = {}  # (schedule, microbatches) -> result
    for m in sorted({r["microbatches"] for r in sched}, reverse=True):
        found.update(schedules_table(rep, sched, m))
    rep.failed(runs)
    if sched:
        theory_text(rep, ref, found)
    if split:
        split_table(rep, split)
        one = found.get(("1f1b", 2 * ref["stages"])) if ref else None
        if one:
            zero_bubble_text(rep, split, one)
    s = ref["stages"] if ref else None
    gp, one, il = (found.get((k, 2 * s)) if s else None for k in ("gpipe", "1f1b", "interleaved"))
    activations_target(rep, s, gp, one)
    interleaved_target(rep, s, one, il)
    bubble_targets(rep, s, found)


def setup_text(rep, ref, sched):
    p = rep.p
    s, f, a = ref["stages"], ref["forward_ms"], ref["activation_mib"]
    p(
        f"The schedules of `include/hyperparallel/pipeline.h` on **S = {s} ranks** (one "
        f"stage each; interleaved: V = {max(r['virtual_stages'] for r in sched)} chunks "
        f"each), with M = 2S = {2 * s} and M = S = {s} microbatches per step, "
        f"{ref['steps']} timed steps after 1 warm-up step (`bench/pipeline_bench`, under "
        f"`hp-run -n {s}`). A stage's compute is **timed sleeping work**: a forward of "
        f"**F = {fmt(f, 0)} ms** per microbatch and a backward of 2F (a model's usual ratio), "
        "split evenly over a rank's chunks, which keeps "
        f"**A = {fmt(a, 0)} MiB** of activations per microbatch from its forward to its "
        "backward (allocated, and counted while held). It sleeps rather than computes "
        f"because this machine has {os.cpu_count()} cores for {s} ranks: real compute "
        "would run the stages two at a time and measure the cores, not the schedule. "
        "With sleeping work the stages run side by side as they would on S devices, "
        "while the schedule, its transfers (Gloo over loopback) and its waits are the "
        "real ones. " + rep.made_by("pipeline")
    )
    p()


def columns_text(rep):
    p = rep.p
    p(
        "`step ms`: the slowest rank's mean step. `bubble` = 1 - compute / step, with "
        "compute = 3·F·M (a rank's forwards and backwards); `theory` = "
        "(S-1)/(V·M+S-1) (V = 1 but for interleaved). `cost per action` = (step - "
        "theoretical step) / actions per rank, with the theoretical step = compute / (1 "
        "- theory) and 2·M·V actions (forwards and backwards) per rank. `waits`: time "
        "each rank spent waiting on its receives (from its trace), rank 0 first; in "
        "parentheses the theory, (S-1)·3F/V - r·2F/V for rank r (rank r starts r "
        "forward hops after rank 0 and ends r backward hops before it; a rank's step "
        "ends with its own last backward). `activations`: the most activations a rank "
        "held at once in the last step, rank 0 first; in parentheses the theory: GPipe "
        "M·A on every rank, 1F1B min(S-r, M)·A on rank r (its S-r-1 warm-up forwards "
        "and one more), interleaved ((S-r-1)·2 + (V-1)·S + 1)·A/V on rank r (Megatron-LM's "
        "warm-up and one more), at most M·A, and M·A on every rank when M = S (Megatron-LM's "
        "rule, which the schedule follows: with as many microbatches as stages it runs "
        "every forward first)."
    )
    p()


def schedules_table(rep, sched, m):
    """The table of the schedules run with `m` microbatches; returns (schedule, m) -> result."""
    p = rep.p
    found = {}
    s = next(r["stages"] for r in sched if r["microbatches"] == m)
    what = "2S" if m == 2 * s else "S" if m == s else f"{m / s:g}S"
    p(f"### M = {what} = {m} microbatches, S = {s}")
    p()
    p(
        "| schedule | step ms | bubble | theory | difference (points) | cost per action ms "
        "| waits ms per rank (theory) | activations MiB per rank (theory) |"
    )
    p("|---|---:|---:|---:|---:|---:|---|---|")
    for key, title in SCHEDULES:
        r = next((x for x in sched if x["schedule"] == key and x["microbatches"] == m), None)
        if r is None:
            continue
        found[(key, m)] = r
        if r["virtual_stages"] > 1:
            title += f", V = {r['virtual_stages']}"
        ranks = range(r["stages"])
        p(
            f"| {title} | **{fmt(r['step_ms'], 0)}** | {fmt(r['bubble'], 3)} | "
            f"{fmt(r['theoretical_bubble'], 3)} | "
            f"{100 * (r['bubble'] - r['theoretical_bubble']):+.1f} | {fmt(cost_per_action(r))} | "
            f"{per_rank(x['wait_ms'] for x in r['ranks'])} "
            f"({per_rank(pipeline_theory_wait(r, k) for k in ranks)}) | "
            f"{per_rank(x['activations_mib'] for x in r['ranks'])} "
            f"({per_rank(pipeline_theory_activations(r, k) for k in ranks)}) |"
        )
    p()
    return found


def theory_text(rep, ref, found):
    """The measured steps and waits against the theory, and the fixed cost per action that
    accounts for the difference."""
    p = rep.p
    costs = {f"{key} M={m}": cost_per_action(r) for (key, m), r in found.items()}
    excess = [
        x["wait_ms"] - pipeline_theory_wait(r, k)
        for r in found.values()
        for k, x in enumerate(r["ranks"])
    ]
    p(
        "**Measured against theory.** The theory counts compute only; each action also "
        "pays a fixed cost: a receive's rendezvous (the sender's and receiver's round "
        f"trip through Gloo), the wake-ups of {ref['stages']} processes' threads on "
        f"{os.cpu_count()} cores, and the sleep's overshoot. Spread over the actions of a "
        f"rank it comes to {fmt(min(costs.values()))}–{fmt(max(costs.values()))} ms per "
        "action here, which puts each step that many milliseconds times 2·M·V above "
        "the theory. Interleaving has V times the actions, each V times shorter, so the "
        "same fixed cost is a larger share of its step: with shorter stages (at F = 20 "
        "ms, by hand, about 1.6 ms per action for 1F1B and 2.7 ms for interleaved) its "
        "measured bubble was 11 points above theory (0.271 against 0.158, a separate "
        "check), which is why this run uses "
        f"F = {fmt(ref['forward_ms'], 0)} ms. The waits follow the theory rank by rank, "
        f"{fmt(min(excess), 0)}–{fmt(max(excess), 0)} ms above it for the same reason. "
        "The fixed cost grows with the machine's load, since each wake-up waits for a "
        "core: in a separate run of this section at a load average of about 7 (other "
        "jobs compiling and testing), it came to 2.2–5.1 ms per action, interleaved's "
        "bubble at M = 2S was 5.6 points above theory (0.214 against 0.158) and its step "
        "0.91x 1F1B's, missing two of the targets below; GPipe and 1F1B stayed within "
        "2.2 points."
    )
    p()


def split_table(rep, split):
    p = rep.p
    whole, bi, bw = split["whole_ms"], split["input_grad_ms"], split["weight_grad_ms"]
    both = bi + bw
    p("### Zero-bubble schedules: the split backward")
    p()
    p("| backward of 2 decoder blocks (dim 512, ffn 2048, 8 x 128 tokens) | ms |")
    p("|---|---:|")
    p(f"| whole (`torch::autograd::backward`) | **{fmt(whole)}** |")
    p(f"| input-gradient half B (`autograd::grad` to the input, graph kept) | {fmt(bi)} |")
    p(f"| weight-gradient half W (`autograd::grad` to the parameters) | {fmt(bw)} |")
    p(f"| B + W | **{fmt(both)}** ({fmt(both / whole, 2)}x the whole) |")
    p()


def zero_bubble_text(rep, split, one):
    """What ZB-H1 would gain at the measured cost of splitting the backward in two passes."""
    p = rep.p
    whole, bi, bw = split["whole_ms"], split["input_grad_ms"], split["weight_grad_ms"]
    both = bi + bw
    s, m, f = one["stages"], one["microbatches"], one["forward_ms"]
    back = 2 * f
    extra = (both / whole - 1) * back  # per microbatch and rank
    # ZB-H1 (Qi et al., 2023): bubble (S-1)(T_F + T_B - T_W) against 1F1B's
    # (S-1)(T_F + T_B + T_W). With the halves at the measured shares of the backward:
    t_b, t_w = back * bi / whole, back * bw / whole
    zb_step = m * (f + t_b + t_w) + (s - 1) * (f + t_b - t_w)
    ideal_gain = 2 * (s - 1) * (back / 2)  # halves of equal cost adding up to the whole
    one_theory = pipeline_theory_step(one)
    p(
        "ZB-H1 (Zero Bubble Pipeline Parallelism, Qi et al., ICLR 2024) splits each "
        "backward into B, the gradient of the stage's input (which the previous "
        "stage waits for), and W, the gradient of its weights (which nobody waits "
        "for), and runs the W's in what would be the bubble: its bubble is "
        "(S-1)·(T_F + T_B - T_W) against 1F1B's (S-1)·(T_F + T_B + T_W). That pays "
        "only if B + W cost about what the whole backward costs. Here they do not: "
        "LibTorch's engine has no call that stops a backward at the input and later "
        "resumes it for the weights, so the split is two passes over the graph "
        "(`autograd::grad` to the input keeping the graph, then `autograd::grad` to "
        "the parameters, which runs again from the output through every node on the "
        "way), and B + W cost "
        f"**{fmt(both / whole, 2)}x** the whole backward "
        f"({fmt(bi, 0)} + {fmt(bw, 0)} ms against {fmt(whole, 0)} ms). "
        f"Scaled to the schedules above (backward 2F = {fmt(back, 0)} ms), that is "
        f"**+{fmt(extra, 0)} ms of compute per microbatch**, {fmt(m * extra, 0)} ms "
        f"per step and rank at S = {s}, M = {m}, against **{fmt(ideal_gain, 0)} ms "
        "of bubble** that ZB-H1 removes at best (2·(S-1)·T_W with B and W of equal "
        f"cost, F each; 1F1B's whole bubble is {fmt(one_theory - one['compute_ms'], 0)} "
        f"ms in theory, {fmt(one['step_ms'] - one['compute_ms'], 0)} ms measured). With "
        f"the measured halves (T_B = {fmt(t_b, 0)}, T_W = {fmt(t_w, 0)} ms) ZB-H1's "
        f"step would be {fmt(zb_step, 0)} ms, {zb_versus_1f1b(one, zb_step, ideal_gain)}. So no zero-bubble schedule "
        "is built: it needs a W pass that does "
        "not redo B's work, which takes more than two `autograd::grad` calls (PyTorch's "
        "Python pipelining does it in `stage_backward_input` / "
        "`stage_backward_weight`: pre-hooks on the graph nodes where the weights' "
        "paths leave the input's keep the gradients arriving there during B, and W "
        "starts from those nodes instead of from the output)."
    )
    p()


def zb_versus_1f1b(one, zb_step, ideal_gain):
    """ZB-H1's step in theory against 1F1B's, and what its extra actions cost."""
    one_theory = pipeline_theory_step(one)
    if zb_step >= one_theory:
        return f"longer than 1F1B's {fmt(one_theory, 0)} ms in theory"
    m, action_cost = one["microbatches"], cost_per_action(one)
    return (
        f"against 1F1B's {fmt(one_theory, 0)} ms in theory: "
        f"{fmt(one_theory - zb_step, 0)} ms shorter, about what its M more "
        f"actions per step (the W's) cost at 1F1B's measured fixed cost per action "
        f"({m} x {fmt(action_cost)} = {fmt(m * action_cost, 0)} ms), against the "
        f"{fmt(ideal_gain, 0)} ms a split at no extra cost would save"
    )


def activations_target(rep, s, gp, one):
    if not (gp and one):
        return
    g0, o0 = gp["ranks"][0]["activations_mib"], one["ranks"][0]["activations_mib"]
    bound = s / one["microbatches"]
    rep.target(
        (
            f"1F1B peak activations <= S/M of GPipe's (rank 0, S = {s}, M = {one['microbatches']})",
            f"{fmt(o0, 0)} vs {fmt(g0, 0)} MiB = {fmt(o0 / g0, 2)} (S/M = {fmt(bound, 2)})",
            "met" if o0 <= bound * g0 + 1e-9 else f"missed ({fmt(o0 / g0, 2)} > {fmt(bound, 2)})",
        )
    )


def interleaved_target(rep, s, one, il):
    if not (one and il):
        return
    q = il["step_ms"] / one["step_ms"]
    rep.target(
        (
            f"interleaved step <= 0.9x 1F1B at M = 2S (S = {s}, M = {il['microbatches']}, "
            f"V = {il['virtual_stages']}, F = {fmt(il['forward_ms'], 0)} ms)",
            f"{fmt(il['step_ms'], 0)} vs {fmt(one['step_ms'], 0)} ms = {fmt(q, 3)} (theory "
            f"{fmt(pipeline_theory_step(il) / pipeline_theory_step(one), 3)})",
            "met" if q <= 0.9 else f"missed ({fmt(q, 3)} > 0.9)",
        )
    )


def bubble_targets(rep, s, found):
    for key, title in SCHEDULES:
        r = found.get((key, 2 * s)) if s else None
        if r is None:
            continue
        gap = 100 * (r["bubble"] - r["theoretical_bubble"])
        rep.target(
            (
                f"measured bubble within 5 percentage points of theory, {title}, M = 2S = "
                f"{r['microbatches']} (F = {fmt(r['forward_ms'], 0)} ms)",
                f"{fmt(r['bubble'], 3)} vs {fmt(r['theoretical_bubble'], 3)}: {gap:+.1f} points",
                "met" if abs(gap) <= 5 else f"missed by {fmt(abs(gap) - 5)} points",
            )
        )
