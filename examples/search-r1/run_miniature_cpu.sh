#!/bin/bash
# Search-R1 in miniature, on CPU: a policy trained from scratch learns, by RL, to search before answering.
#    bash examples/search-r1/run_miniature_cpu.sh            # RUN_DIR=runs/miniature by default
# 1. a synthetic task (fictional people and companies; questions only the corpus answers, some two-hop)
# 2. a tiny Qwen2 policy with a tokenizer trained on the task's text, pre-trained to read (search and copy
#    answers out of passages) on short documents about training entities, never taught whether to search
# 3. a BM25 index of the corpus, served by the retrieval server
# 4. SFT warm start on a scripted demonstrator that searches only part of the time and guesses otherwise
# 5. GRPO with search from that start, evaluated on held-out questions (greedy), and the report
# The script starts the retriever and the demonstrator, and stops exactly those when it ends (by PID).
# Run again with the same RUN_DIR, it skips the phases already complete (each leaves a .done mark): with RL_NAME and
# RL_ARGS a second RL run starts from the same SFT weights, e.g.
#    RL_NAME=rl-fully RL_ARGS="--async-mode fully --max-staleness 2" bash examples/search-r1/run_miniature_cpu.sh
# STOP_AFTER=sft prepares that SFT start (every phase before RL) and stops there.
# POLICY=qwen3 TOOL_FORMAT=qwen3 runs it with a Qwen3-shaped policy (Qwen3's added tokens and chat template) that
# calls search as Qwen3's native tool calls (the demonstrator, the prompts and the loop all speak that format).
# LORA_RANK=N trains RL as LoRA adapters of rank N on the SFT weights (docs/lora.md), at 10x the learning rate, e.g.
#    RL_NAME=rl-lora LORA_RANK=8 bash examples/search-r1/run_miniature_cpu.sh
set -euo pipefail
export PYTHONUNBUFFERED=1
SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
REPO_ROOT="$(cd -- "${SCRIPT_DIR}/../.." && pwd)"
source "${SCRIPT_DIR}/common.sh"

RUN_DIR=${RUN_DIR:-runs/miniature}
SEED=${SEED:-0}
PEOPLE=${PEOPLE:-800}
COMPANIES=${COMPANIES:-200}
HELDOUT=${HELDOUT:-64}
SEARCH_PROB=${SEARCH_PROB:-0.4}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-800}  # at most: it stops once the reading skills formed
SFT_STEPS=${SFT_STEPS:-100}
SFT_BATCH=${SFT_BATCH:-32}
SFT_LR=${SFT_LR:-2e-3}
RL_STEPS=${RL_STEPS:-20}
RL_PROMPTS=${RL_PROMPTS:-8}
RL_SAMPLES=${RL_SAMPLES:-8}
LORA_RANK=${LORA_RANK:-0}
if [[ "${LORA_RANK}" != "0" ]]; then
   RL_LR=${RL_LR:-5e-3}  # LoRA's rate is about 10x full fine-tuning's (docs/lora.md)
else
   RL_LR=${RL_LR:-5e-4}
fi
RL_NAME=${RL_NAME:-rl}
STOP_AFTER=${STOP_AFTER:-}  # sft: stop once the SFT start is ready, before RL
if [[ -n "${STOP_AFTER}" && "${STOP_AFTER}" != "sft" ]]; then
   echo "STOP_AFTER=${STOP_AFTER}: the one phase to stop after is sft" >&2
   exit 2
fi
RL_SAVE_INTERVAL=${RL_SAVE_INTERVAL:-5}  # checkpoints the health guard can roll back to (0: only at the end)
read -r -a RL_EXTRA <<<"${RL_ARGS:-}"
if [[ "${LORA_RANK}" != "0" ]]; then
   RL_EXTRA+=(--lora-rank "${LORA_RANK}" --lora-alpha 32)
fi
# the RL run's importance weights against the engine: TIS by default; e.g. IS_ARGS="--use-mis --mis-mode mask" for an
# IcePop-style token mask (the two are exclusive, so it replaces --use-tis rather than adding to RL_ARGS)
read -r -a IS_EXTRA <<<"${IS_ARGS:---use-tis}"
EVAL_INTERVAL=${EVAL_INTERVAL:-5}
RETRIEVER_PORT=${RETRIEVER_PORT:-8790}
DEMO_PORT=${DEMO_PORT:-8791}
POLICY=${POLICY:-qwen2}
TOOL_FORMAT=${TOOL_FORMAT:-tags}
POLICY_ARGS=(--hidden-size "${HIDDEN_SIZE:-128}" --num-layers "${NUM_LAYERS:-2}" --num-heads 4 --intermediate-size 384
   --family "${POLICY}")
PROMPT_TEMPLATE=base
[[ "${TOOL_FORMAT}" == "qwen3" ]] && PROMPT_TEMPLATE=native

done_mark() {  # done_mark PHASE: whether PHASE completed in an earlier run of this RUN_DIR
   [[ -f "${RUN_DIR}/.done-$1" ]]
}
mark_done() {
   touch "${RUN_DIR}/.done-$1"
}

mkdir -p "${RUN_DIR}"
if ! done_mark task; then
   python3 -m slime_search.miniature.task --out "${RUN_DIR}/task" --seed "${SEED}" \
      --people "${PEOPLE}" --companies "${COMPANIES}" --heldout-limit "${HELDOUT}" --prompt-template "${PROMPT_TEMPLATE}"
   mark_done task
fi
if ! done_mark policy; then
   python3 -m slime_search.miniature.policy --task "${RUN_DIR}/task" --out "${RUN_DIR}/policy" \
      --seed "${SEED}" --vocab-size 8192 "${POLICY_ARGS[@]}" --pretrain-steps "${PRETRAIN_STEPS}" \
      --tool-format "${TOOL_FORMAT}"
   mark_done policy
fi
if ! done_mark index; then
   python3 "${REPO_ROOT}/local_dense_retriever/build_index.py" --retriever-name bm25 \
      --corpus-path "${RUN_DIR}/task/corpus.jsonl" --save-dir "${RUN_DIR}/index"
   mark_done index
fi

start_retriever "${RETRIEVER_PORT}" "${RUN_DIR}/retriever.log" --retriever-name bm25 \
   --index-path "${RUN_DIR}/index/bm25" --corpus-path "${RUN_DIR}/task/corpus.jsonl" --topk 1

SEARCH_ARGS=(
   --search-url "${SEARCH_URL}"
   --search-topk 1
   --max-turns 2
   --max-obs-tokens 96
   --max-response-tokens 192
   --rollout-max-response-len 48
   --apply-chat-template
   --tool-format "${TOOL_FORMAT}"
   --custom-generate-function-path slime_search.search_r1.generate.generate
   --custom-rm-path slime_search.search_r1.reward.reward_func
)
COMMON_ARGS=(
   --hf-checkpoint "${RUN_DIR}/policy"
   --prompt-data "${RUN_DIR}/task/train.parquet"
   --rollout-shuffle
   --rollout-seed "${SEED}"
   --seed "${SEED}"
   --actor-num-gpus-per-node 1
   --max-tokens-per-gpu 512
   --clip-grad 1.0
)

# SFT warm start: the demonstrator plays the engine; the policy learns its format (loss on generated tokens)
if ! done_mark sft; then
   python3 -m slime_search.miniature.demonstrator --tokenizer "${RUN_DIR}/policy" --seed "${SEED}" \
      --search-prob "${SEARCH_PROB}" --port "${DEMO_PORT}" --tool-format "${TOOL_FORMAT}" \
      >"${RUN_DIR}/demonstrator.log" 2>&1 &
   DEMO_PID=$!
   STARTED_PIDS+=("${DEMO_PID}")
   wait_http "http://127.0.0.1:${DEMO_PORT}/health" 60 "${DEMO_PID}"
   run_driver python3 "${REPO_ROOT}/train.py" "${COMMON_ARGS[@]}" "${SEARCH_ARGS[@]}" \
      --save "${RUN_DIR}/sft" --engine-url "http://127.0.0.1:${DEMO_PORT}" --loss-type sft \
      --num-rollout "${SFT_STEPS}" --rollout-batch-size "${SFT_BATCH}" --n-samples-per-prompt 1 \
      --lr "${SFT_LR}" --lr-warmup-iters 5 --rollout-temperature 1.0
   mark_done sft
fi

if [[ "${STOP_AFTER}" == "sft" ]]; then
   echo "the SFT start is ready in ${RUN_DIR}; RL runs from it skip every phase before RL"
   exit 0
fi

# GRPO with search from the SFT weights, evaluated on held-out questions
run_driver python3 "${REPO_ROOT}/train.py" "${COMMON_ARGS[@]}" "${SEARCH_ARGS[@]}" \
   --save "${RUN_DIR}/${RL_NAME}" --load "${RUN_DIR}/sft/checkpoints" \
   --num-rollout "${RL_STEPS}" --rollout-batch-size "${RL_PROMPTS}" --n-samples-per-prompt "${RL_SAMPLES}" \
   --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 "${IS_EXTRA[@]}" --lr "${RL_LR}" \
   --eval-prompt-data heldout "${RUN_DIR}/task/heldout.parquet" --eval-interval "${EVAL_INTERVAL}" \
   --save-interval "${RL_SAVE_INTERVAL}" --log-rollout-examples 6 "${RL_EXTRA[@]}"

python3 -m slime_search.report "${RUN_DIR}/${RL_NAME}"
python3 - "${RUN_DIR}/${RL_NAME}/metrics.jsonl" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
evals = [r for r in records if "eval/em" in r]
first, last = evals[0], evals[-1]
print(f"held-out EM {first['eval/em']:.3f} -> {last['eval/em']:.3f}; "
      f"search rate {first['eval/search_rate']:.3f} -> {last['eval/search_rate']:.3f} "
      f"(weight versions {first['step']} -> {last['step']})")
PY
