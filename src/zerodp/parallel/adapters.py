"""PEFT's LoRA adapters on a tensor-parallel model.

PEFT wraps the model (``PeftModel``, whose ``get_base_model()`` is the ``transformers`` model the
plan names) and each targeted layer (a LoRA layer: the original layer as ``base_layer``, and per
adapter ``lora_A`` (in -> r) and ``lora_B`` (r -> out) ``Linear`` s whose product is added to its
output). A split layer's adapter splits with it so that its output is laid out as the layer's:

* column split (output features): ``lora_B`` takes the same split (its rows, in the same fused
  blocks), ``lora_A`` stays whole. ``lora_A``'s output is the same on every rank, and torch's style
  sums the gradient that comes back to it over the tensor-parallel ranks, so ``lora_A``'s
  gradient is whole too. Under sequence parallelism ``lora_A`` runs on this rank's sequence slice
  (its parameters replicated ``DTensor`` s, like a sequence-parallel norm's) and ``lora_B`` gathers
  the slices as the layer does.
* row split (input features, partial outputs summed): ``lora_A`` takes the same split (its
  columns; its partial outputs are summed as the layer's are), ``lora_B`` stays whole and runs
  on the summed rank-``r`` activation. Where the layer's output stays a ``DTensor`` along the
  sequence (``transformers``' decoders under sequence parallelism), ``lora_B`` runs on that
  ``DTensor``: its parameters replicated ``DTensor`` s, like a sequence-parallel norm's.

Other splits of a layer with an adapter (an embedding over the vocabulary) are refused by name.
"""
from __future__ import annotations

from torch import nn

from ..core.adapters import is_lora_layer
from .tensor import Split, TensorParallelError


def base_model(model: nn.Module) -> nn.Module:
    """The model a plan names: PEFT's wrapped model (``get_base_model()``), else ``model``."""
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def expand_adapters(model: nn.Module, resolved: dict[str, Split]) -> dict[str, Split]:
    """``resolved`` (module name -> split) with every LoRA layer replaced by its base layer and its
    adapters' matrices, split as the module docstring says."""
    modules = dict(model.named_modules())
    out: dict[str, Split] = {}
    for name, split in resolved.items():
        module = modules[name]
        if not is_lora_layer(module):
            out[name] = split
            continue
        out[f"{name}.base_layer"] = split
        for adapter in module.lora_A:
            a, b = f"{name}.lora_A.{adapter}", f"{name}.lora_B.{adapter}"
            if split.kind in Split.COLUMN:
                out[b] = split
                if split.sequence:  # its input may arrive as a DTensor along the sequence
                    out[a] = Split("sequence_norm", sequence=True)
            elif split.kind == "row":
                out[a] = split
                if split.dtensor_output:
                    out[b] = Split("sequence_norm", sequence=True)
            else:
                raise TensorParallelError(
                    f"{name}: a LoRA adapter on a layer split as {split.kind!r} is not implemented (zerodp splits "
                    "adapters on column and row splits); leave this layer out of the adapter's target_modules")
    return out
