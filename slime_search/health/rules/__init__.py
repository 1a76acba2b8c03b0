"""The health guard's rules, one module per family; each returns the events its records call for (health.guard).

inputs      what a rollout returns, the trainer's log-probs and a save's disk: stop, skip, or wait out a passing fault
updates     refused updates and the gradient-norm bound the optimizer refuses above
bounds      signals beyond their bounds: warnings, and the one update that broke the policy
escalation  warnings that hold: a re-push of the weights or a rollback
reward      the training reward: down (gating the length rules) and dropped (a rollback)
held_out    a held-out evaluation below the best: watched, then rolled back
end         at the end of the run: whether to end on the best evaluated checkpoint
"""
