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
