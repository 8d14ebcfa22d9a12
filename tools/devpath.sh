# Source from a checkout or worktree: make `import moehal*` resolve to THIS tree's folders
# (they map onto other import names, so plain PYTHONPATH=. does not work).
_root=$(git rev-parse --show-toplevel)
_dir=/tmp/moehal-devpath-$(basename "$_root")
mkdir -p "$_dir"
ln -sfn "$_root/core" "$_dir/moehal"
ln -sfn "$_root/backends_cuda" "$_dir/moehal_cuda"
ln -sfn "$_root/backends_npu" "$_dir/moehal_npu"
ln -sfn "$_root/backends_rocm" "$_dir/moehal_rocm"
ln -sfn "$_root/conformance" "$_dir/moehal_conformance"
export PYTHONPATH="$_dir${PYTHONPATH:+:$PYTHONPATH}"
echo "moehal packages now resolve to $_root (via $_dir)"
