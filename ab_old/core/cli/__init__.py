"""The `moehal` command line."""
