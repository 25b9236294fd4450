#!/usr/bin/env bash
# Two "machines" made of network namespaces joined by a veth pair: rank 0 of WORLD_JOIN
# (the store's host) in one, rank 1 in the other, with HP_TIMEOUT_S=2. Once both joined,
# the link silently drops everything in both directions (a token bucket too small for
# any packet: a partition, not a refused connection); rank 0 comes to the all-reduce 0.5 s
# after joining, rank 1 1 s after, so both need the network after the cut. Prints each
# rank's output as "[rank K] line", then "exit codes S0 S1". Exits 77 with the reason
# where namespaces cannot be made (not root, no iproute2, a chroot).
#   partition.sh WORLD_JOIN
set -u
world_join=$1
a=hpp$$a b=hpp$$b
dir=$(mktemp -d)
cleanup() {
  ip netns del "$a" 2>/dev/null
  ip netns del "$b" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
# `ip netns exec` remounts /, which fails in a chroot; nsenter switches the network only.
in_ns() {
  local ns=$1
  shift
  nsenter --net="/run/netns/$ns" "$@"
}
if ! { ip netns add "$a" && ip netns add "$b" && ip link add "${a}v" type veth peer name "${b}v" &&
       ip link set "${a}v" netns "$a" && ip link set "${b}v" netns "$b" &&
       in_ns "$a" ip addr add 10.233.0.1/24 dev "${a}v" && in_ns "$a" ip link set "${a}v" up &&
       in_ns "$b" ip addr add 10.233.0.2/24 dev "${b}v" && in_ns "$b" ip link set "${b}v" up &&
       in_ns "$a" ip link set lo up && in_ns "$b" ip link set lo up; } 2>"$dir/why"; then
  echo "cannot make network namespaces here: $(head -1 "$dir/why")"
  exit 77
fi
rank() {  # rank K NAMESPACE DEVICE [VAR=VALUE...]
  local k=$1 ns=$2 dev=$3
  shift 3
  in_ns "$ns" env GLOO_SOCKET_IFNAME="$dev" WORLD_JOIN_MARK="$dir/joined$k" RANK="$k" \
    WORLD_SIZE=2 MASTER_ADDR=10.233.0.1 MASTER_PORT=29611 HP_TIMEOUT_S=2 "$@" "$world_join" \
    >"$dir/out$k" 2>&1
}
rank 0 "$a" "${a}v" WORLD_JOIN_SLEEP_S=0.5 &
first=$!
rank 1 "$b" "${b}v" WORLD_JOIN_SLEEP_S=1 &
second=$!
for _ in $(seq 400); do
  [ -e "$dir/joined0" ] && [ -e "$dir/joined1" ] && break
  sleep 0.05
done
in_ns "$a" tc qdisc add dev "${a}v" root tbf rate 8bit burst 1 limit 1
in_ns "$b" tc qdisc add dev "${b}v" root tbf rate 8bit burst 1 limit 1
wait "$first"
status0=$?
wait "$second"
status1=$?
sed 's/^/[rank 0] /' "$dir/out0"
sed 's/^/[rank 1] /' "$dir/out1"
echo "exit codes $status0 $status1"
