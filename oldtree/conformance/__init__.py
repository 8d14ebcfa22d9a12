"""moehal_conformance: the conformance suite every backend runs (pytest plugin)."""
