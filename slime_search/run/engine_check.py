"""Whether the engines serve what the trainer holds: the probe, and what follows when one does not.

The probe teacher-forces the same tokens on both sides right after a push, when both hold the same weights. The tokens
are a sample of the step's batch (prompt and response, at most PROBE_TOKENS). Each engine gives its log-probs of them
(RolloutManager.engine_log_probs: SGLang's input log-probs), and so does the actor (RayTrainGroup.trainer_log_probs).
Both are of the model's own distribution, at temperature 1: SGLang 0.5.23 gives input log-probs at temperature 1
whatever a request samples at. The gap of an engine is its mean |engine - trainer| log-prob per token (`probe_gaps`).
Above --health-max-logprob-gap the engine disagrees.

The probe runs after the re-push of a trainer-engine mismatch that held --health-patience steps
(health.rules.escalation). In asynchronous modes it also runs every --health-patience steps. There the engine rules
read only the tokens of version lag 0, and the miniature's asynchronous batches have none after step 0
(health.rules.bounds).

What follows:
    every engine agrees   the engines serve the trainer's weights; the batches' gap was the policy's (tokens sampled
                          by older weights), or the re-push cured it; no rollback, and the count begins afresh (a
                          probe due by the clock that agrees is no event: it logs at info)
    an engine disagrees   it is restarted on its address as a dead engine is (RolloutManager.restart_engine, then
                          RunParts.engines_back), pushed the current weights and probed again; if it still disagrees,
                          or cannot be restarted (colocated, or not started by this run), the run stops naming it, on
                          the newest kept checkpoint: the policy is not at fault

The bound sits far above float noise and far below a wrong engine. The gaps measured on both sides of it are in
docs/benchmarks/health.md ("The engine probe").
"""

from __future__ import annotations

import logging
import math
from typing import NoReturn

from slime_search.health.events import Decision, Event

logger = logging.getLogger(__name__)

RULE = "engine_mismatch"
PROBE_TOKENS = 512  # one prefill on each engine and one forward of the actor: milliseconds on a GPU


def probe_tokens(samples, limit: int = PROBE_TOKENS) -> list[int] | None:
    """The probe's tokens: the first sample with a response (its prompt and response, an observation included), its
    first `limit` tokens; None without one."""
    for sample in samples:
        if sample.response_length > 0 and len(sample.tokens) >= 2:
            return [int(token) for token in sample.tokens[:limit]]
    return None


def probe_gaps(engines: dict[str, list[float]], trainer: list[float]) -> dict[str, float]:
    """Per engine, the mean |engine - trainer| log-prob per token of the probe (inf where either side is not
    finite: a NaN must never read as agreement)."""
    gaps = {}
    for url, values in engines.items():
        if len(values) != len(trainer):
            raise ValueError(f"engine {url} gave {len(values)} log-probs of the probe, the trainer {len(trainer)}")
        gap = math.fsum(abs(e - t) for e, t in zip(values, trainer, strict=True)) / max(1, len(trainer))
        gaps[url] = gap if math.isfinite(gap) else math.inf
    return gaps


def shown(gaps: dict[str, float]) -> str:
    return ", ".join(f"{url} {gap:.3g}" for url, gap in gaps.items())


class EngineCheck:
    """The probe and its consequences, carried out through the recovery (which records the events and stops)."""

    def __init__(self, recovery):
        self.recovery = recovery
        self.tokens: list[int] | None = None  # the last probe's tokens: a skipped step has no batch of its own

    @property
    def parts(self):
        return self.recovery.parts

    def due(self, step: int) -> bool:
        """Asynchronous modes probe every --health-patience steps (after the push of the last of them)."""
        health = self.parts.config.health
        return health.enabled and not health.synchronous and (step + 1) % health.patience == 0

    def after_push(self, step: int, reviewed: list[Event], samples) -> None:
        """After step `step` pushed version step + 1 and the guard reviewed it: the re-push it asked for and the probe
        that follows, or the probe due by the clock."""
        self.tokens = probe_tokens(samples) or self.tokens
        repush = next((e for e in reviewed if e.action == "repush"), None)
        if self.parts.transport is None or (repush is None and not self.due(step)):
            return
        if repush is not None:
            self.recovery.repush(step + 1)
        if self.tokens is not None:
            self.check(step, step + 1, repush)

    def probe(self) -> dict[str, float]:
        """Every engine's gap to the trainer on the probe tokens, by address."""
        import ray

        parts = self.parts
        parts.colocation.for_weight_push()  # the actor on its device
        trainer = parts.group.trainer_log_probs(self.tokens)
        parts.colocation.for_generation()  # the engines whole
        return probe_gaps(ray.get(parts.manager.engine_log_probs.remote(self.tokens)), trainer)

    def check(self, step: int, version: int, repush: Event | None) -> None:
        """Probe; restart the engines that disagree and probe again; stop if one still does."""
        bound = self.parts.config.health.max_logprob_gap
        gaps = self.probe()
        wrong = {url: gap for url, gap in gaps.items() if gap > bound}
        measured = f"mean |engine - trainer| log-prob per token over {len(self.tokens) - 1} tokens: {shown(gaps)}"
        if not wrong:
            if repush is None:
                logger.info("step %d: the engines agree with the trainer on the probe (%s)", step, measured)
                return
            message = (
                f"step {step}: after the re-push every engine agrees with the trainer on the probe ({measured}; bound "
                f"--health-max-logprob-gap {bound}): they serve the trainer's weights, so the {repush.rule} of the "
                "batches was the policy's (tokens sampled by older weights) or the re-push cured it; no rollback, "
                "its count begins afresh"
            )
            self.recovery.report([Event(step, "probe", RULE, message, gaps)])
            return
        after = "after the re-push" if repush is not None else "after the push"
        message = f"step {step}: {after}, {len(wrong)} engine(s) disagree with the trainer on the probe ({measured})"
        self.recovery.report([Event(step, "probe", RULE, f"{message}; bound {bound}", gaps)])
        self.restart(step, version, wrong)
        gaps = self.probe()
        still = {url: gap for url, gap in gaps.items() if gap > bound}
        measured = f"mean |engine - trainer| log-prob per token: {shown(gaps)}"
        if not still:
            message = f"step {step}: after the restart every engine agrees with the trainer on the probe ({measured})"
            self.recovery.report([Event(step, "probe", RULE, message, gaps)])
            return
        self.stop(step, still, f"after a restart and a push of version {version} ({measured}; bound {bound})")

    def restart(self, step: int, version: int, wrong: dict[str, float]) -> None:
        """Start the engines of `wrong` again, as dead engines are, and push them the weights of `version`; an engine
        that cannot be restarted stops the run."""
        import ray

        parts = self.parts
        if parts.config.colocate:
            self.stop(step, wrong, "and is not restarted: a colocated engine would take GPU memory the actor holds")
        for url, gap in wrong.items():
            message = f"step {step}: engine {url} is off the trainer by {gap:.3g} per token on the probe: restarted"
            try:
                ray.get(parts.manager.restart_engine.remote(url))
            except ValueError as err:  # an engine the run did not start (--engine-url): nothing to restart
                self.stop(step, {url: gap}, f"and cannot be restarted: {err}")
            self.recovery.report([Event(step, "restart_engine", RULE, message, {url: gap})])
        back = parts.engines_back()  # ready, paused, the transport connected to them again
        ray.get(parts.manager.pause_generation.remote())  # the others too: their weights are replaced under them
        try:
            parts.colocation.for_weight_push()
            served = parts.transport.push(str(version))
        finally:
            ray.get(parts.manager.continue_generation.remote())
        logger.info("engines %s restarted and pushed version %d; the engines serve version %s", back, version, served)

    def stop(self, step: int, wrong: dict[str, float], why: str) -> NoReturn:
        """The run stops naming the engines that disagree, on the newest kept checkpoint (the weights are not at
        fault): a stop raised to the loop, which carries it out."""
        names = ", ".join(f"{url} (mean gap {gap:.3g} per token)" for url, gap in wrong.items())
        message = f"step {step}: engine(s) {names} disagree with the trainer on the probe {why}"
        raise Decision(Event(step, "stop", RULE, message, wrong))
