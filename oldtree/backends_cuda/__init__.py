"""moehal_cuda: the CUDA backend plugin for moehal (entry point `cuda` of group `moehal.backends`)."""
