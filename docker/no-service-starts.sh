#!/usr/bin/env bash
# Run a command (an apt-get install) while Debian refuses every service start: before a package's
# maintainer script starts its service, invoke-rc.d (and deb-systemd-invoke) asks
# /usr/sbin/policy-rc.d, and its exit code 101 means "action forbidden". Without it, installing
# Debian's prometheus starts a server on :9090, the port docker/compose.yaml publishes; the tests
# start their own Prometheus on free ports, and docker/ci-setup.sh starts dockerd itself.
# A policy-rc.d that was there before is put back afterwards, also when the command fails.
#   usage: docker/no-service-starts.sh apt-get install -y prometheus
#   POLICY_RC_D: the file to write (default /usr/sbin/policy-rc.d; the unit test uses a temporary one)
set -euo pipefail

policy=${POLICY_RC_D:-/usr/sbin/policy-rc.d}
saved=""
if [ -e "$policy" ]; then
  saved=$(mktemp)
  cp -p "$policy" "$saved"
fi
restore() {
  if [ -n "$saved" ]; then
    mv -f "$saved" "$policy"
  else
    rm -f "$policy"
  fi
}
trap restore EXIT
printf '#!/bin/sh\n# docker/no-service-starts.sh: no service starts while it runs\nexit 101\n' >"$policy"
chmod 755 "$policy"
"$@"
