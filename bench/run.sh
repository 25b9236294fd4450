#!/usr/bin/env bash
# make bench: every benchmark of docs/performance.md, then rewrites that file from the
# results (bench/report.py; each section's part in bench/sections/SECTION.py) and prints
# its tables.
#
#   scripts/in_env.sh bench/run.sh [BUILD_DIR]      (what `make bench` runs)
#   scripts/in_env.sh bench/run.sh BUILD_DIR --only memory,beyond
#
# Sections: steps (step times), memory (peak RSS on 1, 2, 4 ranks against the ideal
# ZeRO-3 model), beyond (a model bigger than one rank's memory limit), overhead
# (scheduling overhead), netns (bandwidth-limited), checkpoint (how long a save blocks
# training, synchronous vs async), pipeline (the pipeline schedules' step time, bubble and
# activations held on 4 ranks, and the cost of a zero-bubble schedule's split backward),
# recompute (activation recomputation's early stop against whole reruns, one process),
# codecs (quantized collectives: bytes, step time on loopback and bandwidth-limited, and
# the accuracy of 500 training steps), python (the Python package's fully_shard against
# FSDP2 in one program: step time, peak memory, per-module overhead, int8 codecs on the
# bandwidth-limited link).
# --only runs the listed ones and rewrites only their parts of the report (their sections
# and target rows); the rest of docs/performance.md stays as it was.
#
# Environment: BENCH_STEPS / BENCH_WARMUP (timed / warm-up steps of the transformer runs,
# default 6 / 1), BENCH_NETNS=0 skips the bandwidth-limited run (it needs root),
# BENCH_RATE its link rate (default 200mbit), BENCH_NETNS_STEPS its timed steps (default
# 10: its efficiencies are differences of step times), BENCH_MEMORY_SEQ the sequence
# length of the memory runs (default 16), BENCH_BEYOND_LIMIT_MIB the per-rank limit of the
# beyond run (default 1280), BENCH_SAVES the timed saves of each kind in the checkpoint
# run (default 5), BENCH_PIPELINE_FORWARD_MS a pipeline stage's forward per microbatch
# (default 80), BENCH_ACCURACY_SEEDS the seeds of the codecs' accuracy runs (default
# "0 1 2 3 4 5 6 7 8 9"), BENCH_REPORT (default docs/performance.md). Raw results:
# BUILD_DIR/bench/results/{SECTION.jsonl,log.txt}.
set -uo pipefail # no -e: a failed run is recorded in the report, the others still run

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ALL_SECTIONS=steps,memory,beyond,overhead,netns,checkpoint,pipeline,recompute,codecs,python
BUILD=build
SECTIONS=$ALL_SECTIONS
COMMAND="make bench"
while [ $# -gt 0 ]; do
  case $1 in
    --only)
      [ $# -ge 2 ] || { echo "bench/run.sh: --only needs a list, e.g. --only memory" >&2; exit 2; }
      SECTIONS=$2
      shift 2
      ;;
    -*) echo "bench/run.sh: unknown option $1 (usage: bench/run.sh [BUILD_DIR] [--only SECTIONS])" >&2; exit 2 ;;
    *) BUILD=$1; shift ;;
  esac
done
for s in ${SECTIONS//,/ }; do
  [[ ",$ALL_SECTIONS," == *",$s,"* ]] ||
    { echo "bench/run.sh: unknown section '$s' (sections: $ALL_SECTIONS)" >&2; exit 2; }
done
[ "$SECTIONS" = "$ALL_SECTIONS" ] || COMMAND="scripts/in_env.sh bench/run.sh $BUILD --only $SECTIONS"
# The report names the command; settings from the environment are part of it.
for v in BENCH_STEPS BENCH_WARMUP BENCH_NETNS BENCH_RATE BENCH_NETNS_STEPS BENCH_MEMORY_SEQ \
  BENCH_BEYOND_LIMIT_MIB BENCH_SAVES BENCH_GLIBC_TUNABLES BENCH_PIPELINE_FORWARD_MS; do
  [ -z "${!v+x}" ] || COMMAND="$v=${!v} $COMMAND"
done
selected() { [[ ",$SECTIONS," == *",$1,"* ]]; }
STEPS=${BENCH_STEPS:-6}
WARMUP=${BENCH_WARMUP:-1}
RATE=${BENCH_RATE:-200mbit}
NETNS_STEPS=${BENCH_NETNS_STEPS:-10}
REPORT=${BENCH_REPORT:-docs/performance.md}
OUT=$BUILD/bench/results
HP_BENCH=$BUILD/bench/hp_bench
PIPELINE_BENCH=$BUILD/bench/pipeline_bench
RECOMPUTE_BENCH=$BUILD/bench/recompute_bench
PY_BENCH="python3 bench/fsdp2_bench.py"
# fsdp2_bench.py's hyperparallel variants import the package from the build tree.
export PYTHONPATH=$BUILD/python/package${PYTHONPATH:+:$PYTHONPATH}
# Python's TCPStore (FSDP2 runs) needs the non-libuv backend in this torch build.
export USE_LIBUV=0
# Timed runs, C++ and Python alike: glibc keeps freed memory instead of handing blocks of
# 128 KiB and more back to the kernel and faulting them in (zeroed) again on the next
# allocation, which costs ~15% of a step here (the effect PyTorch's CPU tuning guides
# address with jemalloc / tcmalloc). The peak-RSS runs instead map every block of 128 KiB
# or more on allocation and unmap it on free (a fixed mmap threshold): their high-water
# mark then follows the live tensors, not what glibc's heap happens to retain.
TIMING_MALLOC=${BENCH_GLIBC_TUNABLES-glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824}
export GLIBC_TUNABLES=$TIMING_MALLOC

needed=("$BUILD/hp-run")
for s in ${SECTIONS//,/ }; do  # every section but pipeline and recompute runs hp_bench
  case $s in pipeline | recompute) ;; *) needed+=("$HP_BENCH") && break ;; esac
done
selected pipeline && needed+=("$PIPELINE_BENCH")
selected recompute && needed+=("$RECOMPUTE_BENCH")
selected codecs && needed+=("$BUILD/trainer/train_decoder")
for f in "${needed[@]}"; do
  [ -x "$f" ] || { echo "bench/run.sh: $f missing; run 'make build' first" >&2; exit 1; }
done
mkdir -p "$OUT"
for s in ${SECTIONS//,/ }; do : >"$OUT/$s.jsonl"; done
: >"$OUT/log.txt"
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
start_all=$SECONDS
HPRUN_OPTS=()

# launch LABEL NRANKS PROGRAM ARGS...: one multi-rank run; rank 0's RESULT lines are
# appended to $RESULTS (the running section's file), a failure is recorded as a result
# with an error.
launch() {
  local label=$1 n=$2
  shift 2
  local tmp start=$SECONDS rc what=hp_bench
  [[ "$*" == *fsdp2_bench.py* ]] && what=fsdp2_bench
  [[ "$*" == *pipeline_bench* ]] && what=pipeline_bench
  [[ "$*" == *recompute_bench* ]] && what=recompute_bench
  tmp=$(mktemp)
  "$BUILD/hp-run" -n "$n" --timeout 600 "${HPRUN_OPTS[@]}" -- "$@" --label "$label" >"$tmp" 2>&1
  rc=$?
  { echo "=== $label: $*"; cat "$tmp"; } >>"$OUT/log.txt"
  grep -a '^\[rank 0\] RESULT ' "$tmp" | sed 's/^\[rank 0\] RESULT //' >>"$RESULTS"
  if [ "$rc" != 0 ]; then
    # The program's own error line if it printed one, else the last line (the launcher's).
    local why
    why=$(grep -a -m1 'error' "$tmp" | grep -av Warning)
    [ -n "$why" ] || why=$(grep -av Warning "$tmp" | tail -1)
    printf '{"label": "%s", "impl": "%s", "variant": "(run)", "error": "exit %s: %s"}\n' \
      "$label" "$what" "$rc" "$(echo "$why" | tr -d '"\\' | cut -c1-200)" >>"$RESULTS"
  fi
  rm -f "$tmp"
  printf '  %-20s %-12s %4d s  exit %d\n' "$label" "$what" $((SECONDS - start)) "$rc"
}

# The two model sizes (scaled down from the issue's d=512/L=8 and d=1024/L=8, see
# docs/performance.md) and the common batch: 1 sequence of 64 tokens per rank.
declare -A SIZE=([d128L4]="--dim 128 --layers 4 --heads 4" [d256L4]="--dim 256 --layers 4 --heads 4"
  [d128L8]="--dim 128 --layers 8 --heads 4")
COMMON="--vocab 1024 --seq 64 --batch 1"
HP_VARIANTS=local,ddp,comm,hp,hp:fusion,hp:nopf,hp:keep,hp:fusion+keep,hp:fusedopt
PY_VARIANTS=local,fsdp2,fsdp2:prefetch,fsdp2:raf
# Peak-RSS runs: one variant per process (VmHWM is the process's), every block of 128 KiB
# or more mapped on allocation and unmapped on free (see TIMING_MALLOC above).
MEMORY_MALLOC=glibc.malloc.mmap_threshold=131072

section_steps() {
  echo "bench: step times (each run alternates its variants step by step)"
  for size in d128L4 d256L4; do
    for mesh in 1x2 2x2; do
      n=$((${mesh%x*} * ${mesh#*x}))
      # shellcheck disable=SC2086
      launch "$size/$mesh" "$n" "$HP_BENCH" ${SIZE[$size]} $COMMON --mesh "$mesh" \
        --steps "$STEPS" --warmup "$WARMUP" --variants "$HP_VARIANTS"
      # shellcheck disable=SC2086
      launch "$size/$mesh" "$n" $PY_BENCH ${SIZE[$size]} $COMMON --mesh "$mesh" \
        --steps "$STEPS" --warmup "$WARMUP" --variants "$PY_VARIANTS"
    done
  done
}

# The issue's memory model: d=512, 16 blocks (67.7 M parameters, 1.0 GiB of fp32
# parameters, gradients and AdamW state), deferred-initialized, 1 warm-up + 1 timed step
# (the second step runs with the optimizer state in place).
MEMORY_MODEL="--dim 512 --layers 16 --heads 8 --vocab 1024 --seq ${BENCH_MEMORY_SEQ:-16} --batch 1"
section_memory() {
  echo "bench: memory scaling (one variant per process, so VmHWM is that variant's)"
  export GLIBC_TUNABLES=$MEMORY_MALLOC
  for n in 1 2 4; do
    for v in hp hp:keep hp:fusion ddp fsdp2; do
      if [ "$v" = fsdp2 ]; then prog=(python3 bench/fsdp2_bench.py); else prog=("$HP_BENCH" --no-copy-count); fi
      # shellcheck disable=SC2086
      launch "memory/d512L16/1x$n" "$n" "${prog[@]}" $MEMORY_MODEL --mesh "1x$n" --steps 1 \
        --warmup 1 --deferred-init --variants "$v"
    done
  done
  export GLIBC_TUNABLES=$TIMING_MALLOC
}

# A model whose fp32 training state (16 bytes per parameter) exceeds the per-rank limit:
# d=512, 24 blocks, 101 M parameters, 1.5 GiB. The limit is RLIMIT_DATA (set with
# prlimit on each rank's process): the kernel refuses any private writable mapping beyond
# it (malloc'd and mmap'd memory, thread stacks), so an allocation over it fails. Sharded
# on 4 ranks and deferred-initialized it trains; unsharded (1 rank) it cannot. The limit
# leaves room for what a process maps before any model exists: about 590 MiB with the
# CUDA build of torch 2.15 (its libraries' writable data), against 1.5 GiB of state.
BEYOND_MODEL="--dim 512 --layers 24 --heads 8 --vocab 1024 --seq 16 --batch 1"
BEYOND_LIMIT_MIB=${BENCH_BEYOND_LIMIT_MIB:-1280}
section_beyond() {
  echo "bench: bigger than one rank (RLIMIT_DATA ${BEYOND_LIMIT_MIB} MiB per rank)"
  export GLIBC_TUNABLES=$MEMORY_MALLOC
  local limit=(prlimit --data=$((BEYOND_LIMIT_MIB * 1024 * 1024)) --)
  # shellcheck disable=SC2086
  launch "beyond/d512L24/1x4" 4 "${limit[@]}" "$HP_BENCH" --no-copy-count $BEYOND_MODEL \
    --mesh 1x4 --steps 2 --warmup 1 --deferred-init --variants hp
  # The same model, not sharded, eagerly built (as a plain LibTorch program would).
  # shellcheck disable=SC2086
  launch "beyond/d512L24/1x1" 1 "${limit[@]}" "$HP_BENCH" --no-copy-count $BEYOND_MODEL \
    --mesh 1x1 --steps 2 --warmup 1 --variants local
  export GLIBC_TUNABLES=$TIMING_MALLOC
}

section_overhead() {
  echo "bench: scheduling overhead (64 blocks of Linear(8, 8), batch 4)"
  for n in 1 2; do
    launch "tiny/1x$n" "$n" "$HP_BENCH" --model tiny --tiny-blocks 64 --batch 4 --steps 20 \
      --warmup 3 --no-copy-count --variants local,comm,hp,hp:fusion
    launch "tiny/1x$n" "$n" $PY_BENCH --model tiny --tiny-blocks 64 --batch 4 --steps 20 \
      --warmup 3 --variants local,fsdp2
  done
}

# Runs "$@" with the bandwidth-limited link up (2 network namespaces at $RATE each) and
# hp-run's store on the bridge's address, which every namespace reaches. Returns 1,
# running nothing, where the namespaces cannot be made (see $OUT/log.txt).
on_limited_link() {
  if ! bench/netns.sh up 2 "$RATE" >>"$OUT/log.txt" 2>&1; then
    bench/netns.sh down 2 >/dev/null 2>&1
    return 1
  fi
  trap 'bench/netns.sh down 2' EXIT
  HPRUN_OPTS=(--master-addr 10.231.0.254)
  "$@"
  HPRUN_OPTS=()
  bench/netns.sh down 2
  trap - EXIT
}

# The bandwidth-limited runs' model: 8 blocks and 4 sequences per rank, so that per-block
# compute exceeds per-block communication at the link's rate, and the first all-gathers /
# last reduce-scatters of a step (which nothing can hide) are a smaller part of it than
# with 4 blocks.
NETNS_MODEL="${SIZE[d128L8]} --vocab 1024 --seq 64 --batch 4"

netns_runs() {
  # shellcheck disable=SC2086
  launch "netns/d128L8/1x2" 2 bench/netns.sh exec "$HP_BENCH" $NETNS_MODEL \
    --steps "$NETNS_STEPS" --warmup "$WARMUP" --no-copy-count --trace "$OUT/trace" \
    --variants local,comm,comm:keep,comm:keep+gloo,comm:fusion,comm:fusion+keep,ddp,hp,hp:fusion,hp:nopf,hp:keep,hp:fusion+keep,hp:fusion+bucket,hp:fusion+keep+bucket
  # shellcheck disable=SC2086
  launch "netns/d128L8/1x2" 2 bench/netns.sh exec $PY_BENCH $NETNS_MODEL \
    --steps "$NETNS_STEPS" --warmup "$WARMUP" --variants local,fsdp2,fsdp2:prefetch
  # The timeline of docs/performance.md: comm_fusion, rank 1.
  cp "$OUT/trace/hp_fusion_rank1.svg" docs/timeline_bandwidth_limited.svg 2>/dev/null
}

section_netns() {
  [ "${BENCH_NETNS:-1}" != 0 ] || return 0
  echo "bench: bandwidth-limited ($RATE per rank, network namespaces + tbf)"
  on_limited_link netns_runs ||
    echo "  (skipped: could not create network namespaces; see $OUT/log.txt)"
}

# The Python package (python/): hyperparallel.fully_shard against FSDP2 on the same Python
# model, in one program that alternates them step by step; peak RSS from one variant per
# process; per-module overhead on the overhead section's 64 tiny blocks; the int8 codecs
# on the bandwidth-limited link.
python_link_runs() {
  # shellcheck disable=SC2086
  launch "python/netns/d128L8/1x2" 2 bench/netns.sh exec $PY_BENCH $NETNS_MODEL \
    --steps "$NETNS_STEPS" --warmup "$WARMUP" \
    --variants fsdp2,hyperparallel,hyperparallel:fusion,hyperparallel:int8,hyperparallel:fusion+int8
}

section_python() {
  echo "bench: the Python package against FSDP2 (step, memory, overhead, codecs)"
  for n in 2 4; do
    # shellcheck disable=SC2086
    launch "python/d256L4/1x$n" "$n" $PY_BENCH ${SIZE[d256L4]} $COMMON --mesh "1x$n" \
      --steps "$STEPS" --warmup "$WARMUP" \
      --variants local,fsdp2,hyperparallel,hyperparallel:raf,hyperparallel:fusion
  done
  export GLIBC_TUNABLES=$MEMORY_MALLOC
  for v in fsdp2 hyperparallel; do
    # shellcheck disable=SC2086
    launch "python/memory/d512L16/1x4" 4 $PY_BENCH $MEMORY_MODEL --mesh 1x4 --steps 1 \
      --warmup 1 --variants "$v"
  done
  export GLIBC_TUNABLES=$TIMING_MALLOC
  launch "python/tiny/1x2" 2 $PY_BENCH --model tiny --tiny-blocks 64 --batch 4 --steps 20 \
    --warmup 3 --variants local,fsdp2,hyperparallel,hyperparallel:fusion
  if [ "${BENCH_NETNS:-1}" = 0 ] || ! on_limited_link python_link_runs; then
    echo "  (bandwidth-limited part skipped: BENCH_NETNS=0 or no network namespaces)"
  fi
}

# How long a save blocks training (issue 28): the memory runs' d=512/L=16 model on 4
# ranks, save_sharded_checkpoint against AsyncCheckpointSaver with each staging, fork (the
# default) and copy, one after the other (hp_bench --checkpoint). The checkpoints go to
# the build directory, one at a time (about 0.8 GiB), and are removed.
CHECKPOINT_MODEL="--dim 512 --layers 16 --heads 8 --vocab 1024 --seq 16 --batch 1"
section_checkpoint() {
  echo "bench: checkpoint saves (synchronous vs async: fork, copy; 4 ranks)"
  local dir=$BUILD/bench/checkpoints
  rm -rf "$dir"
  # shellcheck disable=SC2086
  launch "checkpoint/d512L16/1x4" 4 "$HP_BENCH" $CHECKPOINT_MODEL --mesh 1x4 --steps 3 \
    --warmup 1 --deferred-init --checkpoint "$dir" --saves "${BENCH_SAVES:-5}"
  rm -rf "$dir"  # what a failed run left
}

# The pipeline schedules (include/hyperparallel/pipeline.h) on S = 4 ranks, M = 2S = 8
# microbatches (GPipe, 1F1B, interleaved 1F1B with V = 2 chunks per rank) and M = S = 4
# (1F1B, interleaved). A stage's compute is sleeping work of a fixed duration (forward F
# ms per microbatch, backward 2F, split over a rank's chunks: bench/pipeline_bench.cpp),
# so that 4 ranks on 2 cores run side by side as 4 devices would; transfers and waits are
# real. F = 80 ms keeps the fixed cost of each action (a receive's round trip, thread
# wake-ups, sleep overshoot: about 2 ms) a small share of it. Then, in one process, the
# backward of two d512 decoder blocks whole and split into its input- and weight-gradient
# halves, as a zero-bubble schedule runs it.
PIPELINE_FORWARD_MS=${BENCH_PIPELINE_FORWARD_MS:-80}
section_pipeline() {
  echo "bench: pipeline schedules (4 ranks, forward ${PIPELINE_FORWARD_MS} ms per stage and microbatch)"
  local run schedule m
  for run in gpipe/8 1f1b/8 interleaved/8 1f1b/4 interleaved/4; do
    schedule=${run%/*} m=${run#*/}
    launch "pipeline/$schedule/m$m" 4 "$PIPELINE_BENCH" --schedule "$schedule" \
      --microbatches "$m" --virtual-stages 2 --forward-ms "$PIPELINE_FORWARD_MS" \
      --activation-mib 16 --steps 3 --warmup 1
  done
  launch "pipeline/split-backward" 1 "$PIPELINE_BENCH" --split-backward --steps 3 --warmup 1
}

# Activation recomputation (include/hyperparallel/recompute.h) in one process: forward and
# backward of 4 d512 decoder blocks without recomputation, every block recomputed whole,
# and with early stop (bench/recompute_bench.cpp), the variants in turn within each step.
section_recompute() {
  echo "bench: activation recomputation, early stop against whole reruns (one process)"
  launch "recompute/d512L4" 1 "$RECOMPUTE_BENCH" --blocks 4 --steps 10 --warmup 1
}

# Quantized collectives (hp::CommPolicy): the netns section's model on 2 ranks, full
# precision against int8 / fp8 weight all-gathers and gradient reduce-scatters, per
# parameter and fused, bytes sent per step counted (hp::wire_bytes); on loopback, then on
# the bandwidth-limited link next to FSDP2. And the secondary partition
# (reshard_after_forward = 2) on 4 ranks in 2 "nodes" of 2 ranks, each node's egress
# limited: the backward all-gathers stay in the node. Then their accuracy: the demo's job
# (make demo's corpus, 500 steps) on 4 ranks with a 1x4 mesh, so that every collective is
# quantized, in full precision, int8 (also with error feedback), fp8, and fp8 weights with
# int8 gradients, once per seed: a run's validation loss moves by a few percent with the
# seed alone, so the codecs are judged on the mean; validated on the whole validation
# split instead of the demo's 8 batches (metrics under $OUT/codecs/<codec>-seed<seed>/).
CODEC_VARIANTS=local,comm,comm:fusion,comm:int8ag+int8rs,hp,hp:int8ag,hp:int8ag+int8rs,hp:int8ag+int8rs+ef,hp:fp8ag+fp8rs,hp:fusion,hp:fusion+bucket,hp:fusion+int8ag+int8rs,hp:fusion+bucket+int8ag+int8rs
NODE_VARIANTS=local,hp,hp:raf2,hp:int8ag+int8rs,hp:int8ag+int8rs+raf2
ACCURACY_SEEDS=${BENCH_ACCURACY_SEEDS:-0 1 2 3 4 5 6 7 8 9}
DEMO_FILES="README.md docs src include models examples tests" # make demo's corpus, in its order
WHOLE_SPLIT=100000 # validation batches per rank: more than the split holds, so all of it

codec_link_runs() {
  # shellcheck disable=SC2086
  launch "codecs/netns/d128L8/1x2" 2 bench/netns.sh exec "$HP_BENCH" $NETNS_MODEL \
    --steps "$NETNS_STEPS" --warmup "$WARMUP" --no-copy-count --variants "$CODEC_VARIANTS"
  # shellcheck disable=SC2086
  launch "codecs/netns/d128L8/1x2" 2 bench/netns.sh exec $PY_BENCH $NETNS_MODEL \
    --steps "$NETNS_STEPS" --warmup "$WARMUP" --variants local,fsdp2
  # shellcheck disable=SC2086
  NETNS_RANKS_PER_NODE=2 launch "codecs/nodes/d128L8/1x4" 4 bench/netns.sh exec "$HP_BENCH" \
    $NETNS_MODEL --mesh 1x4 --steps "$NETNS_STEPS" --warmup "$WARMUP" --no-copy-count \
    --variants "$NODE_VARIANTS"
}

section_codecs() {
  echo "bench: quantized collectives (2 ranks loopback and $RATE; accuracy on 4 ranks)"
  # shellcheck disable=SC2086
  launch "codecs/loopback/d128L8/1x2" 2 "$HP_BENCH" $NETNS_MODEL --steps "$NETNS_STEPS" \
    --warmup "$WARMUP" --no-copy-count --variants "$CODEC_VARIANTS"
  if [ "${BENCH_NETNS:-1}" = 0 ] || ! on_limited_link codec_link_runs; then
    echo "  (bandwidth-limited part skipped: BENCH_NETNS=0 or no network namespaces)"
  fi
  # Every accuracy run reads one copy of the corpus taken now: a run's loss moves with its
  # corpus, and the tree may change while the bench runs.
  local codec flags start rc seed dir path corpus=$OUT/codecs/corpus data=()
  rm -rf "$corpus" && mkdir -p "$corpus" || return
  # shellcheck disable=SC2086
  cp -r $DEMO_FILES "$corpus/" || return
  for path in $DEMO_FILES; do data+=(--data "$corpus/$path"); done
  for seed in $ACCURACY_SEEDS; do
    for codec in none int8 int8-ef fp8 fp8-int8; do
      case $codec in
        none) flags=() ;;
        int8-ef) flags=(--ag-codec int8 --rs-codec int8 --error-feedback) ;;
        fp8-int8) flags=(--ag-codec fp8 --rs-codec int8) ;;
        *) flags=(--ag-codec "$codec" --rs-codec "$codec") ;;
      esac
      dir=$OUT/codecs/$codec-seed$seed
      rm -rf "$dir"
      mkdir -p "$dir"
      start=$SECONDS
      "$BUILD/hp-run" -n 4 --timeout 900 -- "$BUILD/trainer/train_decoder" "${data[@]}" \
        --mesh 1x4 --seed "$seed" --eval-batches "$WHOLE_SPLIT" --out "$dir" "${flags[@]}" \
        >"$dir/log.txt" 2>&1
      rc=$?
      printf '{"label": "codecs/accuracy", "impl": "train_decoder", "variant": "%s", "seed": %d, "metrics": "%s", "seconds": %d, "error": %s}\n' \
        "$codec" "$seed" "$dir/metrics.jsonl" $((SECONDS - start)) \
        "$([ $rc = 0 ] && echo null || echo "\"exit $rc\"")" >>"$RESULTS"
      printf '  %-20s %-12s %4d s  exit %d\n' "codecs/accuracy" "$codec seed $seed" \
        $((SECONDS - start)) "$rc"
    done
  done
}

# Each section writes its own results file, headed by a line saying how it was made.
for s in ${ALL_SECTIONS//,/ }; do
  selected "$s" || continue
  RESULTS=$OUT/$s.jsonl
  section_start=$SECONDS
  section_load=$(cut -d' ' -f1-3 /proc/loadavg)
  "section_$s"
  printf '{"meta": "%s", "seconds": %d, "command": "%s", "load_before": "%s", "load_after": "%s"}\n' \
    "$s" $((SECONDS - section_start)) "$COMMAND" "$section_load" \
    "$(cut -d' ' -f1-3 /proc/loadavg)" >>"$RESULTS"
done

elapsed=$((SECONDS - start_all))
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
results=()
for s in ${ALL_SECTIONS//,/ }; do [ -s "$OUT/$s.jsonl" ] && results+=("$OUT/$s.jsonl"); done
only=()  # a partial run rewrites only its parts of the report
[ "$SECTIONS" = "$ALL_SECTIONS" ] || only=(--only "$SECTIONS")
python3 bench/report.py --results "${results[@]}" "${only[@]}" --out "$REPORT" \
  --seconds "$elapsed" --load-before "$load_before" --load-after "$load_after" \
  --steps "$STEPS" --warmup "$WARMUP" --rate "$RATE" --netns-steps "$NETNS_STEPS" \
  --malloc "$TIMING_MALLOC" --memory-malloc "$MEMORY_MALLOC"
