"""PEFT's LoRA adapters where ``initialize`` gives the values: a model built on the meta device
(``zero.Init(meta=True)``) has no values to keep, so each unit is initialized by its modules'
``reset_parameters()`` (``gather.initialize_meta_units``). For a LoRA layer's ``lora_A`` and
``lora_B`` that is ``nn.Linear``'s initialization, which leaves ``lora_B`` nonzero: training would
start from a model the adapters already perturb, without a word. :func:`lora_initializer` gives
``initialize`` what runs after a unit's modules, PEFT's own initialization of each adapter
(``init_lora_weights`` of its config: ``lora_B`` zero), seeded as the rest of the unit."""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer: the original layer as ``base_layer``, adapters in ``lora_A``/``lora_B``."""
    return (hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def lora_initializer(model: nn.Module) -> Optional[Callable[[nn.Module, set], None]]:
    """For a PEFT model (``peft_config``), a function ``(unit module, ids of the parameters given
    values there)`` that initializes each LoRA adapter among them as PEFT does; None otherwise."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None

    def initialize(module: nn.Module, materialized: set) -> None:
        for name, layer in module.named_modules():
            if not is_lora_layer(layer):
                continue
            for adapter in layer.lora_A:
                own = [*layer.lora_A[adapter].parameters(), *layer.lora_B[adapter].parameters()]
                if not any(id(p) in materialized for p in own):
                    continue
                how = getattr(configs.get(adapter), "init_lora_weights", True)
                if how is False:  # PEFT keeps the layers' own initialization, as reset_parameters gave
                    continue
                if how is not True and not (isinstance(how, str) and how.lower() == "gaussian"):
                    raise ValueError(
                        f"{name}: LoRA adapter {adapter!r} with init_lora_weights={how!r} on a model built on "
                        "the meta device: that initialization reads the base weights, which have no values "
                        "until initialize; use True or 'gaussian', or build the model with values "
                        "(zero.Init() without meta, or from_pretrained) before get_peft_model")
                layer.reset_lora_parameters(adapter, how)

    return initialize
