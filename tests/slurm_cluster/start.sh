#!/bin/bash
# Start a local two-node Slurm cluster on this machine, for running slurm/*.sbatch in CI:
#   bash tests/slurm_cluster/start.sh      (as root or with sudo; safe to run again)
#   bash tests/slurm_cluster/stop.sh       (stops it and removes every trace)
#
# Nodes n1 and n2 are two slurmd daemons on this machine (same address, distinct ports), each
# claiming 4 GPUs whose device files are symlinks to /dev/null: Slurm schedules them like the
# workshop cluster's GPUs, torch sees no CUDA and the course runs on gloo. No systemd, no cgroups.
# State and logs live in $COURSE_SLURM_DIR (default /tmp/course-slurm), never in the repository.
set -euo pipefail

STATE="${COURSE_SLURM_DIR:-/tmp/course-slurm}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MARK="course-slurm"                       # marks every line and file this script writes outside $STATE
CTLD_PORT="${COURSE_SLURM_CTLD_PORT:-6817}"
PORT_N1="${COURSE_SLURM_PORT_N1:-6818}"
PORT_N2="${COURSE_SLURM_PORT_N2:-6819}"
CPUS=32                                   # per node: two jobs of 16 CPUs side by side, as on a GPU node
MEM_MB=256000
WAIT_S="${COURSE_SLURM_WAIT_S:-60}"       # how long to wait for both nodes to be idle

if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null; then exec sudo --preserve-env=COURSE_SLURM_DIR bash "$0" "$@"; fi
    echo "start.sh: must run as root (it starts munged and slurmd as root)" >&2; exit 1
fi
say() { echo "[slurm-cluster] $*"; }

# --- packages (Debian/Ubuntu) -------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    say "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    pkgs=(slurmctld slurmd slurm-client munge)
    if ! apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
    fi
fi

# --- address: n1 and n2 must resolve to the address of this machine's own hostname (usually
# 127.0.0.1), so that torchrun on n1 recognises the rendezvous endpoint n1 as itself and hosts the
# store there. A hostname that does not resolve at all joins the marked /etc/hosts line.
CTLD_HOST="$(hostname -s)"
ADDR="$(getent ahostsv4 "$(hostname)" 2>/dev/null | awk 'NR == 1 {print $1}')"
HOSTS_LINE="${ADDR:-127.0.0.1} n1 n2"
[ -n "$ADDR" ] || HOSTS_LINE="127.0.0.1 n1 n2 $(hostname)"
ADDR="${ADDR:-127.0.0.1}"

mkdir -p "$STATE"/{ctld,run,log,etc,spool/n1,spool/n2,dev/n1,dev/n2}
for n in n1 n2; do
    for i in 0 1 2 3; do ln -sfn /dev/null "$STATE/dev/$n/nvidia$i"; done
done

# --- configuration: /etc/slurm is where every Slurm command looks, so sbatch needs no SLURM_CONF.
render() {
    sed -e "s|@MARK@|$MARK|g" -e "s|@STATE@|$STATE|g" -e "s|@CTLD_HOST@|$CTLD_HOST|g" \
        -e "s|@ADDR@|$ADDR|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@PORT_N1@|$PORT_N1|g" \
        -e "s|@PORT_N2@|$PORT_N2|g" -e "s|@CPUS@|$CPUS|g" -e "s|@MEM_MB@|$MEM_MB|g" "$1"
}
render "$HERE/slurm.conf.in" >"$STATE/etc/slurm.conf"
render "$HERE/gres.conf.in" >"$STATE/etc/gres.conf"
mkdir -p /etc/slurm
changed=0
for f in slurm.conf gres.conf; do
    if [ -e "/etc/slurm/$f" ] && ! grep -q "$MARK" "/etc/slurm/$f"; then
        echo "start.sh: /etc/slurm/$f exists and was not written by this script; not touching it" >&2
        exit 1
    fi
    if ! cmp -s "$STATE/etc/$f" "/etc/slurm/$f"; then
        cp "$STATE/etc/$f" "/etc/slurm/$f"; changed=1
    fi
done

# --- node names: one marked line in /etc/hosts (rewritten in place: it may be a bind mount).
if ! grep -qx "$HOSTS_LINE # $MARK" /etc/hosts; then
    kept="$(grep -v "# $MARK\$" /etc/hosts || true)"
    printf '%s\n%s # %s\n' "$kept" "$HOSTS_LINE" "$MARK" >/etc/hosts
fi

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# --- munge: the key comes with the package; create one if it is missing.
if [ ! -s /etc/munge/munge.key ]; then
    say "creating /etc/munge/munge.key"
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=128 status=none
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
fi
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "starting munged"
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- munged
    touch "$STATE/run/munged.ours"        # stop.sh stops munged only if this script started it
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi

# --- daemons: restart them if the configuration changed under them.
if [ "$changed" = 1 ]; then
    for p in "$STATE"/run/slurmd-n1.pid "$STATE"/run/slurmd-n2.pid "$STATE"/run/slurmctld.pid; do
        if alive "$p"; then say "configuration changed: restarting $(basename "$p" .pid)"; kill "$(cat "$p")"; fi
    done
    for _ in $(seq 100); do
        alive "$STATE/run/slurmctld.pid" || alive "$STATE/run/slurmd-n1.pid" \
            || alive "$STATE/run/slurmd-n2.pid" || break
        sleep 0.1
    done
fi
if ! alive "$STATE/run/slurmctld.pid"; then
    say "starting slurmctld on $CTLD_HOST ($ADDR:$CTLD_PORT)"
    slurmctld
fi
for n in n1 n2; do
    if ! alive "$STATE/run/slurmd-$n.pid"; then
        say "starting slurmd -N $n"
        slurmd -N "$n"
    fi
done

# --- wait until both nodes are idle (bounded) ---------------------------------------------------
report() {
    echo "--- sinfo"; sinfo -N -l 2>&1 || true
    echo "--- scontrol show node"; scontrol show node 2>&1 | grep -E 'NodeName|State|Reason' || true
    for f in "$STATE"/log/slurmctld.log "$STATE"/log/slurmd-n1.log "$STATE"/log/slurmd-n2.log; do
        echo "--- tail $f"; tail -n 20 "$f" 2>&1 || true
    done
}
deadline=$(( SECONDS + WAIT_S ))
resumed=0
while :; do
    states="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u | tr '\n' ' ' || true)"
    # idle, or already running jobs (or held for a waiting one: plnd) when start.sh is run again on a live cluster
    if [[ "$states" =~ ^n1\ (idle|mix|alloc|plnd)\ n2\ (idle|mix|alloc|plnd)\ $ ]]; then
        say "nodes up: $states(${SECONDS}s)"; exit 0
    fi
    # Nodes left down or drained by an earlier run come back here, once.
    if [ "$resumed" = 0 ] && [[ "$states" =~ (down|drain|drng|fail) ]]; then
        scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
        resumed=1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "start.sh: nodes n1 and n2 not idle after ${WAIT_S}s (sinfo: ${states:-no answer})" >&2
        report >&2
        exit 1
    fi
    sleep 0.5
done
