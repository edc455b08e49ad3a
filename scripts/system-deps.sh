#!/usr/bin/env bash
# Install the system tools corral's tests drive for real: OpenSSH (client and
# server, one sshd per sandbox node), rsync, iproute2 (ip, tc), pdsh (the
# anchor DeepSpeed's launcher uses), iperf3 (bench), procps, and the login
# shells nodes have besides bash (zsh, fish, tcsh: remote command lines),
# tmux and Debian's chromium (the `top` and `report` tests), and Slurm with
# munge (the sandbox's real scheduler: `corral sandbox up --slurm`).
# Idempotent: only installs what is missing.  Needs root (or sudo) and apt.
set -euo pipefail
need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || need+=(iproute2)
command -v tc >/dev/null 2>&1 || [ -x /usr/sbin/tc ] || need+=(iproute2)
command -v pdsh >/dev/null 2>&1 || need+=(pdsh)
command -v iperf3 >/dev/null 2>&1 || need+=(iperf3)
command -v ps >/dev/null 2>&1 || need+=(procps)
for sh in zsh fish tcsh; do command -v $sh >/dev/null 2>&1 || need+=($sh); done
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || need+=(iptables)
# `corral top` is read from a tmux screen; `corral report` is rendered in a headless Chromium
command -v tmux >/dev/null 2>&1 || need+=(tmux)
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || need+=(chromium)
command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || need+=(munge)
command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ] || need+=(slurmctld)
command -v slurmd >/dev/null 2>&1 || [ -x /usr/sbin/slurmd ] || need+=(slurmd)
command -v srun >/dev/null 2>&1 || need+=(slurm-client)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "system-deps: need root to install: ${need[*]} (install them, or run as root)" >&2
    exit 1
  fi
fi
echo "system-deps: installing ${need[*]}" >&2
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
