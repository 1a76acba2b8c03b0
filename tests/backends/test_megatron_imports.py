"""Megatron-core imported with its fused functions compiled when first called: the same compilation, later."""

import subprocess
import sys

import torch

from slime_search.backends.megatron.imports import compile_on_first_call


def test_a_function_is_compiled_on_its_first_call_once_with_the_options_given():
    compiled = []

    def fake_compile(function, **options):
        compiled.append((function.__name__, options))
        return lambda *args: ("compiled", function(*args))

    deferred = compile_on_first_call(fake_compile)

    @deferred
    def double(x):
        return 2 * x

    @deferred(dynamic=False)
    def triple(x):
        return 3 * x

    assert compiled == [] and double.__name__ == "double"  # decorating compiles nothing
    assert double(2) == ("compiled", 4) and double(3) == ("compiled", 6)
    assert triple(1) == ("compiled", 3)
    assert compiled == [("double", {}), ("triple", {"dynamic": False})]  # each once, with its options


def test_a_module_goes_to_the_compiler_at_once():
    calls = []
    module = torch.nn.Linear(2, 2)
    assert compile_on_first_call(lambda model, **options: calls.append(model) or "compiled")(module) == "compiled"
    assert calls == [module]


def test_importing_megatron_leaves_the_compiler_unimported_and_torch_compile_restored():
    """In a fresh process: Megatron's fused functions are deferred (they would import Inductor's compile_fx when
    decorated), and torch.compile is the real one again for everything imported afterwards."""
    probe = (
        "import sys, torch; real = torch.compile\n"
        "from slime_search.backends.megatron.imports import import_megatron_core\n"
        "import_megatron_core()\n"
        "from megatron.core.fusions import fused_bias_geglu\n"
        "print('torch._inductor.compile_fx' in sys.modules, torch.compile is real,"
        " hasattr(fused_bias_geglu.geglu, '__wrapped__'))\n"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True"]
