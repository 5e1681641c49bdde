#!/bin/bash
# JupyterLab on a compute node, for sites without a Jupyter service (slurm/site.sh: SITE_JUPYTER_URL).
#   source slurm/site.sh && sbatch slurm/jupyterlab.sh
#   cat jupyterlab-<jobid>.out        # the ssh tunnel command to run on your laptop, then the URL to open
#   scancel <jobid>                   # when you are done: the node is yours until then (or --time)
# The notebooks' own runs are small; a whole node with its 4 GPUs lets you run the lessons' scripts on it too.
#SBATCH --job-name=jupyterlab
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=16
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out           # in the directory you submit from

set -euo pipefail
source "$SLURM_SUBMIT_DIR/slurm/site.sh"
site_environment

NODE=$(hostname)
PORT=$(( 8800 + SLURM_JOB_ID % 1000 ))   # a port per job: two participants on one node do not collide
echo "JupyterLab on $NODE:$PORT. On your laptop, run:"
echo "    ssh -N -L $PORT:$NODE:$PORT ${SITE_LOGIN_NODE:-<your login node>}"
echo "then open the http://127.0.0.1:$PORT/lab/tree/README.md?token=... address that JupyterLab prints below."
# As `make lab` starts it: the course root (the README, notebooks/, exercises/, slurm/ in reach), the README first and
# rendered (utils/course/lab_settings), also at the address printed, which is the one you open through the tunnel.
cd "$SLURM_SUBMIT_DIR"
exec jupyter lab --no-browser --ip="$NODE" --port="$PORT" $( [ "$(id -u)" -eq 0 ] && echo --allow-root ) \
    --LabApp.app_settings_dir="$SLURM_SUBMIT_DIR/utils/course/lab_settings" --LabApp.default_url=/lab/tree/README.md
