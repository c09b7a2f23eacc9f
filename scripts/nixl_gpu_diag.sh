#!/bin/bash
# #22 item 5, the next look on the H200: VRAM registers (with libcudart.so.12 present), but why ~0.5 GB/s?
# Run from a checkout whose whl/ holds the repacked nixl-cu12 cp312 wheel (scripts/repack_nixl_wheel.py),
# nvidia-cuda-runtime-cu12 and numpy (cp312 manylinux wheels); results in $OUT (a.log, b.log, c.log):
#   A: as is, UCX_PROTO_INFO=y (which UCX protocol READs VRAM)
#   B: the exporter pumps its agent every 10 us instead of 0.5 ms (does the READ wait on the exporter?)
#   C: UCX_TLS=cuda_ipc,cuda_copy,self,sm,tcp with UCX_PROTO_INFO=y
# Not yet run (its device call was refused a machine). B edits splitserve/kv/nixl.py and restores it.
export PYTHONUNBUFFERED=1
python3 -c "import numpy" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/np whl/numpy*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site whl/nixl_cu12*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --target /tmp/cu12 whl/nvidia_cuda_runtime*.whl
export PYTHONPATH=/tmp/site:/tmp/np:$PWD LD_LIBRARY_PATH=/tmp/cu12/nvidia/cuda_runtime/lib
B="timeout 70 python3 bench/nixl_gpu.py --max-mb 64 --reps 2"
echo "== A: as is, UCX_PROTO_INFO=y"; UCX_PROTO_INFO=y $B --prompt-tokens 1024 > $OUT/a.log 2>&1
grep "GB/s" $OUT/a.log; grep -iE "get|rndv|cuda" $OUT/a.log | grep -v "^\[" | head -40 | cut -c1-200
echo "== B: exporter pumped every 10 us"; sed -i 's/^PUMP_S = 0.0005/PUMP_S = 0.00001/' splitserve/kv/nixl.py; grep -n "^PUMP_S" splitserve/kv/nixl.py
$B --prompt-tokens 4096 > $OUT/b.log 2>&1; grep "GB/s" $OUT/b.log | head -14
sed -i 's/^PUMP_S = 0.00001/PUMP_S = 0.0005/' splitserve/kv/nixl.py
echo "== C: UCX_TLS=cuda_ipc,cuda_copy,self,sm,tcp"; UCX_TLS=cuda_ipc,cuda_copy,self,sm,tcp UCX_PROTO_INFO=y $B --prompt-tokens 1024 > $OUT/c.log 2>&1
grep "GB/s" $OUT/c.log | head -14; tail -3 $OUT/c.log
