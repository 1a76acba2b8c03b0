"""Offline model artefacts: the real Qwen2 tokenizer and tiny Qwen2-architecture policies for CPU runs and tests."""
