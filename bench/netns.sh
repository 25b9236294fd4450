#!/usr/bin/env bash
# Network namespaces for a bandwidth-limited multi-rank run on one machine: rank K runs
# in namespace hpbench<K> with address 10.231.0.<K+1> on a veth joined to a bridge, and
# its egress is shaped by a token bucket (tbf) to RATE, like a NIC of that speed. The
# bridge has 10.231.0.254 on this machine's side, where hp-run hosts the job's store.
#
#   bench/netns.sh up N RATE      create N namespaces (e.g. RATE=300mbit); needs root
#   bench/netns.sh down N         remove them
#   bench/netns.sh exec CMD...    run CMD in namespace hpbench$LOCAL_RANK (hp-run sets it)
#
# NETNS_RANKS_PER_NODE=K (exec): ranks K*i .. K*i+K-1 share namespace i, like the GPUs of
# one machine: between them traffic goes over the namespace's loopback, unshaped, and
# only what leaves the "node" is limited to RATE.
#
# Launch: hp-run -n N --master-addr 10.231.0.254 -- bench/netns.sh exec PROG
set -euo pipefail

ns() { echo "hpbench$1"; }
# `ip -n` / `ip netns exec` remount / and fail inside a chroot (the build root), so
# commands enter the namespace with nsenter, which switches the network namespace only.
in_ns() {
  local k=$1
  shift
  nsenter --net="/run/netns/$(ns "$k")" "$@"
}

case "${1:-}" in
  up)
    n=$2 rate=$3
    "$0" down "$n" 2>/dev/null || true
    ip link add hpbbr0 type bridge
    ip link set hpbbr0 up
    ip addr add 10.231.0.254/24 dev hpbbr0
    for ((k = 0; k < n; k++)); do
      ip netns add "$(ns "$k")"
      ip link add "hpbv$k" type veth peer name eth0 netns "$(ns "$k")"
      ip link set "hpbv$k" master hpbbr0 up
      in_ns "$k" ip addr add "10.231.0.$((k + 1))/24" dev eth0
      in_ns "$k" ip link set eth0 up
      in_ns "$k" ip link set lo up
      # Shaping each rank's egress limits every link direction once. The burst holds a
      # few 64 KiB GSO segments, so tbf need not split them.
      in_ns "$k" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 200ms
    done
    ;;
  down)
    n=$2
    for ((k = 0; k < n; k++)); do
      ip link del "hpbv$k" 2>/dev/null || true
      ip netns del "$(ns "$k")" 2>/dev/null || true
    done
    ip link del hpbbr0 2>/dev/null || true
    ;;
  exec)
    shift
    # Gloo must use the namespace's interface (PyTorch's default falls back to loopback
    # when the hostname does not resolve, which would not reach the other ranks).
    export GLOO_SOCKET_IFNAME=eth0
    node=$((${LOCAL_RANK:?run under hp-run} / ${NETNS_RANKS_PER_NODE:-1}))
    exec nsenter --net="/run/netns/$(ns "$node")" "$@"
    ;;
  *)
    echo "usage: $0 up N RATE | down N | exec CMD..." >&2
    exit 2
    ;;
esac
