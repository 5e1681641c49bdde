# Site settings for your cluster: the one file to edit before the workshop.
# Sourced twice: by you before `sbatch` (the SBATCH_* variables fill in --account, --partition and
# --reservation for every job) and by each job script (the environment set-up below).
#
#   source slurm/site.sh && sbatch slurm/01_collectives.sbatch

# --- submission: sbatch reads these variables as if they were #SBATCH lines. Empty = not used.
SITE_ACCOUNT=""        # e.g. "training2026"
SITE_PARTITION=""      # e.g. "gpu"
SITE_RESERVATION=""    # e.g. "workshop-day1"
[ -n "$SITE_ACCOUNT" ] && export SBATCH_ACCOUNT="$SITE_ACCOUNT"
[ -n "$SITE_PARTITION" ] && export SBATCH_PARTITION="$SITE_PARTITION"
[ -n "$SITE_RESERVATION" ] && export SBATCH_RESERVATION="$SITE_RESERVATION"

# --- notebooks on the cluster: your site's Jupyter service, if it has one. Without one, participants
# run `sbatch slurm/jupyterlab.sh`, which starts JupyterLab on a compute node and prints the ssh tunnel
# command to reach it through the login node named here.
SITE_JUPYTER_URL=""    # e.g. "https://jupyter.hpc.example.org" (then pick the course's kernel there)
SITE_LOGIN_NODE=""     # e.g. "login.hpc.example.org": the host participants ssh to

# --- inside the job: load modules and activate the course's Python environment.
site_environment() {
    # module load CUDA/12.4 NCCL Python/3.11    # uncomment and adapt for your site
    local root="${SLURM_SUBMIT_DIR:-$PWD}"
    if [ -f "$root/.venv/bin/activate" ]; then
        source "$root/.venv/bin/activate"
    fi
    # Compute nodes have no internet: use the datasets cache prepared on the login node.
    export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
    # Keep the course's caches on the project file system, not in your small home quota.
    export HF_HOME="${HF_HOME:-$root/.cache/huggingface}"
    export WANDB_MODE="${WANDB_MODE:-offline}" WANDB_DIR="${WANDB_DIR:-$root/runs}"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
}
