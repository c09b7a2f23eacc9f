"""Starting a deployment's pieces: `local` (worker processes on this host, the default)."""
