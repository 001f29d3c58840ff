#!/bin/bash
# health-check.sh: run one copy per node for the whole job (srun --overlap, see train.sbatch).
#
# When this node is unwell, ask the job to move its work to a standby: `tmrun drain <this node>`.
# The standby takes over at a step boundary (a hot swap); nobody else restarts. Unwell means:
#   - an administrator or a site check marked the node DRAIN in SLURM
#     (scontrol update nodename=<node> state=drain reason=...), or
#   - on GPU nodes (GPUS_PER_NODE set): fewer GPUs than expected, or uncorrectable ECC errors.
# HEALTH_INTERVAL (seconds, default 60) is how often it looks.
node=${SLURMD_NODENAME:-$(hostname)}
interval=${HEALTH_INTERVAL:-60}

drained_in_slurm() {
    scontrol show node "$node" --oneliner 2>/dev/null | grep -qE 'State=[A-Z_+]*DRAIN'
}

gpus_unwell() {
    [ -n "${GPUS_PER_NODE:-}" ] || return 1
    local count
    count=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
    [ "$count" -eq "$GPUS_PER_NODE" ] || return 0
    # Uncorrectable ECC errors since the driver loaded; "[N/A]" where ECC is off.
    nvidia-smi --query-gpu=ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits 2>/dev/null \
        | grep -qE '^[1-9]'
}

while true; do
    if drained_in_slurm || gpus_unwell; then
        echo "$(date -Is) $node: unwell, draining it out of the job" >&2
        tmrun drain "$node" && exit 0
    fi
    sleep "$interval"
done
