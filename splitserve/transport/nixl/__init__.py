"""The nixl backend: NIXL READs of block-run descriptors under tcp's control channel (mover.py), the
NIXL agent (agent.py), its state regions (state.py) and what the installed NIXL can do (env.py)."""
