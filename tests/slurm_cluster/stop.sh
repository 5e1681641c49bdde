#!/bin/bash
# Stop the local cluster started by start.sh and remove what it wrote; safe to run twice.
set -uo pipefail

STATE="${COURSE_SLURM_DIR:-/tmp/course-slurm}"
MARK="course-slurm"
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null; then exec sudo --preserve-env=COURSE_SLURM_DIR bash "$0" "$@"; fi
    echo "stop.sh: must run as root" >&2; exit 1
fi
say() { echo "[slurm-cluster] $*"; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Cancel what is left, so that no job step outlives its slurmd.
if alive "$STATE/run/slurmctld.pid" && command -v squeue >/dev/null; then
    if [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
        say "cancelling leftover jobs: $(squeue -h -o %i | tr '\n' ' ')"
        scancel --partition=course 2>/dev/null
        for _ in $(seq 30); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
    fi
fi

stop_pidfile() {   # stop_pidfile NAME PIDFILE: SIGTERM, wait up to 10 s, then SIGKILL
    local name="$1" pidfile="$2" pid
    alive "$pidfile" || { rm -f "$pidfile"; return 0; }
    pid="$(cat "$pidfile")"
    say "stopping $name (pid $pid)"
    kill "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null; fi
    rm -f "$pidfile"
}
stop_pidfile "slurmd n1" "$STATE/run/slurmd-n1.pid"
stop_pidfile "slurmd n2" "$STATE/run/slurmd-n2.pid"
stop_pidfile slurmctld "$STATE/run/slurmctld.pid"
if [ -e "$STATE/run/munged.ours" ]; then
    stop_pidfile munged /run/munge/munged.pid
fi

for f in /etc/slurm/slurm.conf /etc/slurm/gres.conf; do
    if [ -e "$f" ] && grep -q "$MARK" "$f"; then rm -f "$f"; fi
done
if grep -q "# $MARK\$" /etc/hosts 2>/dev/null; then
    kept="$(grep -v "# $MARK\$" /etc/hosts)"
    printf '%s\n' "$kept" >/etc/hosts        # in place: /etc/hosts may be a bind mount
fi
case "$STATE" in /tmp/*|/var/tmp/*) rm -rf "$STATE" ;; *) say "left $STATE in place" ;; esac
say "stopped"
