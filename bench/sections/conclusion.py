"""The parts of the document below the measured sections, which only a full run rewrites:
the targets table's head (its rows come from the sections) and the discussion."""

TITLES = ("Targets", "Discussion")


def write(rep):
    rep.section("Targets")
    rep.p(
        "Step-time verdicts use the larger (less favourable) of the raw ratio and the "
        "own-compute ratio: the raw one alone would credit HyperParallel with the speed of "
        "C++ over Python in the model code and with load changes between the two programs' "
        "runs. Memory verdicts: see the Peak RSS section for the ideal model they use."
    )
    rep.p()
    rep.p("| target | measured | verdict |")
    rep.p("|---|---|---|")
    rep.section("Discussion")
    rep.lines.extend(DISCUSSION.splitlines()[2:])


DISCUSSION = """## Discussion

**Communication is CPU work here.** Gloo over loopback is memcpy through the kernel, done
by Gloo's threads on the same two cores that compute; with 4 ranks on 2 cores there is no
idle core at all. Overlap can hide *waiting* (for the other rank, for the link), not
work the CPU has to do anyway, so on loopback the sharded modes pay for every byte they
move, and comparisons between modes mostly compare CPU work per step: copies, collective
count, dispatch overhead. The bandwidth-limited run is where waiting dominates and
overlap can show.

**What Gloo itself copies and sends (c10d).** The copied-MB column is
deterministic and explains much of the loopback cost:
- `ProcessGroupGloo::_allgather_base` gathers into a temporary flat buffer and copies it
  into the output. So the per-parameter all-gathers, which HyperParallel feeds straight
  from the shard into the final unsharded buffer (no copy-in, no copy-out), still cost
  one full-size copy on a Gloo thread: the "+" part of the column is exactly one full
  model per all-gather round (2 rounds with RAF=true, 1 with RAF=false).
- `_reduce_scatter_base` is `reduce_scatter_tensor_coalesced`, which clones the input,
  **all-reduces** the whole clone and copies this rank's chunk out: it sends as many bytes
  as an all-reduce, 2(W-1)/W of the gradient per rank instead of (W-1)/W, and ignores the
  requested reduce op. FSDP2 on Gloo pays this. HyperParallel's `hp::reduce_scatter`
  does not use it on Gloo: it sends each chunk straight to its owner (`alltoall_base`,
  no clone; (W-1)/W of the gradient) and the owner sums the W chunks it received, in
  rank order, accumulating bf16/fp16 in fp32. With RAF=true a fully-sharded step then
  sends 1.5x the bytes of DDP (two all-gathers and a reduce-scatter vs one all-reduce),
  FSDP2 on Gloo 2x.
- comm_fusion adds the copy-in / copy-out that the per-parameter mode avoids (the
  seed's argument for per-parameter collectives) plus one full-size copy for the
  reduce-scatter input: the main-thread part of the copied column grows by about 3
  model sizes per step. In exchange it issues one collective per module instead of one
  per parameter (9 per decoder block), and each Gloo collective has a fixed cost of the
  order of a millisecond on this loaded 2-core host (thread hand-offs, TCP). Which of
  the two wins depends on the block size and on how loaded the machine is; the ratios
  table shows it per configuration.

**Where the bandwidth-limited run loses time** (the timeline above): (1) the first
all-gathers of a step (root, first block) wait on the link before anything can compute,
and (2) the last reduce-scatters (the first block's and the root's, whose embedding
gradient is complete only when backward ends) have nothing left to overlap with; both
are fixed costs per step, which is why this run uses 8 blocks. (3) Communication is
not free for the CPU (the `CPU ms` column): Gloo's threads and the kernel's TCP and veth
work run on the two cores that compute, so compute in an overlapped step is slower than
in the compute-only step, and that difference counts as exposed communication in the
efficiency. The per-parameter mode issues 9 collectives per block where comm_fusion
issues 1, and each costs CPU time of its own. (4) The two ranks do not compute at the
same speed on the shared host; the faster one waits for the slower one inside the
collectives (dark parts in the middle of the reduce-scatter lane).

**Scheduling overhead.** On one rank, with no collective at all, HyperParallel's cost per
block (`Sharded<M>::operator()`, the hooks, the unshard state machine, the reduction
bookkeeping) is tens of µs, against about a millisecond for FSDP2 (Python hooks, DTensor
bookkeeping in the module and the optimizer, and the 1-rank Gloo collectives it still
issues). On two ranks both are dominated by Gloo: the communication-only row (6
collectives per block, nothing else) costs hundreds of µs of CPU per collective (thread
hand-offs, syscalls and TCP over loopback in this VM) on top of the wait, more than the
whole per-block cost of HyperParallel on one rank. The per-parameter mode issues 6
collectives per `Linear` block against FSDP2's 3, so only comm_fusion (also 3) comes
close; the 1/5 ratio of the 1-rank case cannot show through a floor set by the backend.

**What would change the picture** (not done here): one core per rank plus cores for
communication, bf16 parameters (`--mp bf16` in the demo halves the all-gather bytes),
and NCCL on GPUs, where collectives run on their own engines instead of the cores that
compute. With PyPI's torch (MKL) compute is about 20x faster than with Debian's
reference BLAS, so on loopback communication is now most of a sharded step: the
per-parameter mode's many small Gloo collectives cost more than comm_fusion's few.
"""
