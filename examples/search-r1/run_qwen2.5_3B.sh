#!/bin/bash
# Search-R1 GRPO on Qwen2.5-3B, one node with 8 GPUs: 4 for the Megatron actor (TP 2 x DP 2, sequence
# parallel) and 4 for SGLang (2 engines of TP 2). Prepare data, index and checkpoints as in README.md, then
#    bash examples/search-r1/run_qwen2.5_3B.sh
# The script starts the retriever (unless SEARCH_URL is set) and a Ray head, and stops both when it ends.
# Run it again with the same RUN_DIR to continue from the last checkpoint. USE_TIS=1 turns on TIS; NUM_ROLLOUT=5
# runs a short validation (docs/gpu.md).
# COLOCATE=1 puts the SGLang engines on the actor's GPUs instead (memory handed over between phases, weights by
# CUDA IPC); then ROLLOUT_GPUS is unused and ACTOR_GPUS=8 uses the whole node.
# ASYNC_MODE=one-step|fully overlaps generation with training (not with COLOCATE=1); MAX_STALENESS bounds fully.
# The retriever never shares a GPU with training: by default it encodes and searches on the CPU (use the HNSW index,
# RETRIEVER_INDEX=indexes/e5_HNSW64.index, unless the node has the cores for a 21M-vector flat search); with
# RETRIEVER_GPUS=ID[,ID] it takes those GPUs, which Ray then does not hand out (they must come after the
# ACTOR_GPUS + ROLLOUT_GPUS that Ray uses), with the index on them in fp16.
# RECIPE=search-r1 trains with Search-R1's own 3B step instead of slime's (README.md, "This recipe, slime's and
# Search-R1's"): 512 prompts x 5 samples per rollout, updated in 10 optimizer steps of 256; the learning rate warmed up
# linearly over the first 28.5% of the rollouts; Adam beta2 0.999; an entropy bonus of 0.001; clip 0.2 / 0.2; the loss
# averaged over tokens; top_p 0.95 (with USE_TIS=1 it stays 1: TIS compares the trainer's full distribution with the
# engine's, which top_p truncates); 1,005 rollouts.
# LORA_RANK=N trains LoRA adapters of rank N on every projection (docs/lora.md) with the base frozen, at 10x the
# learning rate (Thinking Machines' LoRA primer, tinker-docs.thinkingmachines.ai/tinker/lora-primer: LoRA's rate is
# about 10x full fine-tuning's, and rank 32 matches it in RL). With LORA_SYNC_FROM_TENSOR=1 each push carries the
# adapters alone into SGLang's LoRA serving (--lora-sync-from-tensor; not with ASYNC_MODE=fully; with COLOCATE=1 the
# engines keep their base weights while the actor trains).
set -euo pipefail
export PYTHONUNBUFFERED=1

SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"
REPO_ROOT="$(cd -- "${SCRIPT_DIR}/../.." && pwd)"
# MODEL_NAME (a file of scripts/models/) and TASK_ARGS (more task flags) let run_qwen3_4B.sh reuse this script.
source "${REPO_ROOT}/scripts/models/${MODEL_NAME:-qwen2.5-3B}.sh"
read -r -a TASK_EXTRA <<<"${TASK_ARGS:-}"
source "${SCRIPT_DIR}/common.sh"

MODEL_DIR=${MODEL_DIR:-models/Qwen2.5-3B}
DATA_DIR=${DATA_DIR:-data/nq_hotpotqa_train}
INDEX_DIR=${INDEX_DIR:-indexes}
RUN_DIR=${RUN_DIR:-runs/search-r1-qwen2.5-3B}
ACTOR_GPUS=${ACTOR_GPUS:-4}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}
RETRIEVER_PORT=${RETRIEVER_PORT:-8000}
RAY_PORT=${RAY_PORT:-6380}
USE_TIS=${USE_TIS:-0}
COLOCATE=${COLOCATE:-0}
ASYNC_MODE=${ASYNC_MODE:-off}
MAX_STALENESS=${MAX_STALENESS:-2}
RECIPE=${RECIPE:-slime}
LORA_RANK=${LORA_RANK:-0}
LORA_SYNC_FROM_TENSOR=${LORA_SYNC_FROM_TENSOR:-0}
RETRIEVER_GPUS=${RETRIEVER_GPUS:-}
RETRIEVER_INDEX=${RETRIEVER_INDEX:-${INDEX_DIR}/e5_Flat.index}

GLOBAL_BATCH_SIZE=256
case "${RECIPE}" in
   slime)  # slime's examples/search-r1 recipe: one optimizer step per rollout
      NUM_ROLLOUT=${NUM_ROLLOUT:-1000}
      PROMPTS_PER_ROLLOUT=32 SAMPLES_PER_PROMPT=8 EPS_CLIP_HIGH=0.28 ENTROPY_COEF=0.00 ADAM_BETA2=0.98
      ;;
   search-r1)  # Search-R1's train_grpo.sh and verl's ppo_trainer.yaml
      NUM_ROLLOUT=${NUM_ROLLOUT:-1005}  # trainer.total_training_steps
      # data.train_batch_size, rollout.n_agent: 2,560 trajectories, ppo_mini_batch_size 256 of them per update
      PROMPTS_PER_ROLLOUT=512 SAMPLES_PER_PROMPT=5
      EPS_CLIP_HIGH=0.2 ENTROPY_COEF=0.001 ADAM_BETA2=0.999  # clip_ratio, entropy_coeff, AdamW's betas there
      ;;
   *)
      echo "error: RECIPE=${RECIPE}: use slime (the default) or search-r1" >&2
      exit 2
      ;;
esac
STEPS_PER_ROLLOUT=$((PROMPTS_PER_ROLLOUT * SAMPLES_PER_PROMPT / GLOBAL_BATCH_SIZE))

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --load "${MODEL_DIR}_torch_dist"
   --ref-load "${MODEL_DIR}_torch_dist"
   --save "${RUN_DIR}"
   --save-interval 20
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_DIR}/train.parquet"
   --input-key prompt
   --label-key reward_model
   --apply-chat-template
   --rollout-shuffle
   --num-rollout "${NUM_ROLLOUT}"
   --rollout-batch-size "${PROMPTS_PER_ROLLOUT}"
   --n-samples-per-prompt "${SAMPLES_PER_PROMPT}"
   --global-batch-size "${GLOBAL_BATCH_SIZE}"
   --rollout-max-response-len 500  # per turn, as Search-R1's max_response_length
   --rollout-temperature 1
)

EVAL_ARGS=(
   --eval-interval 25
   --eval-prompt-data nq_test "${DATA_DIR}/test.parquet@[0:3000]"
)

PERF_ARGS=(
   --actor-num-nodes 1
   --actor-num-gpus-per-node "${ACTOR_GPUS}"
   --tensor-model-parallel-size 2
   --sequence-parallel
   --bf16
   # as slime's recipe: each layer's activations recomputed in the backward pass (docs/benchmarks/megatron.md:
   # a Qwen2.5-3B step on one H200 at 4,096 tokens per micro-batch peaks at 64 GiB with it, 136 GiB without,
   # Megatron's local attention without TransformerEngine)
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --max-tokens-per-gpu 9216
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.001
   --kl-loss-type low_var_kl
   --entropy-coef "${ENTROPY_COEF}"
   --eps-clip 0.2
   --eps-clip-high "${EPS_CLIP_HIGH}"
)
if [[ "${USE_TIS}" == "1" ]]; then
   GRPO_ARGS+=(--use-tis --tis-cap 2.0)
fi
if [[ "${RECIPE}" == "search-r1" ]]; then
   GRPO_ARGS+=(--calculate-per-token-loss)  # a mean over response tokens, as verl's masked_mean
   if [[ "${USE_TIS}" != "1" ]]; then
      ROLLOUT_ARGS+=(--rollout-top-p 0.95)  # rollout.top_p there
   fi
fi

LR=1e-6
LORA_ARGS=()
if [[ "${LORA_RANK}" != "0" ]]; then
   LR=1e-5
   LORA_ARGS=(--lora-rank "${LORA_RANK}" --lora-alpha 32 --target-modules all-linear)
   if [[ "${LORA_SYNC_FROM_TENSOR}" == "1" ]]; then
      LORA_ARGS+=(--lora-sync-from-tensor)
   fi
fi

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr "${LR}"
   --lr-decay-style constant
   --weight-decay 0.01
   --adam-beta1 0.9
   --adam-beta2 "${ADAM_BETA2}"
)
if [[ "${RECIPE}" == "search-r1" ]]; then
   # lr_warmup_steps_ratio 0.285 of the rollouts; verl steps its scheduler once per rollout, ours once per update
   OPTIMIZER_ARGS+=(--lr-warmup-iters "$((NUM_ROLLOUT * 285 / 1000 * STEPS_PER_ROLLOUT))")
fi

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 2
   --update-weight-buffer-size 536870912
)
if [[ "${COLOCATE}" == "1" ]]; then
   # the engines' share of each GPU while they generate; the actor is offloaded to host memory meanwhile
   SGLANG_ARGS+=(--colocate --sglang-mem-fraction-static 0.5)
   ROLLOUT_GPUS=0
else
   SGLANG_ARGS+=(--rollout-num-gpus "${ROLLOUT_GPUS}" --sglang-mem-fraction-static 0.7)
fi
SGLANG_ARGS+=(--async-mode "${ASYNC_MODE}" --max-staleness "${MAX_STALENESS}")

CUSTOM_ARGS=(
   --custom-generate-function-path slime_search.search_r1.generate.generate
   --custom-rm-path slime_search.search_r1.reward.reward_func
   --search-backend local
   --search-topk 3
   --max-turns 2
   --max-obs-tokens 500
   "${TASK_EXTRA[@]}"
)

WANDB_ARGS=(
   # --use-wandb --wandb-project slime-search --wandb-group search-r1-qwen2.5-3B
)

TRAIN=(
   python3 "${REPO_ROOT}/train.py"
   "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${PERF_ARGS[@]}"
   "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${LORA_ARGS[@]}" "${SGLANG_ARGS[@]}" "${CUSTOM_ARGS[@]}" "${WANDB_ARGS[@]}"
)

RETRIEVER_ARGS=(
   --index-path "${RETRIEVER_INDEX}" --corpus-path "${INDEX_DIR}/wiki-18.jsonl"
   --retriever-name e5 --retriever-model intfloat/e5-base-v2 --topk 3
)
if [[ -n "${RETRIEVER_GPUS}" ]]; then
   RETRIEVER_ARGS+=(--faiss-gpu --fp16)
fi

if [[ "${DRY_RUN:-0}" == "1" ]]; then
   run_or_print "${TRAIN[@]}" --search-url "${SEARCH_URL:-http://127.0.0.1:${RETRIEVER_PORT}/retrieve}"
   # the retriever's device and flags, on stderr so that stdout stays the training command
   echo "retriever: CUDA_VISIBLE_DEVICES=${RETRIEVER_GPUS} ${RETRIEVER_ARGS[*]}" >&2
   exit 0
fi

mkdir -p "${RUN_DIR}"
if [[ -z "${SEARCH_URL:-}" ]]; then
   # an empty CUDA_VISIBLE_DEVICES keeps the encoder and the index off every GPU
   CUDA_VISIBLE_DEVICES="${RETRIEVER_GPUS}" start_retriever "${RETRIEVER_PORT}" "${RUN_DIR}/retriever.log" \
      "${RETRIEVER_ARGS[@]}"
fi
start_ray_head "${RAY_PORT}" "$((ACTOR_GPUS + ROLLOUT_GPUS))" "${RUN_DIR}/ray_head.log"
run_or_print "${TRAIN[@]}" --search-url "${SEARCH_URL}"
