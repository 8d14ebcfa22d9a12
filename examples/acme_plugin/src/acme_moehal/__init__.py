"""acme-moehal: an example moehal backend (see docs/backend-author-guide.md)."""

__version__ = "0.1.0"
