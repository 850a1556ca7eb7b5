"""Number formats in pure torch (CPU-runnable): the reference for every kernel."""
