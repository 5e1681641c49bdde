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
    # --watch writes each rank's samples here (one folder per job), for the job report at the end.
    export COURSE_MONITOR_DIR="${COURSE_MONITOR_DIR:-$root/runs/monitor/${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID:-0}}"
    # A job that hangs or crashes in a collective (python -m utils.stacks JOBID shows where each rank waits):
    # uncomment to have every collective's op and shapes compared between the ranks first, so a mismatch fails at
    # once on every rank, naming both. It adds a check to every collective: for debugging runs, not for timing.
    # export TORCH_DISTRIBUTED_DEBUG=DETAIL
    # NCCL's flight recorder (on by default in torch 2.13: each rank keeps its last 2000 collectives,
    # TORCH_FR_BUFFER_SIZE sets how many) writes them to a file when one times out, once TORCH_NCCL_DUMP_ON_TIMEOUT=1;
    # `torchfrtrace runs/fr/<job id> -p rank_` then names the collective where the ranks part ways. On gloo nothing
    # is written (utils/stacks.py says what gloo records).
    # mkdir -p "$root/runs/fr/${SLURM_JOB_ID:-0}"
    # export TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_FR_DUMP_TEMP_FILE="$root/runs/fr/${SLURM_JOB_ID:-0}/rank_"
}

# --- the job report, at the end of every job: how busy each device and process was (python -m utils.monitor),
# beside Slurm's own view. `watched srun ... "$SCRIPT" --watch ...` runs the training, then the report; the job
# still ends with the training's exit status (a failed training fails the job).
watched() {
    local status=0
    "$@" || status=$?
    job_report
    return "$status"
}

job_report() {
    local root="${SLURM_SUBMIT_DIR:-$PWD}" out png
    out=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | grep -o "StdOut=[^ ]*" | cut -d= -f2) || true
    png="${out:-$root/${SLURM_JOB_NAME}-${SLURM_JOB_ID}.out}"
    png="${png%.out}.png"                 # the figure beside the job's .out file
    echo "=== job report (how busy each device was; the figure: $png)"
    (cd "$root" && python -m utils.monitor report "$COURSE_MONITOR_DIR" --png "$png") \
        || echo "no job report: the training recorded nothing in $COURSE_MONITOR_DIR (was --watch passed?)"
    echo "=== Slurm's view of job $SLURM_JOB_ID"
    squeue -h -j "$SLURM_JOB_ID" -o "nodes %D (%N), elapsed %M, time limit %l" 2>/dev/null || true
    # Peak memory per step where the cluster keeps accounting (sacct), else nothing more to show.
    sacct -j "$SLURM_JOB_ID" --noheader --format=JobID%-16,Elapsed,NNodes,MaxRSS,State 2>/dev/null \
        || echo "(no sacct: this cluster keeps no job accounting)"
}
