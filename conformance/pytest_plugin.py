"""pytest11 entry point (filled in by the conformance suite)."""
