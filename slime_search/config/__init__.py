"""The components' configurations whose fields are their command-line flags (declared once: utils.flag_fields), free
of torch, Megatron and Ray so that the parser, the slime vocabulary and the components share them."""
