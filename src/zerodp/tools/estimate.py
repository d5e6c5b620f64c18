"""Per-rank memory estimates for ZeRO training: ``zerodp estimate`` and ``zerodp.estimate``.

Given a model (a parameter count such as ``7.5B``, a factory ``module:function`` or a
``transformers`` config, both built on the meta device), the number of ranks, the precision
and the optimizer, :func:`estimate` computes the model-state memory every rank holds at each
ZeRO stage, with and without offload, adds the buffers zerodp allocates on top (gradient
buckets, stage-3 gathered parameters) and, for known transformer shapes, activations; it then
says which configurations fit and recommends the fastest one that does.

Three accountings (bytes per parameter element; Ψ parameters, N ranks):

* ``mixed`` (the ZeRO paper's): 16-bit parameters 2, 16-bit gradients 2, and K bytes of
  optimizer state: an fp32 master copy 4 plus the fp32 optimizer states (Adam: m 4 + v 4,
  K = 12). Stage 0 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N.
* ``no-master``: 16-bit parameters and gradients and fp32 optimizer states, no fp32 master
  copy (Adam: 12Ψ at stage 0).
* ``fp32``: parameters 4, gradients 4, optimizer states 4 per state value; the parameters
  are the master weights.

``memory_check.compare_with_engine`` sets the estimate for a live engine beside the engine's
own ledger (``engine.memory_breakdown()``); they agree up to the padding of flat groups.
"""
from __future__ import annotations

import importlib
import json
import re
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from ..config import ZeroConfig
from ..core.reduce import MAX_BUCKETS_IN_FLIGHT
from ..core.gather import plan_units
from ..core.flat import ALIGN_BYTES

__all__ = ["estimate", "Estimate", "Row", "ModelInfo", "TransformerShape", "Accounting",
           "OptimizerSpec", "Activations", "EstimateError", "OPTIMIZERS",
           "PRECISIONS", "ACCOUNTINGS", "parse_count", "parse_memory", "describe_model"]

GB = 10**9
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}
ACCOUNTINGS = ("mixed", "no-master", "fp32")
FP32 = 4

_ZERO_DEFAULTS = ZeroConfig.model_fields
DEFAULT_REDUCE_BUCKET = int(_ZERO_DEFAULTS["reduce_bucket_size"].default)
DEFAULT_MAX_LIVE = int(_ZERO_DEFAULTS["stage3_max_live_parameters"].default)
DEFAULT_PERSISTENCE = int(_ZERO_DEFAULTS["stage3_param_persistence_threshold"].default)


class EstimateError(ValueError):
    """Input the estimator cannot use. ``name`` is the input (an argument of :func:`estimate`,
    e.g. ``device_memory``); the message says what was wrong and what is allowed."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name, self.detail = name, message


# -- inputs -----------------------------------------------------------------------------------

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_MEMORY_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_NUMBER = r"((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"


def _scaled(number: str, multiplier: int) -> Optional[int]:
    """``number * multiplier`` if it is a whole number, else None (exact decimal arithmetic)."""
    try:
        value = Decimal(number) * multiplier
    except InvalidOperation:
        return None
    if value.adjusted() > 30:  # far beyond any real model or memory; int() of it could be huge
        return None
    return int(value) if value == value.to_integral_value() else None


def parse_count(text: str, name: str = "model") -> int:
    """A parameter count: ``8B``, ``7.5B``, ``350M``, ``125K``, ``1.2T``, ``5e8`` or a plain
    integer (K = 1e3, M = 1e6, B = G = 1e9, T = 1e12)."""
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([KMBGT]?)\s*", str(text), re.IGNORECASE)
    value = _scaled(m.group(1), _COUNT_SUFFIX[m.group(2).upper()]) if m else None
    if value is None or value <= 0:
        raise EstimateError(name, f"{text!r} is not a count; allowed: a positive whole number, "
                                  "optionally with K, M, B or T (e.g. 8B, 7.5B, 350M, 125K, 5e8)")
    return value


def parse_memory(text: Union[str, int], name: str = "device_memory") -> int:
    """Bytes from ``80GB``, ``24GiB``, ``512MB``, ... (KB/MB/GB/TB are powers of 1000,
    KiB/MiB/GiB/TiB powers of 1024); an int is taken as bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text > 0:
            return text
        raise EstimateError(name, f"{text} bytes; allowed: a positive size")
    m = re.fullmatch(r"\s*" + _NUMBER + r"\s*([KMGT]I?B|B)\s*", str(text), re.IGNORECASE)
    value = _scaled(m.group(1), _MEMORY_UNITS[m.group(2).upper()]) if m else None
    if value is None or value <= 0:
        raise EstimateError(name, f"{text!r} is not a memory size; allowed: a positive number with "
                            "a unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB "
                            "(powers of 1024), e.g. 80GB or 24GiB")
    return value


def _positive_int(value: Any, name: str) -> int:
    """A positive whole number from an int or a string of digits."""
    if isinstance(value, str) and re.fullmatch(r"\s*\+?\d+\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EstimateError(name, f"{value!r}; allowed: a positive whole number")
    return value


def _element_count(value: Any, name: str) -> int:
    """A positive number of elements: an int, or a string such as ``5e8`` or ``500M``."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    try:
        return parse_count(str(value), name)
    except EstimateError:
        raise EstimateError(name, f"{value!r}; allowed: a positive whole number of elements "
                            "(e.g. 500000000, 5e8 or 500M)") from None


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer's persistent state: ``states`` values per parameter element."""

    name: str
    states: int
    what: str


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw": OptimizerSpec("AdamW", 2, "m, v"),
    "adam": OptimizerSpec("Adam", 2, "m, v"),
    "amsgrad": OptimizerSpec("Adam/AdamW with amsgrad", 3, "m, v, max v"),
    "adamax": OptimizerSpec("Adamax", 2, "m, infinity norm"),
    "nadam": OptimizerSpec("NAdam", 2, "m, v"),
    "radam": OptimizerSpec("RAdam", 2, "m, v"),
    "adadelta": OptimizerSpec("Adadelta", 2, "square average, delta"),
    "lion": OptimizerSpec("Lion", 1, "momentum"),
    "adagrad": OptimizerSpec("Adagrad", 1, "sum of squares"),
    "rmsprop": OptimizerSpec("RMSprop", 1, "square average"),
    "sgd-momentum": OptimizerSpec("SGD with momentum", 1, "momentum buffer"),
    "sgd": OptimizerSpec("SGD without momentum", 0, "none"),
}


def _optimizer(name: Union[str, OptimizerSpec]) -> OptimizerSpec:
    if isinstance(name, OptimizerSpec):
        return name
    key = str(name).strip().lower().replace("_", "-")
    if key not in OPTIMIZERS:
        raise EstimateError("optimizer", f"{name!r} is unknown; allowed: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[key]


@dataclass(frozen=True)
class Accounting:
    """Bytes per parameter element of each kind of model state."""

    name: str
    params: int
    grads: int
    master: int
    states: int

    @property
    def k(self) -> int:
        """The ZeRO paper's K: bytes of optimizer state (master copy included) per parameter."""
        return self.master + self.states

    def describe(self, optimizer: OptimizerSpec) -> str:
        opt = f"{optimizer.name} {optimizer.what}" if optimizer.states else optimizer.name
        kinds = {"mixed": "mixed precision, the ZeRO paper's accounting",
                 "no-master": "16-bit parameters and gradients, fp32 optimizer states, no fp32 master copy",
                 "fp32": "fp32 training; the parameters are the master weights"}[self.name]
        parts = [f"params {self.params}", f"grads {self.grads}"]
        parts += [f"fp32 master {self.master}"] if self.master else []
        parts += [f"optimizer states {self.states} ({opt})"]
        return f"{self.name} ({kinds}): bytes per parameter: {' + '.join(parts)}; K = {self.k}"

    def formulas(self) -> str:
        """The per-rank model-state bytes of each stage, as formulas in Ψ and N."""
        full, p = self.params + self.grads + self.k, self.params
        return (f"stage 0 {full}Ψ, stage 1 {p + self.grads}Ψ + {self.k}Ψ/N, "
                f"stage 2 {p}Ψ + {self.grads + self.k}Ψ/N, stage 3 {full}Ψ/N")


def make_accounting(precision: str, optimizer: OptimizerSpec, name: Optional[str] = None) -> Accounting:
    """The accounting ``name`` (default: ``mixed`` for 16-bit precision, ``fp32`` for fp32)."""
    if precision not in PRECISIONS:
        raise EstimateError("precision", f"{precision!r}; allowed: {', '.join(PRECISIONS)}")
    name = name or ("fp32" if precision == "fp32" else "mixed")
    if name not in ACCOUNTINGS:
        raise EstimateError("accounting", f"{name!r}; allowed: {', '.join(ACCOUNTINGS)}")
    if (name == "fp32") != (precision == "fp32"):
        allowed = "fp32" if precision == "fp32" else "mixed or no-master"
        raise EstimateError("accounting", f"{name} does not go with precision {precision}; "
                                          f"allowed for {precision}: {allowed}")
    p = PRECISIONS[precision]
    master = FP32 if name == "mixed" else 0
    return Accounting(name, params=p, grads=p, master=master, states=FP32 * optimizer.states)


# -- the model --------------------------------------------------------------------------------

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
    ``zerodp.fetch.plan_units`` with the default ``stage3_param_persistence_threshold``."""

    description: str
    source: str  # "count", "factory", "transformers" or "module"
    params: int
    trainable_params: int
    largest_param: Optional[int] = None
    root_unit: Optional[int] = None
    largest_unit: Optional[int] = None
    transformer: Optional[TransformerShape] = None


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
    return ModelInfo(
        description=description, source=source,
        params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        largest_param=max((p.numel() for p in params), default=0),
        root_unit=units.get(0, 0),
        largest_unit=max((n for u, n in units.items() if u != 0), default=0),
        transformer=transformer_shape(config) if config is not None else None)


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


# -- activations ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Activations:
    """Activation memory of one micro-batch on one rank (``bytes`` None: not estimated)."""

    bytes: Optional[int]
    micro_batch: Optional[int] = None
    seq_len: Optional[int] = None
    checkpointing: bool = False
    per_layer: Optional[int] = None
    logits: Optional[int] = None
    formula: str = ""
    note: str = ""


ACTIVATION_FORMULA = (
    "Korthikanti et al. (2022): per layer s·b·h·(34 + 5·a·s/h) bytes in 16-bit, written "
    "s·b·(18·h + 4·f) + 5·a·s²·b for MLP width f (f = 4h gives 34); x2 in fp32; plus logits "
    "s·b·V·(p + 4) (logits and their fp32 copy for the loss)")
ACTIVATION_ASSUMPTIONS = (
    "assumes no tensor or sequence parallelism and a GPT-style MLP; counts the a·s² attention "
    "scores, which fused attention (scaled_dot_product_attention, flash) never stores, so it is "
    "an upper bound for such models")


def layer_activation_bytes(shape: TransformerShape, micro_batch: int, seq_len: int, p: int) -> int:
    """One layer's activations kept for backward (Korthikanti et al.), in ``p``-byte precision."""
    b, s = micro_batch, seq_len
    # attention 11·s·b·h + 5·a·s²·b, two LayerNorms 4·s·b·h, MLP s·b·(3·h + 4·f)
    sixteen_bit = s * b * (18 * shape.hidden + 4 * shape.ffn) + 5 * shape.heads * s * s * b
    return sixteen_bit * p // 2


def estimate_activations(model: ModelInfo, precision: str, micro_batch: Optional[int],
                         seq_len: Optional[int], checkpointing: bool) -> Activations:
    """Activations for a known transformer; for other models a reason why not."""
    shape = model.transformer
    if shape is None:
        why = ("a bare parameter count has no layer shapes" if model.source == "count" else
               "the model has no transformer config (layers, hidden size, heads, vocabulary)")
        return Activations(None, micro_batch, seq_len, checkpointing,
                           note=f"not estimated: {why}")
    b = micro_batch or 1
    s = seq_len or shape.context
    if s is None:
        raise EstimateError("seq_len", "the model config gives no context length; give one")
    p = PRECISIONS[precision]
    layer = layer_activation_bytes(shape, b, s, p)
    logits = s * b * shape.vocab * (p + FP32)
    if checkpointing:
        kept = shape.layers * s * b * shape.hidden * p + layer
        how = "with activation checkpointing: each layer's input (s·b·h·p) plus one layer recomputed"
    else:
        kept = shape.layers * layer
        how = "no activation checkpointing"
    where = []
    if micro_batch is None:
        where.append("micro-batch 1 (default)")
    if seq_len is None:
        where.append(f"sequence {s} (the model's context length)")
    note = f"{how}; {ACTIVATION_ASSUMPTIONS}" + (f"; {', '.join(where)}" if where else "")
    return Activations(kept + logits, b, s, checkpointing, layer, logits, ACTIVATION_FORMULA, note)


# -- rows -------------------------------------------------------------------------------------

ROW_KEYS = [(0, "none"), (0, "optimizer"), (1, "none"), (1, "optimizer"), (2, "none"),
            (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params")]
#: Fastest first: lower stages communicate less; offload runs the optimizer on the CPU.
RECOMMENDATION_ORDER = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "optimizer"),
                        (3, "optimizer"), (3, "optimizer+params")]


def _share(bytes_per_element: int, elements: int, ranks: int) -> int:
    """Bytes of ``elements`` split over ``ranks`` (rounded up to whole bytes)."""
    return -(-bytes_per_element * elements // ranks)


@dataclass(frozen=True)
class Row:
    """One configuration's memory per rank, in bytes. Device columns: ``parameters``,
    ``gradients``, ``master_weights``, ``optimizer_states`` (model states), then
    ``gradient_buckets``, ``gathered_parameters`` and ``activations`` (None: unknown).
    ``cpu`` is what offload keeps in CPU memory per rank, ``cpu_per_node`` for all ranks of a
    node. ``fits`` is None when no device memory was given."""

    stage: int
    offload: str
    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    gradient_buckets: int
    gathered_parameters: int
    activations: Optional[int]
    cpu: int
    cpu_per_node: int
    fits_device: Optional[bool] = None
    fits_cpu: Optional[bool] = None

    @property
    def label(self) -> str:
        extra = {"none": "", "optimizer": " + offload opt",
                 "optimizer+params": " + offload opt+params"}[self.offload]
        return f"stage {self.stage}{extra}"

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states

    @property
    def buffers(self) -> int:
        return self.gradient_buckets + self.gathered_parameters

    @property
    def device_total(self) -> int:
        return self.model_states + self.buffers + (self.activations or 0)

    @property
    def fits(self) -> Optional[bool]:
        if self.fits_device is None:
            return None
        return self.fits_device and self.fits_cpu is not False

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(label=self.label, model_states=self.model_states, buffers=self.buffers,
                   device_total=self.device_total, fits=self.fits)
        return out


@dataclass(frozen=True)
class Buffers:
    """Temporary buffers on top of model states, per rank, with how they were sized."""

    buckets_stage2: int
    buckets_stage3: int
    bucket_note: str
    gathered: int
    gathered_note: str

    def gradient_buckets(self, stage: int) -> int:
        return {2: self.buckets_stage2, 3: self.buckets_stage3}.get(stage, 0)


def estimate_buffers(model: ModelInfo, p: int, reduce_bucket_size: int,
                     max_live_parameters: int) -> Buffers:
    """Gradient buckets (stages 2-3) and stage-3 gathered parameters, per rank, in bytes.

    Flat groups hold at most ``reduce_bucket_size`` elements (a larger parameter gets one of
    its own); backward fills a full-size bucket per group and keeps at most
    ``MAX_BUCKETS_IN_FLIGHT`` of them in flight. Stage 2 reduces a group as soon as it is
    complete, so one more bucket is filling; stage 3 reduces a unit's groups when backward
    has gone through the unit, so all buckets of the unit are filling, and the root unit's
    until the end of backward. Stage 3 keeps gathered at most ``stage3_max_live_parameters``
    elements through prefetching and reuse, plus the unit being computed, never more than
    the whole model.
    """
    trained = model.trainable_params
    group = min(trained, max(reduce_bucket_size, model.largest_param or 0))
    stage2 = min(trained, (MAX_BUCKETS_IN_FLIGHT + 1) * group)
    bucket_note = (f"stage 2: {_num(stage2)} elements x {p} bytes: {MAX_BUCKETS_IN_FLIGHT} "
                   f"flat-group buckets in flight + 1 filling, each up to {_num(group)} elements "
                   f"(reduce_bucket_size {_num(reduce_bucket_size)})")
    if model.largest_unit is None:
        stage3 = stage2
        bucket_note += "; stage 3 the same (unit sizes are unknown for a bare parameter count)"
    else:
        filling = (model.largest_unit or 0) + (model.root_unit or 0)
        stage3 = min(trained, MAX_BUCKETS_IN_FLIGHT * group + filling)
        bucket_note += (f"; stage 3: {_num(stage3)} elements: {MAX_BUCKETS_IN_FLIGHT} in flight + "
                        "the largest unit's and the root unit's buckets filling")
    bucket_note += "; never more than the trainable parameters"
    if model.largest_unit is None:
        gathered = min(model.params, max_live_parameters)
        how = "plus the unit being computed (unit sizes are unknown for a bare parameter count)"
    else:
        live = max(model.root_unit or 0, max_live_parameters)
        gathered = min(model.params, live + model.largest_unit)
        how = (f"plus the unit being computed (the largest has {_num(model.largest_unit)} elements; "
               f"the root unit, gathered throughout, {_num(model.root_unit or 0)})")
    gathered_note = (f"{_num(gathered)} elements x {p} bytes: up to stage3_max_live_parameters "
                     f"{_num(max_live_parameters)} stay gathered (prefetch, reuse), {how}; "
                     "never more than the whole model")
    return Buffers(stage2 * p, stage3 * p, bucket_note, gathered * p, gathered_note)


def estimate_row(acc: Accounting, model: ModelInfo, stage: int, offload: str, n: int,
                 ranks_per_node: int, buffers: Buffers, activations: Optional[int]) -> Row:
    """Per-rank memory of ``stage`` with ``offload`` ("none", "optimizer", "optimizer+params").

    Without offload: parameters sharded at stage 3, gradients from stage 2, master weights and
    optimizer states from stage 1. With optimizer offload, the device keeps only the 16-bit
    parameters and gradients (or their shards); the CPU holds, for this rank's optimizer
    partition, the weights it updates (the fp32 master, or the parameters without one) and the
    optimizer states (the gradient shard comes to the CPU a tile at a time, through transfer
    buffers of at most ``sub_group_size`` elements, not counted here). Parameter offload (stage
    3) moves the parameter shard to the CPU too.
    """
    psi, trained = model.params, model.trainable_params
    opt_ranks = n if stage >= 1 else 1
    params = _share(acc.params, psi, n if stage == 3 else 1)
    grads = _share(acc.grads, trained, n if stage >= 2 else 1)
    master = _share(acc.master, trained, opt_ranks)
    states = _share(acc.states, trained, opt_ranks)
    cpu = 0
    if offload != "none":
        weights = FP32 if acc.master else acc.params  # what the CPU optimizer updates
        cpu = _share(weights + acc.states, trained, opt_ranks)
        master = states = 0
    if offload == "optimizer+params":
        cpu += params
        params = 0
    return Row(stage, offload, params, grads, master, states,
               gradient_buckets=buffers.gradient_buckets(stage),
               gathered_parameters=buffers.gathered if stage == 3 else 0,
               activations=activations, cpu=cpu, cpu_per_node=cpu * ranks_per_node)


def _with_fit(row: Row, device_memory: Optional[int], cpu_memory: Optional[int]) -> Row:
    fits_device = None if device_memory is None else row.device_total <= device_memory
    fits_cpu = None if cpu_memory is None or row.offload == "none" else row.cpu_per_node <= cpu_memory
    return Row(**{**asdict(row), "fits_device": fits_device, "fits_cpu": fits_cpu})


# -- the result -------------------------------------------------------------------------------

@dataclass
class Estimate:
    """Everything ``zerodp estimate`` prints; :meth:`to_dict` for JSON, :meth:`format` for text."""

    model: ModelInfo
    nodes: int
    ranks_per_node: int
    precision: str
    optimizer: OptimizerSpec
    accounting: Accounting
    device_memory: Optional[int]
    cpu_memory: Optional[int]
    buffers: Buffers
    activations: Activations
    rows: list[Row]
    recommendation: Optional[Row]
    reason: str
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def row(self, stage: int, offload: str = "none") -> Row:
        """The row of ``stage`` with ``offload``."""
        return next(r for r in self.rows if (r.stage, r.offload) == (stage, offload))

    def to_dict(self) -> dict:
        rec = self.recommendation
        return {
            "model": asdict(self.model),
            "nodes": self.nodes, "ranks_per_node": self.ranks_per_node, "world_size": self.world_size,
            "precision": self.precision,
            "optimizer": asdict(self.optimizer),
            "accounting": {**asdict(self.accounting), "k": self.accounting.k,
                           "description": self.accounting.describe(self.optimizer),
                           "formulas": self.accounting.formulas()},
            "device_memory": self.device_memory, "cpu_memory_per_node": self.cpu_memory,
            "units": "bytes per rank unless named per node",
            "buffers": asdict(self.buffers),
            "activations": asdict(self.activations),
            "rows": [r.to_dict() for r in self.rows],
            "recommendation": None if rec is None else {"stage": rec.stage, "offload": rec.offload,
                                                        "label": rec.label},
            "reason": self.reason,
            "notes": self.notes,
        }

    def format(self) -> str:
        """The human-readable report."""
        return format_estimate(self)


def _recommend(rows: list[Row], device_memory: Optional[int], cpu_memory: Optional[int],
               activations: Activations) -> tuple[Optional[Row], str]:
    """The fastest configuration that fits, and a one-line reason."""
    if device_memory is None:
        return None, "no device memory given: pass it to check which configurations fit"
    by_key = {(r.stage, r.offload): r for r in rows}
    act = ("activations included" if activations.bytes is not None
           else "activations not included")
    for key in RECOMMENDATION_ORDER:
        row = by_key[key]
        if row.fits:
            return row, _reason(row, by_key, device_memory, act)
    last = by_key[RECOMMENDATION_ORDER[-1]]
    if last.fits_device:
        return None, (f"nothing fits: the device side fits only with offload, and the CPU side "
                      f"needs {_gb(last.cpu_per_node)} per node even at {last.label} "
                      f"(> {_gb(cpu_memory)} CPU memory); use more nodes or more CPU memory")
    return None, (f"nothing fits: even {last.label} needs {_gb(last.device_total)} per device "
                  f"(> {_gb(device_memory)}; {act}); use more ranks, a smaller micro-batch or "
                  "sequence, activation checkpointing, or smaller reduce_bucket_size / "
                  "stage3_max_live_parameters")


def _reason(row: Row, by_key: dict, device_memory: int, act: str) -> str:
    need = f"{_gb(row.device_total)} of {_gb(device_memory)} per device, {act}"
    if row.offload == "none":
        if row.stage == 0:
            return f"plain data parallelism fits ({need}); it communicates least"
        below = by_key[(row.stage - 1, "none")]
        return (f"the lowest stage that fits ({need}); stage {below.stage} needs "
                f"{_gb(below.device_total)}, and lower stages communicate less")
    cpu = (f"{_gb(row.cpu_per_node)} CPU memory per node" +
           ("" if row.fits_cpu is not None else ", not checked: no CPU memory given"))
    return (f"no stage fits on the device alone (stage 3 needs "
            f"{_gb(by_key[(3, 'none')].device_total)}); the fastest offload that fits ({need}; "
            f"{cpu}); offload runs the optimizer step on the CPU and is often 2-3x slower")


def estimate(model: Union[str, int, nn.Module, ModelInfo], *, nodes: int = 1, ranks_per_node: int = 1,
             device_memory: Union[None, str, int] = None, cpu_memory: Union[None, str, int] = None,
             precision: str = "bf16", optimizer: Union[str, OptimizerSpec] = "adamw",
             accounting: Optional[str] = None, micro_batch: Optional[int] = None,
             seq_len: Optional[int] = None, checkpointing: bool = False,
             model_kwargs: Union[None, str, dict] = None,
             reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET,
             max_live_parameters: int = DEFAULT_MAX_LIVE) -> Estimate:
    """Per-rank memory of ZeRO stages 0-3, with and without offload, and a recommendation.

    ``model``: a parameter count (``"7.5B"`` or an int), a path to a ``transformers`` config
    (``config.json`` or its directory), a factory ``"module:function"`` (called with
    ``model_kwargs``, a dict or JSON object, on the meta device), or a module. ``device_memory``
    and ``cpu_memory`` (per node) are sizes such as ``"80GB"``/``"24GiB"`` or bytes.
    ``accounting``: ``"mixed"`` (default for bf16/fp16), ``"no-master"``, or ``"fp32"``
    (the only one for fp32). Raises :class:`EstimateError` for input it cannot use.
    """
    nodes = _positive_int(nodes, "nodes")
    ranks_per_node = _positive_int(ranks_per_node, "ranks_per_node")
    micro_batch = None if micro_batch is None else _positive_int(micro_batch, "micro_batch")
    seq_len = None if seq_len is None else _positive_int(seq_len, "seq_len")
    reduce_bucket_size = _element_count(reduce_bucket_size, "reduce_bucket_size")
    max_live_parameters = _element_count(max_live_parameters, "max_live_parameters")
    device = None if device_memory is None else parse_memory(device_memory, "device_memory")
    cpu = None if cpu_memory is None else parse_memory(cpu_memory, "cpu_memory")
    spec = _optimizer(optimizer)
    acc = make_accounting(precision, spec, accounting)
    info = resolve_model(model, model_kwargs)
    n = nodes * ranks_per_node
    acts = estimate_activations(info, precision, micro_batch, seq_len, checkpointing)
    buffers = estimate_buffers(info, acc.params, reduce_bucket_size, max_live_parameters)
    rows = [_with_fit(estimate_row(acc, info, stage, off, n, ranks_per_node, buffers, acts.bytes),
                      device, cpu) for stage, off in ROW_KEYS]
    rec, reason = _recommend(rows, device, cpu, acts)
    notes = [acts.note] if acts.bytes is None else []
    notes.append("stage 0 with offload is shown for comparison only (zerodp offloads from stage 1; "
                 "stage 2 with offload keeps less on the device for the same CPU memory, so it is "
                 "recommended instead of stages 0-1)")
    notes.append("offload to disk (device \"nvme\") keeps the CPU column in files instead, with at most "
                 "three tiles of sub_group_size elements of it in CPU memory at once")
    notes.append(f"padding: each flat group is padded to N shards of a multiple of {ALIGN_BYTES} "
                 f"bytes, under {ALIGN_BYTES} bytes per shard per group")
    return Estimate(info, nodes, ranks_per_node, precision, spec, acc, device, cpu, buffers, acts,
                    rows, rec, reason, notes)


# -- text -------------------------------------------------------------------------------------

def _num(n: int) -> str:
    return f"{n:,}"


def _gb(b: Optional[int]) -> str:
    """Bytes in GB (1e9) with one decimal, or in MB, KB or bytes when below 0.1 GB."""
    if b is None:
        return "?"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if b >= size // 10:
            return f"{b / size:.1f} {unit}"
    return f"{b} bytes"


def _unit_for(largest: int) -> tuple[str, int]:
    for name, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if largest >= size:
            return name, size
    return "B", 1


def _fits_text(row: Row) -> str:
    if row.fits_device is None:
        return "?"
    if not row.fits_device:
        return "no"
    if row.fits_cpu is False:
        return "no (CPU)"
    return "yes (CPU unchecked)" if row.offload != "none" and row.fits_cpu is None else "yes"


def _table(est: Estimate) -> list[str]:
    unit, size = _unit_for(est.row(0).model_states)  # the largest model states set the unit

    def cell(b: Optional[int]) -> str:
        if b is None:
            return "-"
        return f"{b / size:.1f}" if size > 1 else str(b)

    head = ["configuration", "params", "grads", "master", "optim", "states", "buffers",
            "activ", "device", "CPU/node", "fits"]
    lines = [[r.label, cell(r.parameters), cell(r.gradients), cell(r.master_weights),
              cell(r.optimizer_states), cell(r.model_states), cell(r.buffers), cell(r.activations),
              cell(r.device_total), cell(r.cpu_per_node) if r.offload != "none" else "-",
              _fits_text(r)] for r in est.rows]
    widths = [max(len(x[i]) for x in [head] + lines) for i in range(len(head))]

    def fmt(cols: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in (0, len(cols) - 1) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cols, widths))).rstrip()
    legend = (f"{unit} per rank ({unit} = {size:,} bytes); states = params + grads + master + "
              "optim (optimizer states); device = states + buffers + activ (activations); "
              "CPU/node = offloaded states of all ranks of a node")
    return [legend, fmt(head)] + [fmt(x) for x in lines]


_SOURCES = {"count": "a parameter count", "factory": "a factory, built on the meta device",
            "transformers": "a transformers config, built on the meta device", "module": "a module"}


def format_estimate(est: Estimate) -> str:
    """The report ``zerodp estimate`` prints."""
    m, acc = est.model, est.accounting
    device = _gb(est.device_memory) if est.device_memory else "not given"
    cpu = _gb(est.cpu_memory) if est.cpu_memory else "not given"
    trained = "" if m.trainable_params == m.params else f", {_num(m.trainable_params)} trainable"
    lines = [
        f"model: {m.description} ({_SOURCES[m.source]}): {_num(m.params)} parameters{trained}",
        f"ranks: {est.nodes} node(s) x {est.ranks_per_node} = {est.world_size}; precision "
        f"{est.precision}; optimizer {est.optimizer.name}; device memory {device}; "
        f"CPU memory per node {cpu}",
        f"accounting: {acc.describe(est.optimizer)}",
        f"  model states per rank: {acc.formulas()} (Ψ parameters, N = {est.world_size} ranks)",
        "",
        *_table(est),
        "",
        "buffers (stages 2-3, in 'buffers' above):",
        f"  gradient buckets: stage 2 {_gb(est.buffers.buckets_stage2)}, stage 3 "
        f"{_gb(est.buffers.buckets_stage3)}: {est.buffers.bucket_note}",
        f"  gathered parameters (stage 3): {_gb(est.buffers.gathered)} = {est.buffers.gathered_note}",
    ]
    a = est.activations
    if a.bytes is None:
        lines.append(f"activations: {a.note}; 'fits' counts model states and buffers only")
    else:
        lines += [f"activations: {_gb(a.bytes)} per rank (micro-batch {a.micro_batch}, sequence "
                  f"{a.seq_len}; per layer {_gb(a.per_layer)}, logits {_gb(a.logits)}), included in 'fits'",
                  f"  formula: {a.formula}", f"  {a.note}"]
    lines += [f"note: {n}" for n in est.notes if n != a.note]
    label = est.recommendation.label if est.recommendation else "none"
    lines.append(f"recommendation: {label}: {est.reason}")
    return "\n".join(lines)
