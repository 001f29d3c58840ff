#!/usr/bin/env bash
# down.sh - undo up.sh: stop the daemons it started (by pid file only), then
# remove namespaces, veths, bridge, the /etc/hosts block and the slurm.conf link.
#
# Origin: copied from /work/shared/slurm-lab/down.sh (see /work/shared/slurm-lab.md); owned by this
# project since, used by the `slurm_cluster` fixture in tests/slurm_cluster.py.
#   --daemons-only   stop slurmd/slurmctld only (used by up.sh on config change)
set -uo pipefail

LAB=${SLURMLAB_DIR:-/tmp/slurmlab}
BR=slurmbr0
[ "$(id -u)" = 0 ] || { echo "down.sh: must run as root" >&2; exit 1; }
log() { echo "[slurmlab] $*"; }

# running PID: true while PID exists and is not a zombie (pid 1 here may take a second to reap)
running() {
  local s
  s=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null) || return 1
  [ -n "$s" ] && [ "${s%% *}" != Z ]
}

# stop COMMS PIDFILE...: TERM every pid (read from our pid files) whose
# /proc/PID/comm is one of COMMS (e.g. "slurmd|slurmctld"), wait up to 10 s
# for all of them together, then KILL what is left.
stop() {
  local comm=$1 f pid pids=() left=(); shift
  for f in "$@"; do
    [ -s "$f" ] || { rm -f "$f"; continue; }
    pid=$(cat "$f")
    if [ -n "$pid" ] && running "$pid" && [[ "$(cat /proc/$pid/comm 2>/dev/null)" =~ ^($comm)$ ]]; then
      kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    fi
    rm -f "$f"
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  for _ in $(seq 100); do
    left=(); for pid in "${pids[@]}"; do running "$pid" && left+=("$pid"); done
    [ ${#left[@]} -gt 0 ] || break; sleep 0.1
  done
  for pid in "${left[@]}"; do log "$comm $pid ignored TERM, killing"; kill -KILL "$pid" 2>/dev/null; done
  log "stopped $comm (${pids[*]})"
}

# job steps (slurmstepd and its children) belong to a node: cancel everything
# first so that slurmd can clean them up, then stop slurmds and the controller.
if command -v scancel >/dev/null && [ -s "$LAB/run/slurmctld.pid" ]; then
  jobs=$(timeout 5 squeue -h -o %A 2>/dev/null)
  [ -n "$jobs" ] && timeout 10 scancel --quiet $jobs 2>/dev/null
  for _ in $(seq 50); do [ -z "$(timeout 5 squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
fi
# all slurm daemons at once: one by one, each waits on the others (~2-3 s each)
stop 'slurmd|slurmctld' "$LAB"/run/slurmd.*.pid "$LAB/run/slurmctld.pid"
# leftovers (slurmstepd, job processes that escaped, things started with
# node-exec): only processes inside the network namespace of one of our nodes
for nsf in /run/netns/node*; do
  [ -e "$nsf" ] || continue
  n=$(basename "$nsf")
  [ -e "$LAB/ns/$n.uts" ] || continue   # not ours
  for pid in $(ip netns pids "$n" 2>/dev/null); do
    comm=$(cat /proc/$pid/comm 2>/dev/null) || continue
    log "killing leftover $comm ($pid) in netns $n"
    kill -KILL "$pid" 2>/dev/null
  done
done
[ "${1:-}" = --daemons-only ] && exit 0

stop munged "$LAB/run/munged.pid"   # only if up.sh started it

for nsf in /run/netns/node*; do
  [ -e "$nsf" ] || continue
  n=$(basename "$nsf")
  # only namespaces we made (they have a UTS twin in $LAB/ns)
  [ -e "$LAB/ns/$n.uts" ] || continue
  ip link del "slv-$n" 2>/dev/null
  ip netns del "$n" && log "removed netns $n"
done
for uts in "$LAB"/ns/*.uts; do
  [ -e "$uts" ] || continue
  umount "$uts" 2>/dev/null; rm -f "$uts"
done
rm -f "$LAB"/on-node*
ip link show "$BR" >/dev/null 2>&1 && ip link del "$BR" && log "removed bridge $BR"

if grep -q '^# BEGIN slurmlab$' /etc/hosts; then
  hosts_new=$(sed '/^# BEGIN slurmlab$/,/^# END slurmlab$/d' /etc/hosts)
  printf '%s\n' "$hosts_new" > /etc/hosts
fi
if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$LAB/etc/slurm.conf" ]; then
  rm -f /etc/slurm/slurm.conf
  [ -e /etc/slurm/slurm.conf.pre-slurmlab ] && mv /etc/slurm/slurm.conf.pre-slurmlab /etc/slurm/slurm.conf
fi
echo "slurm down"
