"""The GPU backends: one payload mover (mover.py, `GpuMover`) over each backend's link (link.py):
cuda_ipc.py (the fetcher's GPU copies out of the exporter's KV, mapped through a CUDA IPC handle) and
nccl.py (the exporter sends over a two-rank NCCL group per connection)."""
