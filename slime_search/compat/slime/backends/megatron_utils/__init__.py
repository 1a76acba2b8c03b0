"""slime.backends.megatron_utils: the context-parallel helpers slime's TIS/MIS helper imports."""
