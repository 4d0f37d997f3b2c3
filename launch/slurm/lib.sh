# Sourced by the templates in launch/slurm/ (not run on its own). Needs bash and `set -euo pipefail`.
#
# hybridrl_prepare OVERRIDE... — on the node that runs the batch script (the allocation's first node):
#   NNODES          SLURM_NNODES
#   NPROC_PER_NODE  $NPROC_PER_NODE if set, else SLURM_GPUS_ON_NODE (set by --gpus-per-node)
#   OVERRIDES       the user's overrides, byte for byte, then trainer.nnodes / trainer.n_gpus_per_node from
#                   the allocation (the later value of a key wins in Hydra, so the allocation does)
#   RDZV_TIMEOUT_S  the recipe's trainer.dist_timeout_s (whole seconds): how long the rendezvous waits for
#                   every node; the same key is every process group's (NCCL/gloo) collective timeout
# It runs `hybridrl validate` for NNODES × NPROC_PER_NODE ranks first and stops the job on a config error,
# before any node starts a process. Overrides travel as argv arrays only — never re-parsed by a shell.

hybridrl_prepare() {
    NNODES=${SLURM_NNODES:?"not inside a Slurm allocation (SLURM_NNODES is unset): submit with sbatch"}
    NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
    if [[ ! $NPROC_PER_NODE =~ ^[1-9][0-9]*$ ]]; then
        echo "[hybridrl] ranks per node unknown: ask for GPUs (#SBATCH --gpus-per-node=N) or set NPROC_PER_NODE" \
             "(got '${NPROC_PER_NODE}')" >&2
        exit 2
    fi
    OVERRIDES=("$@" "trainer.nnodes=$NNODES" "trainer.n_gpus_per_node=$NPROC_PER_NODE")
    echo "[hybridrl] checking the config for $NNODES node(s) × $NPROC_PER_NODE ranks on $(hostname)" >&2
    local timeout_s
    timeout_s=$(hybridrl validate --world-size "$((NNODES * NPROC_PER_NODE))" --get trainer.dist_timeout_s \
                -- "${OVERRIDES[@]}")
    RDZV_TIMEOUT_S=$(printf '%.0f' "$timeout_s")
}
