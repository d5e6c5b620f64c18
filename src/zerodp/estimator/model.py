"""The model as the estimator sees it: parameters counted from a count, a module, a factory
``module:function`` or a ``transformers`` config (both built on the meta device), its stage-3
units, and the transformer shape activations depend on."""
from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from ..core.gather import plan_units
from .inputs import DEFAULT_PERSISTENCE, EstimateError, parse_count


@dataclass(frozen=True)
class TransformerShape:
    """What activation memory depends on: layers, hidden size, heads, vocabulary, MLP width
    and the context length the model was built for."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int
    context: Optional[int] = None


@dataclass(frozen=True)
class ModelInfo:
    """A model as the estimator sees it. Unit sizes are stage 3's, planned by
    ``zerodp.core.gather.plan_units`` with the default ``stage3_param_persistence_threshold``."""

    description: str
    source: str  # "count", "factory", "transformers" or "module"
    params: int
    trainable_params: int
    largest_param: Optional[int] = None
    root_unit: Optional[int] = None
    largest_unit: Optional[int] = None
    transformer: Optional[TransformerShape] = None
    split_params: Optional[int] = None
    """Elements of the parameters the model's tensor-parallel plan splits (None: no plan known)."""
    split_trainable: Optional[int] = None
    expert_params: Optional[int] = None
    """Elements of the mixture-of-experts layers' experts (None: the model has none, or unknown)."""
    moe_layers: int = 0
    """Mixture-of-experts layers (their experts modules)."""
    top_k: Optional[int] = None
    """Experts each token goes to (the model config's ``num_experts_per_tok``)."""
    num_experts: Optional[int] = None

    def stage(self, pp: int) -> "ModelInfo":
        """One pipeline stage of ``pp``: 1/pp of the parameters (an even split), its units as they were."""
        if pp == 1:
            return self
        share = lambda n: None if n is None else -(-n // pp)  # noqa: E731
        return replace(self, description=f"{self.description}, 1/{pp} pipeline stage",
                       params=share(self.params), trainable_params=share(self.trainable_params),
                       split_params=share(self.split_params), split_trainable=share(self.split_trainable))

    def local(self, tp: int) -> "ModelInfo":
        """What one tensor-parallel rank of ``tp`` holds: split parameters 1/tp, the rest whole
        (every parameter split when the plan is not known: a bare count). Unit sizes and the
        largest parameter shrink in the same proportion."""
        if tp == 1:
            return self
        split = self.params if self.split_params is None else self.split_params
        split_trained = self.trainable_params if self.split_trainable is None else self.split_trainable
        params = self.params - split + -(-split // tp)
        ratio = params / max(self.params, 1)

        def scaled(n: Optional[int]) -> Optional[int]:
            return None if n is None else -(-int(n * ratio) // 1)
        return replace(self, description=f"{self.description}, 1/{tp} tensor-parallel slice",
                       params=params, trainable_params=self.trainable_params - split_trained
                       + -(-split_trained // tp), largest_param=scaled(self.largest_param),
                       root_unit=scaled(self.root_unit), largest_unit=scaled(self.largest_unit))


_SHAPE_NAMES = {"layers": ("num_hidden_layers", "n_layer", "num_layers"),
                "hidden": ("hidden_size", "n_embd", "d_model"),
                "heads": ("num_attention_heads", "n_head"),
                "vocab": ("vocab_size",),
                "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
                "context": ("max_position_embeddings", "n_positions", "block_size")}


def _config_int(config: Any, names: tuple[str, ...]) -> Optional[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def transformer_shape(config: Any) -> Optional[TransformerShape]:
    """The shape of a transformer from its config (a ``transformers`` config or zerodp's
    ``GPTConfig``), or None when the config lacks layers, hidden size, heads or vocabulary."""
    found = {key: _config_int(config, names) for key, names in _SHAPE_NAMES.items()}
    if None in (found["layers"], found["hidden"], found["heads"], found["vocab"]):
        return None
    found["ffn"] = found["ffn"] or 4 * found["hidden"]
    return TransformerShape(**found)


def describe_model(model: nn.Module, description: str = "module", source: str = "module",
                   persistence_threshold: int = DEFAULT_PERSISTENCE) -> ModelInfo:
    """Count a model's parameters (tied ones once) and plan its stage-3 units; works on the
    meta device, where nothing is allocated."""
    params = list(model.parameters())
    _, unit_of = plan_units(model, persistence_threshold)
    units: dict[int, int] = {}
    for p in params:
        units[unit_of[id(p)]] = units.get(unit_of[id(p)], 0) + p.numel()
    config = getattr(model, "config", None)
    split = _split(model)
    experts = _experts(model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelInfo(
        description=description, source=source,
        params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        largest_param=max((p.numel() for p in params), default=0),
        root_unit=units.get(0, 0),
        largest_unit=max((n for u, n in units.items() if u != 0), default=0),
        transformer=transformer_shape(config) if config is not None else None,
        split_params=None if split is None else sum(p.numel() for p in split),
        split_trainable=None if split is None else sum(p.numel() for p in split if p.requires_grad),
        expert_params=sum(p.numel() for m, _ in experts for p in m.parameters()) if experts else None,
        moe_layers=len(experts), top_k=_config_int(text, ("num_experts_per_tok", "top_k")) if experts else None,
        num_experts=experts[0][1] if experts else None)


def _experts(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """The modules holding a mixture-of-experts layer's experts, with how many: transformers 5's
    fused experts, or zerodp's ``ExpertParallelMoE`` expert dicts."""
    from ..parallel.expert import ExpertParallelMoE
    from ..parallel.expert_hf import fused_experts_modules
    found = [(m, m.num_experts) for m in fused_experts_modules(model)]
    found += [(m.experts, m.num_experts) for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    return found


def _split(model: nn.Module) -> Optional[list]:
    """The parameters the model's tensor-parallel plan would split, or None without a plan."""
    from ..parallel.plans import plan_for
    from ..parallel.tensor import TensorParallelError, split_parameters
    try:
        return split_parameters(model, plan_for(model))
    except TensorParallelError:
        return None


def _model_kwargs(kwargs: Union[None, str, dict]) -> dict:
    if kwargs is None or isinstance(kwargs, dict):
        return dict(kwargs or {})
    try:
        value = json.loads(kwargs)
    except json.JSONDecodeError as e:
        raise EstimateError("model_kwargs", f"{kwargs!r} is not valid JSON ({e.msg}); allowed: "
                                            'a JSON object, e.g. \'{"preset": "small"}\'') from None
    if not isinstance(value, dict):
        raise EstimateError("model_kwargs", f"{kwargs!r} is not a JSON object; allowed: "
                                            'a JSON object, e.g. \'{"preset": "small"}\'')
    return value


def _build_from_factory(spec: str, kwargs: dict) -> nn.Module:
    """Import ``module:function`` and call it with ``kwargs`` on the meta device."""
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EstimateError("model", f"cannot import {module_name!r} for factory {spec!r}: {e}") from None
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise EstimateError("model", f"{module_name} has no function {func_name!r} (factory {spec!r})")
    try:
        with torch.device("meta"):
            model = factory(**kwargs)
    except Exception as e:  # the factory is user code: report whatever it raised, in one line
        raise EstimateError("model", f"{spec}(**{kwargs}) failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise EstimateError("model", f"{spec} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _build_from_transformers_config(path: Path) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` on the meta device, from a local config.json."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise EstimateError("model", f"directory {str(path)!r} holds no config.json")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise EstimateError("model", "a transformers config needs the transformers package "
                            "(pip install transformers)") from None
    try:
        config = AutoConfig.from_pretrained(str(file))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers raises many kinds for a config it cannot use
        raise EstimateError("model", f"cannot build a causal LM from {str(file)!r}: "
                            f"{type(e).__name__}: {e}") from None


def resolve_model(model: Union[str, int, nn.Module, ModelInfo], model_kwargs=None) -> ModelInfo:
    """A :class:`ModelInfo` from a parameter count, a path to a transformers config (file or
    directory), a factory ``module:function``, or a module."""
    if isinstance(model, ModelInfo):
        return model
    if isinstance(model, nn.Module):
        return describe_model(model, type(model).__name__)
    if isinstance(model, int) and not isinstance(model, bool):
        model = str(model)
    text = str(model).strip()
    kwargs = _model_kwargs(model_kwargs)
    factory = re.fullmatch(r"[\w.]+:\w+", text) is not None and not Path(text).exists()
    if kwargs and not factory:
        raise EstimateError("model_kwargs", f"{kwargs} given for model {text!r}; allowed only "
                                            "with a factory model 'module:function'")
    if re.fullmatch(r"[\d.eE+-]+\s*[KMBGTkmbgt]?", text):
        count = parse_count(text)
        return ModelInfo(text, "count", count, count)
    if Path(text).exists():
        return describe_model(_build_from_transformers_config(Path(text)), text, "transformers")
    if factory:
        return describe_model(_build_from_factory(text, kwargs), text, "factory")
    raise EstimateError("model", f"{text!r} is neither a parameter count (e.g. 8B, 7.5B, 350M, 125K), "
                        "an existing transformers config (config.json or a directory holding one) "
                        "nor a factory 'module:function'")
