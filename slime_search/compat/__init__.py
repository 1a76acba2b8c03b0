"""Plugins written against THUDM/slime run here unchanged, without slime installed.

A slime plugin imports `slime.utils.types.Sample`, `slime.rollout.sglang_rollout.GenerateState`,
`slime.utils.http_utils.post` (and slime's TIS helper `slime.backends.megatron_utils.cp_utils`). When slime itself
cannot be imported, `finder` serves those modules under the name `slime` from `slime_search/compat/slime/`, with
slime's semantics; a real slime install is always found first and is never shadowed. `boundary` converts this
project's samples to slime's at the plugin boundary and back, so nothing else in the project depends on slime's
types. docs/from_slime.md ("Plugins") lists what runs unchanged and what differs.
"""
