"""The install: exclusive faiss extras, everything a GPU run starts in the GPU extra, one pinned GPU stack."""

import ast

from packaging.requirements import Requirement

from tests.conftest import REPO_ROOT


def setup_lists() -> dict[str, list[Requirement]]:
    """The requirement lists setup.py declares (CORE, CPU, GPU, DEV), read without running it."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    lists = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            lists[node.targets[0].id] = [Requirement(text) for text in ast.literal_eval(node.value)]
    return lists


def names(requirements: list[Requirement]) -> set[str]:
    return {r.name.lower().replace("_", "-") for r in requirements}


def gpu_pins() -> dict[str, str]:
    pins = {}
    for line in (REPO_ROOT / "constraints-gpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def test_faiss_cpu_and_faiss_gpu_are_never_installed_together():
    lists = setup_lists()
    assert not any(name.startswith("faiss") for name in names(lists["CORE"] + lists["DEV"]))
    assert {name for name in names(lists["CPU"]) if name.startswith("faiss")} == {"faiss-cpu"}
    assert "faiss-gpu-cu12" in names(lists["GPU"]) and "faiss-cpu" not in names(lists["GPU"])


def test_the_cpu_extra_has_the_retrieval_servers_query_encoder_runtime():
    # without them the server's default (--encoder-runtime auto) serves queries with torch, about half as fast
    assert {"onnx", "onnxruntime"} <= names(setup_lists()["CPU"])


def test_the_gpu_extra_has_what_a_gpu_run_starts():
    # no SGLang version depends on sglang-router, and every run with SGLang engines starts it
    assert {"sglang", "sglang-router", "torch-memory-saver"} <= names(setup_lists()["GPU"])
    # the recipes' retriever encodes queries on the CPU of a GPU node as well: ONNX Runtime, or torch at a fraction
    assert {"onnx", "onnxruntime"} <= names(setup_lists()["GPU"])


def test_every_gpu_package_is_pinned_to_one_tested_version():
    pins = gpu_pins()
    gpu = names(setup_lists()["GPU"])
    stack = {"torch", "transformers", "megatron-core", "transformer-engine", "transformer-engine-torch"}
    assert gpu | stack <= set(pins), sorted(gpu | stack - set(pins))
    for requirement in setup_lists()["GPU"]:  # the extra's ranges admit the pins
        assert requirement.specifier.contains(pins[requirement.name.lower()], prereleases=True), requirement
    assert pins["transformer-engine"] == pins["transformer-engine-torch"] == pins["transformer-engine-cu13"]
    # megatron-core 0.16 is tested with TransformerEngine >=2.9,<2.12
    major, minor = (int(part) for part in pins["transformer-engine"].split(".")[:2])
    assert pins["megatron-core"].startswith("0.16.") and (2, 9) <= (major, minor) < (2, 12)


def test_the_sglang_the_tests_run_on_cpu_is_the_pinned_one():
    from tests import sglang_cpu

    sglang_cpu.python()  # skips without the test environment
    installed = (sglang_cpu.VENV / "installed").read_text()
    pins = gpu_pins()
    assert installed.startswith(f"sglang=={pins['sglang']} sglang-router=={pins['sglang-router']} ")
