"""The training driver: the run's parts started (run.parts), the steps run (run.loop), the parts stopped.

    python -m slime_search.train --hf-checkpoint CKPT --save RUN --prompt-data train.parquet \
        --num-rollout 100 --rollout-batch-size 32 --n-samples-per-prompt 8 --search-url http://127.0.0.1:8000/retrieve

Megatron ranks run as Ray actors placed by a placement group (CPU bundles on a CPU machine; slime_search.ray); the
RolloutManager Ray actor owns the engines (the CPU engine server, or SGLang engines behind the router on GPU), the
prompt data and the generate / reward plugins (slime_search.rollout). Weights reach the engines by one transport
(slime_search.weight_sync: broadcast from actor rank 0, tensor handles, or an HF checkpoint on disk). With
--colocate the engines share the actor's devices and the two hand memory over between phases
(slime_search.ray.colocation). The health guard checks every step (slime_search.health); what it decides is carried
out by slime_search.run.recovery. Running the same command again continues from the run folder's last complete
checkpoint; exit code 3 means the guard stopped the run (RUN/stopped.json says what to change).
"""

from __future__ import annotations

import logging
import sys
from contextlib import ExitStack

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    from slime_search.arguments import parse_args, preflight
    from slime_search.utils.sigint import answer_sigint

    answer_sigint()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    preflight(args)  # a retriever that is down is found now, not after Ray started and the models loaded
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch
    from transformers import AutoConfig

    from slime_search.arguments import check_model_flags
    from slime_search.health.events import RunStopped
    from slime_search.report import render_report
    from slime_search.run.config import run_config
    from slime_search.run.loop import run_steps
    from slime_search.run.parts import open_parts
    from slime_search.run.recovery import STOP_EXIT_CODE, Recovery, repeated_stop

    hf_config = AutoConfig.from_pretrained(args.hf_checkpoint)
    try:
        check_model_flags(args, hf_config)
    except ValueError as err:  # a usage error, said as argparse says one, before Ray starts and the models load
        sys.stderr.write(f"error: {err}\n")
        return 2
    config = run_config(args, hf_config.vocab_size, use_gpu=torch.cuda.is_available())
    refusal = repeated_stop(config.run_dir, argv)
    if refusal is not None:  # the guard stopped this run, and the same command would stop it the same way
        logger.error("%s", refusal)
        return STOP_EXIT_CODE
    code = 0
    with ExitStack() as stack:  # leaving it stops every part that started, in reverse
        parts = open_parts(config, args, stack)
        recovery = Recovery(parts, argv)
        try:
            run_steps(parts, recovery, recovery.resume())
        except RunStopped as stopped:  # the guard's verdict: the run cannot go on; the report says why as well
            logger.error("run stopped: %s", stopped)
            code = STOP_EXIT_CODE
    logger.info("report: %s", render_report(config.run_dir))
    return code


if __name__ == "__main__":
    sys.exit(main())
