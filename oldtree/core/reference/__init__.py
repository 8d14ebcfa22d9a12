"""The reference backend: pure torch on any device. The conformance oracle and the
last-resort fallback. It registers through the `moehal.backends` entry point like any
vendor plugin (see `moehal.reference.plugin`)."""
