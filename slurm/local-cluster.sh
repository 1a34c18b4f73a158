#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine, for the Slurm tests and for trying slurm/train.sbatch.
#
#   bash slurm/local-cluster.sh [start]   install (apt-get, Debian/Ubuntu) and start munge, slurmctld, slurmd n1, n2
#   bash slurm/local-cluster.sh stop      stop the daemons (the packages and config stay)
#   bash slurm/local-cluster.sh status    show the nodes
#
# Runs as root. Idempotent: `start` installs only what is missing, rewrites the config only when it changed,
# starts only daemons that are not running, and returns when both nodes are idle (or fails saying why).
# Two slurmd on one host make two nodes (n1, n2), each with its own port, spool directory and pid file.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=/var/log/slurm
CPUS_PER_NODE=${LOCAL_SLURM_CPUS:-1}
MEM_PER_NODE=${LOCAL_SLURM_MEM_MB:-4000}
NODES=(n1 n2)

die() { echo "local-cluster: error: $*" >&2; exit 1; }
running() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    [[ $(id -u) == 0 ]] || die "run as root (it installs slurm-wlm and munge with apt-get)"
    command -v apt-get >/dev/null || die "apt-get not found: install slurm-wlm (>= 22.05) and munge by hand"
    echo "local-cluster: installing slurm-wlm and munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_config() {
    local host conf
    host=$(hostname -s)
    conf=$(cat <<EOF
# Written by slurm/local-cluster.sh: two nodes (n1, n2) on this host ($host).
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdSpoolDir=/var/spool/slurmd/%n
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=600
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=17001-17002 CPUs=$CPUS_PER_NODE RealMemory=$MEM_PER_NODE State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
)
    mkdir -p "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd/n1 /var/spool/slurmd/n2
    if [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$conf" ]]; then
        if running /run/slurmctld.pid; then
            echo "local-cluster: the config changed; restarting the daemons"
            stop_daemons
        fi
        printf '%s\n' "$conf" > "$CONF"
    fi
}

start_munge() {
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    if [[ ! -s /etc/munge/munge.key ]]; then  # normally created by the package
        if command -v mungekey >/dev/null; then mungekey --create --force; else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    fi
    chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
    chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
    if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        su -s /bin/sh munge -c munged || die "munged did not start (see /var/log/munge/munged.log)"
        for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return; sleep 0.1; done
        die "munged started but does not answer (see /var/log/munge/munged.log)"
    fi
}

start_slurm() {
    running /run/slurmctld.pid || slurmctld || die "slurmctld did not start (see $LOG_DIR/slurmctld.log)"
    for node in "${NODES[@]}"; do
        running "/run/slurmd-$node.pid" || slurmd -N "$node" || die "slurmd -N $node did not start (see $LOG_DIR/slurmd-$node.log)"
    done
}

wait_idle() {
    local states
    for i in $(seq 60); do
        states=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)
        if [[ $(grep -cE ' (idle|mix|alloc)$' <<<"$states") == "${#NODES[@]}" ]]; then
            echo "local-cluster: up, nodes: $(tr '\n' ' ' <<<"$states")"
            return
        fi
        # nodes left DOWN/DRAIN by an earlier unclean stop come back with RESUME
        if (( i % 5 == 0 )) && grep -qE ' (down|drain|drng|fail)' <<<"$states"; then
            scontrol update NodeName=n[1-2] State=RESUME 2>/dev/null || true
        fi
        sleep 1
    done
    die "the nodes did not become idle within 60 s: ${states:-no answer from slurmctld} (see $LOG_DIR/)"
}

stop_daemons() {
    local pidfile pid
    for pidfile in /run/slurmd-n1.pid /run/slurmd-n2.pid /run/slurmctld.pid; do
        running "$pidfile" || continue
        pid=$(cat "$pidfile")
        kill "$pid"
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        rm -f "$pidfile"
    done
}

stop_munge() {
    local pidfile=/run/munge/munged.pid
    if running "$pidfile"; then kill "$(cat "$pidfile")"; fi
}

case "${1:-start}" in
    start)
        [[ $(id -u) == 0 ]] || die "run as root"
        install_packages
        write_config
        start_munge
        start_slurm
        wait_idle
        ;;
    stop)
        stop_daemons
        stop_munge
        echo "local-cluster: stopped"
        ;;
    status)
        sinfo -N -l
        ;;
    *)
        die "unknown command '$1'; use start, stop or status"
        ;;
esac
