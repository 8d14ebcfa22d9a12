# Source from a checkout or worktree: make `import moehal*` resolve to THIS tree's folders
# (they map onto other import names, so plain PYTHONPATH=. does not work).
# The links live in a folder of this checkout's own git directory (one per worktree), mode 0700:
# a shared, predictable /tmp name first on PYTHONPATH could be made first by another user, whose
# sitecustomize.py every Python started from this shell would then run.
_root=$(git rev-parse --show-toplevel) || return 1 2>/dev/null || exit 1
_dir="$(git rev-parse --absolute-git-dir)/moehal-devpath" || return 1 2>/dev/null || exit 1
mkdir -p -m 700 "$_dir" 2>/dev/null
if [ -L "$_dir" ] || [ ! -d "$_dir" ] || [ ! -O "$_dir" ]; then
    echo "devpath: $_dir is not a folder of yours (a link, not a folder, or another user's): PYTHONPATH unchanged" >&2
    return 1 2>/dev/null || exit 1
fi
chmod 700 "$_dir"
ln -sfn "$_root/core" "$_dir/moehal"
ln -sfn "$_root/backends_cuda" "$_dir/moehal_cuda"
ln -sfn "$_root/backends_npu" "$_dir/moehal_npu"
ln -sfn "$_root/backends_rocm" "$_dir/moehal_rocm"
ln -sfn "$_root/conformance" "$_dir/moehal_conformance"
export PYTHONPATH="$_dir${PYTHONPATH:+:$PYTHONPATH}"
echo "moehal packages now resolve to $_root (via $_dir)"
