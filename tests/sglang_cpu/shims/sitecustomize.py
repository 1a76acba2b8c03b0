"""Test-only: lets PyPI's torchvision (a CUDA build) import next to torch's CPU build in the SGLang test venv.

torchvision registers fake kernels for its C++ ops at import; without its CUDA library those ops were never defined, and
the import fails (`operator torchvision::nms does not exist`). SGLang imports torchvision.transforms unconditionally,
and never calls these ops for a text model: defining their schemas lets the import go through, and a call of either op
would still fail (it has no kernel). Only the SGLang test servers have this folder on their PYTHONPATH.
"""

try:
    import torch

    _torchvision_ops = torch.library.Library("torchvision", "FRAGMENT")
    _torchvision_ops.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _torchvision_ops.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:  # noqa: BLE001 - interpreter start-up must never fail because of this stand-in
    pass

# Test-only, for the LoRA engine alone (SGLANG_CPU_UNPINNED=1): SGLang's LoRA layers and its torch_native LoRA backend
# allocate their index tensors with pin_memory=True, which a CPU-only torch refuses. Pinned host memory only speeds
# copies to an accelerator, and a CPU engine makes none: the tensors are the same unpinned. Anything that asks whether
# a tensor is pinned is refused, so code that would rely on the pinning fails loudly here.
import os as _os

if _os.environ.get("SGLANG_CPU_UNPINNED") == "1":
    try:
        import torch as _torch

        def _unpinned(factory):
            def make(*args, pin_memory=False, **kwargs):
                return factory(*args, **kwargs)

            return make

        for _name in ("tensor", "zeros", "empty", "ones", "full", "arange"):
            setattr(_torch, _name, _unpinned(getattr(_torch, _name)))
        _torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

        def _refuse_is_pinned(self, *args, **kwargs):
            raise RuntimeError("SGLANG_CPU_UNPINNED: this CPU test engine does not pin memory")

        _torch.Tensor.is_pinned = _refuse_is_pinned
    except Exception:  # noqa: BLE001 - interpreter start-up must never fail because of this stand-in
        pass
