#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels carried to the offline GPU machine (x86_64, CPython
# 3.12, torch 2.11+cu130, Triton 3.6), where tools/device_run.sh installs them with
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# The carried working tree is capped at 64 MiB, so the two big wheels are stripped to what
# the offline machine uses; the result is about 39 MiB.
#   usage (from the repo root, with network access): bash tools/fetch_device_wheels.sh
set -euo pipefail

dest=.whl
[ -f pyproject.toml ] && [ -d tools ] || { echo "run from the repo root" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Target interpreter and platform, not this machine's (sglang 0.5.23 is tagged manylinux_2_34).
plat=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  plat+=(--platform "${p}_x86_64")
done
fetch() {  # fetch DIR REQUIREMENT...
  local dir=$1
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d "$dir" "$@"
}

# Copy wheel $1 into $dest without the members whose path matches the Python regex $2.
# The other members are copied byte for byte, so their RECORD lines stay valid; the lines
# of the removed members are dropped from RECORD, and pip installs the result as usual.
strip_wheel() {
  python3 - "$1" "$dest" "$2" <<'EOF'
import os, re, sys, zipfile
src, dest, drop = sys.argv[1], sys.argv[2], re.compile(sys.argv[3])
out = os.path.join(dest, os.path.basename(src))
removed = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if drop.search(info.filename):
            removed += info.file_size
            continue
        data = zin.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(l for l in lines if not drop.search(l.split(",", 1)[0])).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
print(f"{os.path.basename(out)}: dropped {removed / 2**20:.1f} MiB uncompressed")
EOF
}

mkdir -p "$dest"
rm -f "$dest"/*.whl

# DeepGEMM (the CUDA backend's SM90 FP8/BF16 grouped GEMMs) and the tvm-ffi runtime it
# loads through; both used as published.
fetch "$dest" sgl-deep-gemm==0.1.4.post1 apache-tvm-ffi==0.1.11

# SGLang 0.5.23, the `--backends sglang` peer (tools/sglang_peer.py imports only its Triton
# fused-MoE modules and their tuned JSON configs). Dropped: every compiled .so in it, i.e. the
# Rust server extensions (sglang/srt/rust_extensions: HTTP/gRPC server, bench, multimodal) and
# the Rust radix-cache core (sglang/srt/mem_cache/rust_tree_core), about 18 MiB compressed,
# none of them on the MoE import path.
fetch "$tmp" sglang==0.5.23
strip_wheel "$tmp"/sglang-0.5.23-*.whl '^sglang/.*\.so$'

# sglang-kernel 0.4.6 (the last build for torch 2.11; 0.5.23 pins 0.4.10, built for torch
# 2.14.1, same op schemas): moe_align_block_size, moe_sum_reduce, silu_and_mul. Kept: the
# Python files and sm90/common_ops, which sgl_kernel/load_utils.py loads on compute
# capability 9.0. Dropped: the sm100 build, and flash_ops / flashmla_ops / infllm_ops /
# spatial_ops, which `import sgl_kernel` does not load (about 350 MiB compressed).
fetch "$tmp" sglang-kernel==0.4.6
strip_wheel "$tmp"/sglang_kernel-0.4.6-*.whl '^(?!sgl_kernel/sm90/common_ops\.abi3\.so$).*\.so$'

# Imported at module level on the MoE path (sglang/srt/utils/common.py, sglang/kernels/...)
# and missing on the GPU machine. sglang 0.5.23 does not pin them; pinned here so the folder
# is reproducible. starlette needs anyio at import: it comes from the GPU machine's Python.
fetch "$dest" msgspec==0.22.0 orjson==3.13.0 pybase64==1.5.1 starlette==1.10.0

# The stripped wheels must still hold what the peer imports.
python3 - "$dest" <<'EOF'
import glob, sys, zipfile
d = sys.argv[1]
names = zipfile.ZipFile(glob.glob(f"{d}/sglang-0.5.23-*.whl")[0]).namelist()
base = "sglang/srt/layers/moe/moe_runner/triton_utils/"
assert base + "fused_moe.py" in names, "sglang: fused_moe.py missing"
assert any(n.startswith(base + "configs/") and n.endswith(".json") for n in names), "sglang: tuned configs missing"
assert not any(n.endswith(".so") for n in names)
names = zipfile.ZipFile(glob.glob(f"{d}/sglang_kernel-0.4.6-*.whl")[0]).namelist()
assert [n for n in names if n.endswith(".so")] == ["sgl_kernel/sm90/common_ops.abi3.so"], "sgl_kernel: .so set"
for w in glob.glob(f"{d}/*.whl"):
    assert zipfile.ZipFile(w).testzip() is None, w
EOF
ls -l "$dest"
du -sh "$dest"
