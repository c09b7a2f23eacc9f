#!/bin/bash
# #22 item 5 on the H200: does a VRAM READ between two processes of one GPU now run over UCX's cuda_ipc?
# Run from a checkout whose whl/ holds the repacked nixl-cu12 cp312 wheel (scripts/repack_nixl_wheel.py) and
# nvidia-cuda-runtime-cu12 (cp312 manylinux wheels); results in $OUT (a.log, b.log):
#   A: as shipped (the transport sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on and ucx_error_handling_mode=none for
#      a GPU pool), UCX_PROTO_INFO=y: the "remote memory read by ucp_get*" table should name cuda_ipc
#   B: UCX's own default for GETs (auto: off where NVML reports no NVLink), for contrast: 0.8 GB/s before
# History (docs/bench/kv-nixl.md): 0.5 GB/s emulated over tcp/lo (error mode peer), 0.8 GB/s emulated
# over sysv/memory (error mode none), "cuda-ipc get zcopy disabled as no nvlinks detected" in UCX's log.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  whl/nixl_cu12*.whl whl/nvidia_cuda_runtime*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
B="timeout 120 python3 bench/nixl_gpu.py --max-mb 1024 --reps 3"
echo "== A: as shipped, UCX_PROTO_INFO=y"; UCX_PROTO_INFO=y $B > $OUT/a.log 2>&1
grep "GB/s" $OUT/a.log; grep -A6 "remote memory read by ucp_get" $OUT/a.log | grep "|" | sort | uniq -c | head
echo "== B: UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto"; UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto $B --max-mb 64 > $OUT/b.log 2>&1
grep "GB/s" $OUT/b.log | head -14
