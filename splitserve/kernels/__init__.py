"""Triton kernels for the GPU decode path. Each module imports triton itself: import them lazily, so
that CPU installs without triton never load them."""
