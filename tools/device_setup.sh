# Sourced by the tools/device_*.sh scripts, from the repo root on the GPU machine: the output
# folder, and moehal plus the carried wheels (.whl, see tools/fetch_device_wheels.sh) installed
# into /tmp/site (pip --target: the device image's own torch stays); then `record_env` and
# `step`, the helpers the scripts share.
OUT=${OUT:-/tmp/moehal-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
repo=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
export PATH=/tmp/site/bin:$PATH

# $OUT/env.txt: date, GPU, driver, torch / CUDA / Triton versions (kept with every result).
record_env() {
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  } > "$OUT/env.txt" 2>&1
}

# step NAME LIMIT CMD...: run CMD time-boxed into $OUT/NAME.log, one line in $OUT/steps.txt,
# so one slow step cannot take the rest of a call down.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout -s TERM "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/steps.txt"
}

# sglang_seed_config [SUFFIX]: the path of SGLang's shipped fused-MoE config for Qwen3-30B-A3B's
# experts (E=128, N=768) on this GPU, as SGLang picks it (this Triton's folder, else the newest),
# or "". SUFFIX names the scheme as SGLang does, e.g. ",dtype=fp8_w8a8,block_shape=[128, 128]".
sglang_seed_config() {
  SUFFIX="${1:-}" python3 - <<'PY'
import os, pathlib, torch, triton
root = pathlib.Path("/tmp/site/sglang/srt/layers/moe/moe_runner/triton_utils/configs")
name = "E=128,N=768,device_name=" + torch.cuda.get_device_name().replace(" ", "_") + os.environ["SUFFIX"] + ".json"
ver = lambda d: tuple(int(x) for x in d.name.removeprefix("triton_").split("_"))
dirs = sorted(root.glob("triton_*"), key=ver, reverse=True)
mine = [d for d in dirs if d.name == "triton_" + triton.__version__.replace(".", "_")]
print(next((str(d / name) for d in mine + dirs if (d / name).is_file()), ""))
PY
}
