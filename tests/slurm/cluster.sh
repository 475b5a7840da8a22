#!/usr/bin/env bash
# A real three-node Slurm 22.05 cluster on this one machine, for clusterflow's tests.
#
#   bash tests/slurm/cluster.sh up      # install (apt) if needed, boot, wait until both nodes are idle
#   bash tests/slurm/cluster.sh down    # stop only the daemons this script started, remove the namespaces
#   bash tests/slurm/cluster.sh status
#
# Three "nodes" = three network namespaces (node1..node3) joined by a bridge that holds the
# controller's address. Each slurmd runs in its namespace with its own hostname (unshare --uts).
# Partitions: "low" (default, node1 and node2, preemptable, GraceTime), "high" (the same nodes,
# PriorityTier above, preempts "low" with PreemptMode=REQUEUE) and "wide" (node1..node3, for a
# job that holds a spare node; node3 is in no other partition, so "low" still has two nodes). Idempotent: running "up" twice changes nothing. Needs root.
# bf_interval=1: a requeued job is started by the backfill scheduler (the main one leaves it), every
# 30 s by default; every second here, so the requeue tests wait for the job, not the scheduler.
# cred_expire=5 (Slurm's least; 120 by default): a requeued job is held for cred_expire + 1 s
# before it may start again (its old credential must expire on the nodes first), so each requeue
# of the tests waits 6 s. A step's launch must reach its slurmd within those 5 s of its credential.
set -euo pipefail

BR=cfbr0
CTL_IP=10.77.0.1
PREFIX=10.77.0
NODES=(node1 node2 node3)
STATE=/run/clusterflow-slurm
CONF=/etc/slurm/slurm.conf
LOCK=/run/clusterflow-slurm.lock
CTL_HOST=$(hostname)

log() { echo "[cluster] $*" >&2; }

need_root() { [ "$(id -u)" = 0 ] || { echo "cluster.sh needs root (it creates network namespaces and runs slurmd)" >&2; exit 2; }; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then return; fi
  log "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge iproute2 >/dev/null
}

network() {
  if ! ip link show "$BR" >/dev/null 2>&1; then
    ip link add "$BR" type bridge
    ip addr add "$CTL_IP/24" dev "$BR"
    ip link set "$BR" up
  fi
  local i=0
  for n in "${NODES[@]}"; do
    i=$((i + 1))
    if ! ip netns list | grep -qw "$n"; then
      ip netns add "$n"
      ip link add "veth-$n" type veth peer name eth0 netns "$n"
      ip link set "veth-$n" master "$BR" up
      ip netns exec "$n" ip addr add "$PREFIX.$((i + 10))/24" dev eth0
      ip netns exec "$n" ip link set eth0 up
      ip netns exec "$n" ip link set lo up
      ip netns exec "$n" ip route add default via "$CTL_IP" || true
    fi
    grep -q " $n\$" /etc/hosts || echo "$PREFIX.$((i + 10)) $n" >> /etc/hosts
    # torch's TCPStore looks up the name of each peer's address as IPv4-mapped IPv6; with no DNS
    # reachable from the namespaces each lookup waits 10 s for its timeout, twice per job start.
    # A name of its own, so that "$n" itself still resolves to IPv4 only.
    grep -q " $n-v4mapped\$" /etc/hosts || echo "::ffff:$PREFIX.$((i + 10)) $n-v4mapped" >> /etc/hosts
  done
}

config() {
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm "$STATE"
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 4 ))
  local new="$CONF.new.$$"
  cat > "$new" <<EOF
ClusterName=clusterflow-test
SlurmctldHost=$CTL_HOST($CTL_IP)
AuthType=auth/munge
AuthInfo=cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
ReturnToService=2
MailProg=/bin/true
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=60
KillWait=10
MinJobAge=60
InactiveLimit=0
NodeName=node1 NodeAddr=$PREFIX.11 CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=node2 NodeAddr=$PREFIX.12 CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=node3 NodeAddr=$PREFIX.13 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=low Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=10 PreemptMode=REQUEUE OverSubscribe=NO
PartitionName=high Nodes=node1,node2 Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
PartitionName=wide Nodes=node1,node2,node3 Default=NO MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=10 PreemptMode=REQUEUE OverSubscribe=NO
EOF
  if ! cmp -s "$new" "$CONF"; then
    mv "$new" "$CONF"
    echo changed > "$STATE/config-changed"
  else
    rm -f "$new"
  fi
  [ -f /etc/slurm/cgroup.conf ] || echo "CgroupPlugin=cgroup/v1" > /etc/slurm/cgroup.conf
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Daemons must not inherit our open files: a `flock LOCK bash tests/run.sh` around the suite would
# otherwise leave the lock held by munged or slurmd for as long as they live.
detached() {
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      if [ "$fd" -gt 2 ] 2>/dev/null; then eval "exec $fd>&-" 2>/dev/null || true; fi
    done
    exec "$@"
  )
}

start() {
  if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
    [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
    chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
    detached munged --force 2>/dev/null || detached sudo -u munge munged --force
    echo started > "$STATE/munged"
  fi
  if [ -f "$STATE/config-changed" ] && alive /run/slurmctld.pid; then
    log "slurm.conf changed: restarting slurmctld"   # preemption settings need a restart, not reconfigure
    kill "$(cat /run/slurmctld.pid)"; sleep 2
  fi
  if ! alive /run/slurmctld.pid; then
    detached slurmctld -i
    echo started > "$STATE/slurmctld"
  fi
  for n in "${NODES[@]}"; do
    if [ -f "$STATE/config-changed" ] && alive "/run/slurmd-$n.pid"; then kill "$(cat "/run/slurmd-$n.pid")"; sleep 1; fi
    if ! alive "/run/slurmd-$n.pid"; then
      mkdir -p "/var/spool/slurmd/$n"
      # nsenter, not `ip netns exec`: the latter remounts /sys and slurmd then misses cgroups.
      detached nsenter --net="/run/netns/$n" unshare --uts sh -c "hostname $n; exec slurmd -N $n"
      echo started > "$STATE/slurmd-$n"
    fi
  done
  rm -f "$STATE/config-changed"
}

wait_idle() {
  for _ in $(seq 1 60); do
    local idle
    idle=$(sinfo -h -N -p wide -o "%N %t" 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)/' | wc -l || true)
    if [ "$idle" -ge "${#NODES[@]}" ]; then log "all nodes up: $(sinfo -h -N -p wide -o '%N=%t' | tr '\n' ' ')"; return 0; fi
    # a node that came back from an earlier boot may be "down" or "drain": resume it
    for n in "${NODES[@]}"; do scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true; done
    sleep 1
  done
  log "nodes did not become idle:"; sinfo -N >&2 || true; tail -20 /var/log/slurm/slurmctld.log >&2 || true
  return 1
}

up() { need_root; install; network; config; start; wait_idle; }

down() {
  need_root
  for n in "${NODES[@]}"; do
    if [ -f "$STATE/slurmd-$n" ] && alive "/run/slurmd-$n.pid"; then kill "$(cat "/run/slurmd-$n.pid")"; fi
    rm -f "$STATE/slurmd-$n"
  done
  if [ -f "$STATE/slurmctld" ] && alive /run/slurmctld.pid; then kill "$(cat /run/slurmctld.pid)"; fi
  rm -f "$STATE/slurmctld"
  if [ -f "$STATE/munged" ]; then pkill -x munged || true; rm -f "$STATE/munged"; fi
  for n in "${NODES[@]}"; do
    ip netns list | grep -qw "$n" && ip netns delete "$n"
    ip link show "veth-$n" >/dev/null 2>&1 && ip link delete "veth-$n"
  done
  ip link show "$BR" >/dev/null 2>&1 && ip link delete "$BR"
  log "down"
}

# One "up" or "down" at a time: several test sessions (parallel workers, two checkouts) may each
# ask for the cluster at once. Fd 9 holds the lock; the daemons do not inherit it (detached).
serialized() { exec 9>"$LOCK"; flock 9; "$@"; }

case "${1:-up}" in
  up) serialized up ;;
  down) serialized down ;;
  status) sinfo -N -l ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
