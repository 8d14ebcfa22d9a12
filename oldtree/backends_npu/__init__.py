"""moehal_npu: the NPU backend plugin for moehal (entry point `npu` of group `moehal.backends`)."""
