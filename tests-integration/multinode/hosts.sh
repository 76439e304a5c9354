#!/usr/bin/env bash
# Hosts node0..node{N-1} on this machine, for end-to-end multi-node launches.
#
#   hosts.sh up N          make N hosts; the last line printed is a DeepSpeed hostfile (nodeI slots=2)
#   hosts.sh down          remove everything `up` (and `slurm`) made; safe to run twice, or with nothing up
#   hosts.sh exec NODE CMD run CMD on NODE (its network and host name), e.g. the `deepspeed` command
#   hosts.sh slurm         start a SLURM cluster over the hosts: munged, slurmctld on node0, slurmd per node
#
# Each host is a network namespace (dsmn-nodeI) plugged into a bridge that lives in its own namespace
# (dsmn-switch), with the address 10.213.0.(10+I)/24 on eth0. Nothing is added to this machine's own
# network. Each host runs its own sshd (ports 22 and 2222) in a UTS namespace named after the host, so
# `hostname` there says nodeI and resolves, through the /etc/hosts entries added here, to that host's
# address (gloo picks its interface from the host name). The file system and processes are shared, so
# every host sees the same Python and packages. Root's ssh reaches the hosts with a key made here,
# through /etc/ssh/ssh_config.d/ds-multinode.conf, checking the hosts' key against a known_hosts made
# here. Every daemon's pid is recorded under $STATE; `down` kills them and every process left in the
# namespaces, then removes namespaces, /etc/hosts entries, ssh config and keys.
#
# Needs root, iproute2, util-linux (unshare, nsenter), openssh-server, pdsh; slurm-wlm and munge for
# `slurm`. Missing Debian packages are installed with apt-get.
set -euo pipefail

STATE=${DSMN_STATE:-/run/ds-multinode}
SUBNET=10.213.0
SLOTS=${DSMN_SLOTS:-2}
PORTS=(22 2222)
MARK="# ds-multinode"
SSH_CONF=/etc/ssh/ssh_config.d/ds-multinode.conf

die() { echo "hosts.sh: $*" >&2; exit 1; }
log() { echo "hosts.sh: $*" >&2; }

need_root() { [[ $(id -u) == 0 ]] || die "must run as root (namespaces, sshd, /etc/hosts)"; }

install_missing() {  # install_missing cmd:package ...
    local missing=() pair
    for pair in "$@"; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
    done
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
    log "installing ${missing[*]}"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

address() { echo "$SUBNET.$((10 + $1))"; }

node_pid() {  # the pid of NODE's sshd: its network and UTS namespaces are the node's
    local node=$1
    [[ -s $STATE/$node/sshd.pid ]] || die "$node is not up (no $STATE/$node/sshd.pid); run: hosts.sh up N"
    cat "$STATE/$node/sshd.pid"
}

write_hosts() {  # rewrite /etc/hosts in place (it may be a bind mount, which sed -i cannot replace)
    local kept
    kept=$(grep -v -- "$MARK\$" /etc/hosts || true)
    printf '%s\n' "$kept" "$@" | sed '/^$/d' >/etc/hosts.dsmn.tmp
    cat /etc/hosts.dsmn.tmp >/etc/hosts
    rm -f /etc/hosts.dsmn.tmp
}

up() {
    local n=${1:-}
    [[ $n =~ ^[1-9][0-9]?$ ]] || die "usage: hosts.sh up N (N hosts, 1..99), got '${n}'"
    need_root
    [[ ! -e $STATE/nodes ]] || die "hosts are already up ($STATE/nodes); run: hosts.sh down"
    install_missing ip:iproute2 nsenter:util-linux sshd:openssh-server ssh:openssh-client pdsh:pdsh
    mkdir -p "$STATE" && chmod 700 "$STATE"
    trap 'log "up failed: removing what was made"; down >&2' ERR
    ssh-keygen -q -t ed25519 -N "" -C ds-multinode-client -f "$STATE/id_ed25519"
    ssh-keygen -q -t ed25519 -N "" -C ds-multinode-host -f "$STATE/host_ed25519"
    cp "$STATE/id_ed25519.pub" "$STATE/authorized_keys"
    echo "node*,$SUBNET.*,[node*]:*,[$SUBNET.*]:* $(cut -d' ' -f1,2 "$STATE/host_ed25519.pub")" >"$STATE/known_hosts"
    if [[ ! -d /run/sshd ]]; then mkdir -p /run/sshd && chmod 755 /run/sshd && touch "$STATE/made_run_sshd"; fi

    ip netns add dsmn-switch
    ip -n dsmn-switch link set lo up
    ip -n dsmn-switch link add br0 type bridge
    ip -n dsmn-switch link set br0 up
    local i entries=() hostfile=$STATE/hostfile
    : >"$hostfile"
    for ((i = 0; i < n; i++)); do
        local node=node$i ns=dsmn-node$i
        ip netns add "$ns"
        ip -n dsmn-switch link add "v$i" type veth peer name eth0 netns "$ns"
        ip -n dsmn-switch link set "v$i" master br0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$(address "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        entries+=("$(address "$i") $node $MARK")
        echo "$node slots=$SLOTS" >>"$hostfile"
        echo "$node" >>"$STATE/nodes"
    done
    write_hosts "${entries[@]}"
    cat >"$SSH_CONF" <<CONF
$MARK: made by hosts.sh up, removed by hosts.sh down
Host node* $SUBNET.*
    IdentityFile $STATE/id_ed25519
    IdentitiesOnly yes
    UserKnownHostsFile $STATE/known_hosts
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 10
    LogLevel ERROR
CONF
    for ((i = 0; i < n; i++)); do
        local node=node$i dir=$STATE/node$i
        mkdir -p "$dir"
        {
            for port in "${PORTS[@]}"; do echo "ListenAddress $(address "$i"):$port"; done
            echo "HostKey $STATE/host_ed25519"
            echo "PidFile $dir/sshd.pid"
            echo "AuthorizedKeysFile $STATE/authorized_keys"
            echo "PermitRootLogin prohibit-password"
            echo "PasswordAuthentication no"
            echo "KbdInteractiveAuthentication no"
            echo "UsePAM no"
            echo "MaxStartups 100:30:200"
            echo "MaxSessions 100"
            echo "PrintMotd no"
            echo "Subsystem sftp internal-sftp"
        } >"$dir/sshd_config"
        ip netns exec "dsmn-node$i" unshare --uts sh -c "hostname $node && exec /usr/sbin/sshd -f $dir/sshd_config -E $dir/sshd.log"
        local tries=0
        until [[ -s $dir/sshd.pid ]]; do
            ((++tries < 100)) || die "sshd on $node did not start; see $dir/sshd.log"
            sleep 0.05
        done
    done
    for ((i = 0; i < n; i++)); do  # every host reaches every host by name
        local j
        for ((j = 0; j < n; j++)); do
            nsenter -t "$(node_pid "node$i")" -n -u -- ssh "node$j" true \
                || die "node$i cannot ssh to node$j; see $STATE/node$j/sshd.log"
        done
    done
    trap - ERR
    log "up: $n host(s), $(address 0)..$(address $((n - 1))); run commands there with: $0 exec node0 CMD"
    echo "$hostfile"
}

node_exec() {
    local node=${1:-}
    [[ -n $node ]] || die "usage: hosts.sh exec NODE CMD [ARGS...]"
    shift
    (($#)) || die "usage: hosts.sh exec NODE CMD [ARGS...]"
    exec nsenter -t "$(node_pid "$node")" -n -u -- "$@"
}

kill_pidfile() {
    local file=$1 pid
    [[ -s $file ]] || return 0
    pid=$(cat "$file")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$file"
}

down() {
    need_root
    local f ns pids
    # Daemons first (slurm, munge, sshd), then whatever is left in the node namespaces (ranks, shells).
    for f in "$STATE"/slurm/*.pid "$STATE"/munge/*.pid "$STATE"/node*/sshd.pid; do
        [[ -e $f ]] && kill_pidfile "$f"
    done
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^dsmn-' || true); do
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            kill -KILL $pids 2>/dev/null || true
        fi
        ip netns del "$ns" 2>/dev/null || true
    done
    if grep -q -- "$MARK\$" /etc/hosts 2>/dev/null; then write_hosts; fi
    rm -f "$SSH_CONF"
    if [[ -e $STATE/made_run_sshd ]]; then rmdir /run/sshd 2>/dev/null || true; fi
    rm -rf "$STATE"
    log "down: nothing left"
}

case ${1:-} in
    up) shift; up "$@" ;;
    down) down ;;
    exec) shift; node_exec "$@" ;;
    slurm) shift; source "$(dirname "$0")/slurm.sh"; slurm_up "$@" ;;
    *) die "usage: hosts.sh up N | down | exec NODE CMD... | slurm" ;;
esac
