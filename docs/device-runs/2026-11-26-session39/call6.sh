#!/usr/bin/env bash
# Session 39, call 6 (one GPU): `moehal doctor` with its new components table (af34139), as a
# user on an SM90 machine with DeepGEMM installed sees it, and its JSON.
#   usage (repo root, DeepGEMM wheels carried): bash <this file>
set -u
source tools/device_setup.sh
record_env
cd /tmp
COLUMNS=200 step doctor 120 python3 -m moehal.cli.main doctor
step doctor-json 120 bash -c 'python3 -m moehal.cli.main doctor --json > "$OUT/doctor.json"'
cat "$OUT/doctor.log"
cat "$OUT/steps.txt"
