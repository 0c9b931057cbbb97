#!/usr/bin/env bash
# SLURM counterpart of launch/local.py: one jax.distributed process per host or per GPU.
#
#   sbatch --nodes=2 --gpus-per-node=8 launch/slurm.sh python -m digen_jax.main --config=...
#   DIGEN_SLURM_PER_GPU=1 sbatch --nodes=2 --gpus-per-node=8 launch/slurm.sh CMD ...
#   (or run it the same way from inside an salloc allocation)
#
# The batch step picks the coordinator (first host of SLURM_JOB_NODELIST) and fans out with srun
# (--kill-on-bad-exit: the first failing task stops the others). Each task then gets the
# variables digen_jax/runtime/distributed.py reads:
#   DIGEN_COORDINATOR_ADDRESS=<first host>:<port>   DIGEN_NUM_PROCESSES=$SLURM_NTASKS
#   DIGEN_PROCESS_ID=$SLURM_PROCID                  DIGEN_LOCAL_DEVICE_IDS=$SLURM_LOCALID (per GPU)
# Port: $DIGEN_COORDINATOR_PORT, else derived from the job id. JAX_PLATFORMS is left alone.
# Over several nodes, give digen_jax.main --config.cluster.transfer_host=hostname: the transfer
# servers listen on 127.0.0.1 only by default.
#
# Preemption and time limits: SLURM sends SIGTERM to every task (srun forwards it; each task execs
# the command itself), then SIGKILL after KillWait. digen_jax.main then checkpoints its last
# completed step and exits 143 within config.runtime.shutdown_timeout_s (default 60 s); rerunning
# the same command resumes. Ask for the signal ahead of the time limit with more than that to
# spare, e.g. `sbatch --signal=TERM@120 ...`, and keep the cluster's KillWait above the timeout.
set -euo pipefail

if [[ $# -eq 0 ]]; then
  echo "usage: launch/slurm.sh CMD [ARGS...]" >&2
  exit 2
fi
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -z "${DIGEN_SLURM_TASK:-}" ]]; then
  : "${SLURM_JOB_ID:?run inside a SLURM allocation (sbatch/salloc)}"
  head_host="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  port="${DIGEN_COORDINATOR_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
  export DIGEN_COORDINATOR_ADDRESS="${head_host}:${port}"
  export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  export DIGEN_SLURM_TASK=1
  if [[ -n "${DIGEN_SLURM_PER_GPU:-}" ]]; then
    gpus="${SLURM_GPUS_ON_NODE:?DIGEN_SLURM_PER_GPU needs --gpus-per-node}"
    tasks=(--ntasks-per-node="$gpus")
  else
    tasks=(--ntasks-per-node=1)
  fi
  exec srun --nodes="$SLURM_JOB_NUM_NODES" "${tasks[@]}" --kill-on-bad-exit=1 --label \
    bash "${REPO_ROOT}/launch/slurm.sh" "$@"
fi

# One task: its rank and (per GPU) its device.
export DIGEN_NUM_PROCESSES="$SLURM_NTASKS"
export DIGEN_PROCESS_ID="$SLURM_PROCID"
if [[ -n "${DIGEN_SLURM_PER_GPU:-}" ]]; then
  export DIGEN_LOCAL_DEVICE_IDS="$SLURM_LOCALID"
fi
exec "$@"
