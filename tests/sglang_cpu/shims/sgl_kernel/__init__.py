"""Test-only stand-in for `sgl_kernel`, so that SGLang imports on a CPU machine without its CPU kernels.

SGLang with SGLANG_USE_CPU_ENGINE=1 imports `<op>_cpu` functions from sgl_kernel at module import time. PyPI has no CPU
build of sgl_kernel, and on a CPU without AMX, with --attention-backend torch_native, SGLang never calls these
functions: every layer runs its pure-torch path. Each name here is a function that raises if it is ever called, so a
code path that starts relying on a real kernel fails loudly instead of computing anything. Never installed outside the
test venv (tests/sglang_cpu/setup.sh puts this folder on the servers' PYTHONPATH).
"""

__version__ = "0.0.0+cpu-import-stub"


def __getattr__(name: str):
    if name.endswith("_cpu"):

        def unavailable(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{name} was called, but this is the test-only import stand-in")

        unavailable.__name__ = name
        return unavailable
    raise AttributeError(name)  # no submodules: SGLang's own ImportError fallbacks apply
