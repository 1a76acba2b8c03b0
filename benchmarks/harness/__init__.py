"""What the instruments share, and the only part of `benchmarks/` one instrument may import from another.

`paths` says where the repository, its run scripts and the shared data are. `baselines` holds figures as data.
`miniature_runs` runs the CPU miniature's script over seeds x modes x replicas and reads what each run left in its
folder. `curves` gives the reward and held-out curves of the recipe's and the miniature's shapes. `guard_replay` runs
the guard over recorded metrics. `recipe` holds the 3B recipe's own flags. `queries` gives questions and search queries
from the shared data. `model_shape` and `handover` give a benchmarked actor's shape and its colocated hand-over.
`stand_in_engines/` holds servers of SGLang's `/generate` from a script, recorded trajectories or an emulated H100.
"""
