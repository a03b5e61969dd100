#!/usr/bin/env bash
# Install the Debian packages the test suite runs against: the real schedulers (tests/schedulers/):
# Slurm (slurm-wlm), munge (Slurm's authentication) and Open MPI (openmpi-bin); etcd (etcd-server),
# the store a cluster spanning hosts may keep its rendezvous in (tests/cluster/_etcd.py); and Redis
# (redis-server). `make test` runs it before pytest; the tests only check that the commands are
# there, and skip naming this script when they are not.
# Idempotent: installs only what is missing, within a bounded time, and prints what it did; with
# nothing missing it returns at once. Installing needs root and apt-get (Debian/Ubuntu).
#
#   tools/install_schedulers.sh [TIMEOUT_SECONDS]   (default 180)
#
# Exit status: 0 when every command is there afterwards, 1 otherwise (the message says why).
set -u
limit="${1:-180}"
start=$(date +%s)

# one command per package: the package is installed when its command is on PATH
declare -A wants=([slurm-wlm]="slurmctld slurmd srun sinfo" [munge]="munged" [openmpi-bin]="mpirun" [etcd-server]="etcd"
                  [redis-server]="redis-server")
packages=(slurm-wlm munge openmpi-bin etcd-server redis-server)
missing=()
for pkg in "${packages[@]}"; do
    for cmd in ${wants[$pkg]}; do
        if ! command -v "$cmd" >/dev/null 2>&1; then missing+=("$pkg"); break; fi
    done
done

if [ ${#missing[@]} -eq 0 ]; then
    echo "install_schedulers: nothing to do (${packages[*]} already installed)"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_schedulers: missing ${missing[*]}, and installing needs root" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_schedulers: missing ${missing[*]}, and there is no apt-get here" >&2
    exit 1
fi

left() { echo $(( limit - ($(date +%s) - start) )); }
export DEBIAN_FRONTEND=noninteractive
echo "install_schedulers: installing ${missing[*]} (at most ${limit} s)"
# fresh package lists first when there are none for the install to read
if ! apt-get install -y --no-install-recommends -qq --simulate "${missing[@]}" >/dev/null 2>&1; then
    echo "install_schedulers: apt-get update"
    timeout "$(left)" apt-get update -qq || { echo "install_schedulers: apt-get update failed or timed out" >&2; exit 1; }
fi
t=$(left); [ "$t" -gt 0 ] || { echo "install_schedulers: out of time before the install" >&2; exit 1; }
log=$(mktemp)
if ! timeout "$t" apt-get install -y -qq -o Dpkg::Use-Pty=0 "${missing[@]}" >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "install_schedulers: apt-get install ${missing[*]} failed or ran past ${limit} s" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
# the packages start their services where a service manager runs; the tests start their own daemons
for svc in slurmctld slurmd munge etcd redis-server; do
    command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$svc" 2>/dev/null \
        && systemctl stop "$svc" && echo "install_schedulers: stopped the $svc service the package started"
done
for pkg in "${packages[@]}"; do
    for cmd in ${wants[$pkg]}; do
        command -v "$cmd" >/dev/null 2>&1 || { echo "install_schedulers: $cmd still missing after the install" >&2; exit 1; }
    done
done
echo "install_schedulers: installed ${missing[*]} in $(( $(date +%s) - start )) s"
