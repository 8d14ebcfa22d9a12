"""moehal_rocm: the ROCM backend plugin for moehal (entry point `rocm` of group `moehal.backends`)."""
