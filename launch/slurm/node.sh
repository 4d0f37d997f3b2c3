#!/usr/bin/env bash
# One node's torchrun, started by `srun --ntasks-per-node=1` in train.sbatch: the node rank is Slurm's
# SLURM_NODEID. Every argument is handed to torchrun untouched ("$@": no shell re-parsing).
set -euo pipefail
exec torchrun --node-rank="${SLURM_NODEID:?"run this under srun (SLURM_NODEID is unset)"}" "$@"
