#!/bin/bash
# Search-R1 GRPO on Qwen3-4B with Qwen3's native tool calls, one node with 8 GPUs: the layout and every option of
# run_qwen2.5_3B.sh (ACTOR_GPUS, ROLLOUT_GPUS, USE_TIS, COLOCATE, ASYNC_MODE, ...), with
#   - the model flags of scripts/models/qwen3-4B.sh and the HF checkpoint in MODEL_DIR (models/Qwen3-4B);
#   - --tool-format qwen3: the search tool declared by the chat template, <tool_call> JSON, tool responses in the
#     template's form; prompts made with the native template:
#        python examples/search-r1/data_process/qa_search_train_merge.py --template-type native ...
#   - thinking off by default (the template's empty think block), as torchtitan's and prime-rl's Qwen3 recipes;
#     ENABLE_THINKING=1 lets the model think before it acts.
set -euo pipefail
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"

export MODEL_NAME=qwen3-4B
export MODEL_DIR=${MODEL_DIR:-models/Qwen3-4B}
export DATA_DIR=${DATA_DIR:-data/nq_hotpotqa_train_native}
export RUN_DIR=${RUN_DIR:-runs/search-r1-qwen3-4B}
if [[ "${ENABLE_THINKING:-0}" == "1" ]]; then
   export TASK_ARGS="--tool-format qwen3 --enable-thinking"
else
   export TASK_ARGS="--tool-format qwen3 --no-enable-thinking"
fi
exec bash "${SCRIPT_DIR}/run_qwen2.5_3B.sh"
