#!/usr/bin/env bash
# Debian packages the tests and benchmarks use: a real Redis, wrk for load, openssl for the demo certificate,
# promtool (package prometheus) to check and unit-test the alert rules.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v wrk >/dev/null || need+=(wrk)
command -v openssl >/dev/null || need+=(openssl)
command -v promtool >/dev/null || need+=(prometheus)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "missing: ${need[*]}; install them with: sudo apt-get install -y ${need[*]}" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
