# shellcheck shell=bash
# Sourced by `hosts.sh slurm`: a SLURM cluster over the hosts `hosts.sh up` made. One munged (its own
# key and socket under $STATE/munge; the hosts share the file system, so one serves them all),
# slurmctld on node0, and one slurmd per host, each in that host's namespaces. Clients need
# SLURM_CONF=$STATE/slurm/slurm.conf, which the last line printed names. `hosts.sh down` stops them all.

slurm_up() {
    need_root
    [[ -s $STATE/nodes ]] || die "no hosts: run hosts.sh up N first"
    [[ ! -e $STATE/slurm/slurm.conf ]] || die "SLURM is already up ($STATE/slurm/slurm.conf)"
    install_missing slurmctld:slurm-wlm slurmd:slurm-wlm srun:slurm-client munged:munge
    local dir=$STATE/slurm mdir=$STATE/munge nodes node i=0 cpus
    mapfile -t nodes <"$STATE/nodes"
    mkdir -p "$dir/ctld" "$mdir"
    chmod 700 "$mdir"
    dd if=/dev/urandom of="$mdir/munge.key" bs=1024 count=1 status=none
    chmod 400 "$mdir/munge.key"
    munged --force --socket="$mdir/munge.socket" --key-file="$mdir/munge.key" --pid-file="$mdir/munged.pid" \
        --log-file="$mdir/munged.log" --seed-file="$mdir/munged.seed"
    cpus=$(nproc)
    {
        echo "ClusterName=dsmn"
        echo "SlurmctldHost=${nodes[0]}($(address 0))"
        echo "AuthType=auth/munge"
        echo "AuthInfo=socket=$mdir/munge.socket"
        echo "CredType=cred/munge"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "StateSaveLocation=$dir/ctld"
        echo "SlurmdSpoolDir=$dir/spool-%n"
        echo "SlurmctldPidFile=$dir/ctld.pidfile"
        echo "SlurmdPidFile=$dir/slurmd-%n.pidfile"
        echo "SlurmctldLogFile=$dir/slurmctld.log"
        echo "SlurmdLogFile=$dir/slurmd-%n.log"
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "MpiDefault=none"
        echo "ReturnToService=2"
        echo "SchedulerType=sched/builtin"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobCompType=jobcomp/none"
        echo "SlurmctldTimeout=30"
        echo "SlurmdTimeout=30"
        echo "InactiveLimit=0"
        echo "KillWait=5"
        for node in "${nodes[@]}"; do
            echo "NodeName=$node NodeAddr=$(address $i) CPUs=$cpus State=UNKNOWN"
            i=$((i + 1))
        done
        echo "PartitionName=dsmn Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
    } >"$dir/slurm.conf"
    export SLURM_CONF=$dir/slurm.conf
    nsenter -t "$(node_pid "${nodes[0]}")" -n -u -- setsid slurmctld -D -f "$dir/slurm.conf" \
        >"$dir/slurmctld.out" 2>&1 </dev/null &
    echo $! >"$dir/slurmctld.pid"
    for node in "${nodes[@]}"; do
        nsenter -t "$(node_pid "$node")" -n -u -- setsid slurmd -D -N "$node" -f "$dir/slurm.conf" \
            >"$dir/slurmd-$node.out" 2>&1 </dev/null &
        echo $! >"$dir/slurmd-$node.pid"
    done
    local tries=0 idle
    while :; do
        idle=$(nsenter -t "$(node_pid "${nodes[0]}")" -n -u -- sinfo -h -N -o '%N %t' 2>/dev/null \
            | awk '$2 == "idle"' | wc -l)
        ((idle == ${#nodes[@]})) && break
        ((++tries < 120)) || die "SLURM nodes not idle after 60 s: $(sinfo -N 2>&1 | tail -5); see $dir/*.log"
        sleep 0.5
    done
    log "slurm: slurmctld on ${nodes[0]}, slurmd on ${nodes[*]}; set SLURM_CONF for srun/sinfo"
    echo "$dir/slurm.conf"
}
