# Sourced by the tools/device_*.sh scripts, from the repo root on the GPU machine: the output
# folder, and moehal plus the carried wheels (.whl, see tools/fetch_device_wheels.sh) installed
# into /tmp/site (pip --target: the device image's own torch stays).
OUT=${OUT:-/tmp/moehal-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
repo=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
