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
#
# hybridrl_run_preemptible COMMAND... — runs the launcher (torchrun or srun) in the background and waits for it.
#   A SIGTERM or SIGUSR1 to the batch shell (Slurm's at preemption; `#SBATCH --signal=B:TERM@120` sends it 120 s
#   before the time limit) is forwarded to it as SIGTERM (srun forwards it to every node's torchrun, torchrun to
#   its ranks): the ranks finish their step, save it and exit 0 within trainer.preempt_grace_s. The job is then
#   requeued (`scontrol requeue`) and its next start resumes from that checkpoint (trainer.resume=auto, the
#   default). torchrun SIGKILLs its ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT s after forwarding (exported: 60 unless
#   set), so keep trainer.preempt_grace_s below it and both below Slurm's grace period.

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

hybridrl_run_preemptible() {
    local pid status=0
    HYBRIDRL_PREEMPTED=0
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-60}
    trap 'HYBRIDRL_PREEMPTED=1; kill -TERM "$pid" 2>/dev/null || true' TERM USR1
    "$@" &
    pid=$!
    while true; do  # `wait` returns early (> 128) when a trapped signal arrives: wait again until it has exited
        status=0
        wait "$pid" || status=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    trap - TERM USR1
    if (( HYBRIDRL_PREEMPTED )); then
        echo "[hybridrl] preempted (launcher exit $status): requeueing job ${SLURM_JOB_ID:-?};" \
             "its next start resumes from the checkpoint the ranks saved (trainer.resume=auto)" >&2
        scontrol requeue "${SLURM_JOB_ID:?}"
        return 0
    fi
    return "$status"
}
