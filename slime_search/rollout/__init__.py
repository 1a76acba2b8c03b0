"""Stage 1 of a step: prompts -> samples through the generate and reward plugins -> GRPO advantages; the
RolloutManager that owns the engines and the prompt data, and the evaluation metrics."""
