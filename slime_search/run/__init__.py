"""The driver's wing: what a training run is made of and how it goes.

config.py       RunConfig, built once from the flags
parts.py        RunParts, typed (protocols.py), started and stopped through one ExitStack
loop.py         the steps; every decision of the guard reaches it as one Decision
recovery.py     resume, rollback, stop, the end on the best checkpoint
pauses.py       passing faults waited out (an outage, a full disk)
engine_check.py the probe of the engines against the trainer, and what follows
evaluators.py   held-out evaluation inside the step or beside training (eval_beside.py: its engine)
folder.py       RunFolder: RUN/ on disk
"""
