"""DeepSpeed module paths the Hugging Face integration imports from: ``deepspeed.runtime.*``,
``deepspeed.checkpoint.utils``, ``deepspeed.utils.logger``, under zerodp's names."""
import logging

import torch

import zerodp


def test_runtime_faces_are_zerodps_own_objects():
    from zerodp.optim.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
    from zerodp.runtime.engine import DeepSpeedEngine
    from zerodp.runtime.lr_schedules import WarmupCosineLR as cosine
    from zerodp.runtime.lr_schedules import WarmupDecayLR as decay
    from zerodp.runtime.lr_schedules import WarmupLR as warmup
    assert (warmup, decay, cosine) == (WarmupLR, WarmupDecayLR, WarmupCosineLR)
    assert DeepSpeedEngine is zerodp.ZeroEngine


def test_utils_logger_is_zerodps_logger():
    from zerodp.utils import logger
    assert logger is logging.getLogger("zerodp")


def test_clone_tensors_for_torch_save_copies_every_tensor_it_holds():
    from zerodp.checkpoint.utils import clone_tensors_for_torch_save
    base = torch.arange(10.0, requires_grad=True)
    view = base[2:4]
    item = {"a": [view, (base, 3)], "b": "text", "c": None}
    out = clone_tensors_for_torch_save(item)
    assert out["b"] == "text" and out["c"] is None and out["a"][1][1] == 3
    assert isinstance(out["a"], list) and isinstance(out["a"][1], tuple)
    copied = out["a"][0]
    assert torch.equal(copied, view.detach()) and not copied.requires_grad
    assert copied.untyped_storage().nbytes() == 2 * 4  # its own storage, not the base's 40 bytes
    assert copied.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert clone_tensors_for_torch_save(torch.ones(2), device="cpu").device == torch.device("cpu")
