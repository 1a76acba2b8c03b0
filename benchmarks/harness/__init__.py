"""What the instruments share, and the only part of `benchmarks/` one instrument may import from another.

`paths` (where the repository, its run scripts and the shared data are), `baselines` (figures as data),
`miniature_runs` (runs of the CPU miniature's script over seeds x modes x replicas, and what each left in its folder),
`curves` (the reward and held-out curves of the recipe's and the miniature's shapes), `guard_replay` (the guard over
recorded metrics), `recipe` (the 3B recipe's own flags), `queries` (questions and search queries from the shared
data), `model_shape` and `handover` (a benchmarked actor's shape and its colocated hand-over), and
`stand_in_engines/` (servers of SGLang's `/generate` from a script, recorded trajectories or an emulated H100).
"""
