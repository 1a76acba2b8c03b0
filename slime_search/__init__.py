"""slime-search: RL training of LLMs that reason and call a search engine (Search-R1 on Megatron + SGLang)."""

__version__ = "0.1.0"
