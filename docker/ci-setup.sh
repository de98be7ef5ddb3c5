#!/usr/bin/env bash
# Make this (Debian) machine ready for the container tests: a running Docker
# engine, debootstrap for the offline base image and Prometheus for the e2e
# scrape. Idempotent: installs only what is missing, starts dockerd only when
# no engine answers. Needs root (CI and the project's machines run as root).
#   usage: docker/ci-setup.sh        (.ci/run calls it before the tests)
set -euo pipefail

log() { printf '[ci-setup] %s\n' "$*" >&2; }

install_missing() {
  local need=()
  command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
  command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
  if ((${#need[@]} == 0)); then
    return
  fi
  log "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Another apt run may hold the lock for a while: wait instead of failing.
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  # no service starts during the install (Debian's prometheus would start a server on :9090)
  bash "$(dirname "${BASH_SOURCE[0]}")/no-service-starts.sh" \
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null
}

start_engine() {
  if docker info >/dev/null 2>&1; then
    log "docker engine is running"
    return
  fi
  log "starting dockerd (log: /tmp/dockerd.log)"
  # setsid: the engine outlives this script and the shell that ran it.
  setsid dockerd >/tmp/dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 120); do
    if docker info >/dev/null 2>&1; then
      log "docker engine is up ($(docker info --format '{{.ServerVersion}} {{.Driver}}'))"
      return
    fi
    sleep 0.5
  done
  log "dockerd did not answer within 60 s; last lines of /tmp/dockerd.log:"
  tail -20 /tmp/dockerd.log >&2 || true
  exit 1
}

install_missing
start_engine
