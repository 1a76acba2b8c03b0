"""slime's plugin API, served as `slime` by slime_search.compat.finder when slime itself is not installed.

Import these modules as `slime.utils.types`, ... (never as `slime_search.compat.slime...`: that would make a second
copy of every class).
"""
