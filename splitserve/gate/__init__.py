"""The deployment gate (`splitserve verify`): see verify.py."""
