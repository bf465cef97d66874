#!/usr/bin/env bash
# `stree bench serve` on the lent GPU: one OpenAI-compatible server per configuration on the trained pair
# (plain decoding as the anchor, then the mamba drafter with --tree auto and a fixed beam tree), each
# measured with the same 64 HumanEval prompts x 128 tokens at several concurrency caps.
# Usage (repo root): bench/serve_gpu.sh OUT_DIR [TAG]
set -euo pipefail
source bench/gpu_start.sh "$@"
port=18080
for cfg in "plain:--drafter none" "auto:--drafter mamba --draft-model checkpoints/demo-draft --option tree=auto" \
           "beam:--drafter mamba --draft-model checkpoints/demo-draft --option tree=beam:5x3"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  python3 -m stree.cli serve checkpoints/demo-target --port 0 --http-port $port --max-sessions ${SESSIONS:-16} \
    --dtype ${DTYPE:-float32} $flags > "$out/server-$name.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break
    kill -0 $pid 2>/dev/null || { tail -5 "$out/server-$name.log"; break; }; sleep 1; done
  python3 -m stree.cli bench serve --url "http://127.0.0.1:$port" --prompt-set humaneval --num-prompts 64 \
    --max-tokens 128 --max-concurrency ${CONCURRENCY:-1,16} --out "$out/serve-$name-$tag" 2>&1 \
    | tr '\r' '\n' | grep -v 'it/s\]$' | tail -8
  kill $pid; wait $pid 2>/dev/null || true
  port=$((port + 1))
done
