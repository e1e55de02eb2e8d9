#!/usr/bin/env bash
# Makes sure a Docker daemon with experimental features (needed by `docker checkpoint`) answers.
# Starts `dockerd --experimental` in the background when none answers; its log goes to
# $K3RL_LOG_DIR/dockerd.log (default /var/log/k3rl). Idempotent and quick when a daemon is up.
set -euo pipefail
LOG_DIR=${K3RL_LOG_DIR:-/var/log/k3rl}
mkdir -p "$LOG_DIR"
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# A wedged daemon (it accepts the connection but never answers) must fail here, not hang the caller.
docker_info() { timeout 20 docker info >/dev/null 2>&1; }

if ! docker_info; then
  if ! command -v dockerd >/dev/null; then
    echo "dockerd is not installed; run 'make bootstrap'" >&2
    exit 1
  fi
  if pgrep -x dockerd >/dev/null; then
    echo "dockerd: a daemon process exists but does not answer yet; waiting (if it stays wedged: kill it" \
         "and its containerd, then rerun this script)"
  else
    echo "dockerd: no daemon answers; starting 'dockerd --experimental' (log: $LOG_DIR/dockerd.log)"
    # A stale pid file from a killed daemon blocks the start.
    rm -f /var/run/docker.pid
    # Started from / : the daemon outlives this checkout, which may be a CI clone deleted afterwards.
    (cd / && setsid nohup dockerd --experimental >>"$LOG_DIR/dockerd.log" 2>&1 </dev/null &)
  fi
  for _ in $(seq 1 60); do
    docker_info && break
    sleep 0.5
  done
  if ! docker_info; then
    echo "dockerd did not come up within 30 s; last lines of $LOG_DIR/dockerd.log:" >&2
    tail -20 "$LOG_DIR/dockerd.log" >&2 || true
    exit 1
  fi
fi

# The runtime's CPU in a cgroup of its own, so that the pool reads what a pause or a resume costs there
# (agentenv/pool/cpu.py) rather than the whole host's busy time: dockerd and containerd, when they sit in
# the root cgroup, move to `k3rl-runtime` (cpuacct on cgroup v1, a child of the root on v2); the shims,
# runc and CRIU they start from then on follow them. A daemon a service manager placed stays where it is.
runtime_cgroup_dir() {
  if [ -f /sys/fs/cgroup/cgroup.controllers ]; then echo /sys/fs/cgroup/k3rl-runtime
  elif [ -d /sys/fs/cgroup/cpuacct ]; then echo /sys/fs/cgroup/cpuacct/k3rl-runtime
  fi
}
in_root_cgroup() {  # pid: true when its CPU-accounting cgroup is the root
  if [ -f /sys/fs/cgroup/cgroup.controllers ]; then grep -qx '0::/' "/proc/$1/cgroup"
  else awk -F: '$2 ~ /(^|,)cpuacct(,|$)/ && $3 == "/" {found=1} END {exit !found}' "/proc/$1/cgroup"
  fi
}
dir=$(runtime_cgroup_dir)
if [ -n "$dir" ]; then
  for pid in $(pgrep -x dockerd) $(pgrep -x containerd); do
    if in_root_cgroup "$pid" 2>/dev/null; then
      { mkdir -p "$dir" && echo "$pid" >"$dir/cgroup.procs"; } 2>/dev/null ||
        echo "note: could not move the runtime's pid $pid to $dir; the pool counts the host's CPU instead" >&2
    fi
  done
fi

if [ "$(timeout 20 docker version --format '{{.Server.Experimental}}' 2>/dev/null)" != "true" ]; then
  echo "warning: the running Docker daemon has experimental features off, so 'docker checkpoint' is" \
       "unavailable; restart it with 'dockerd --experimental' (or set \"experimental\": true in" \
       "/etc/docker/daemon.json)" >&2
fi
