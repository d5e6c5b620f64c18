"""Loading a config: presets, JSON files and dicts merged and validated into a
:class:`Config`, validation errors turned into one line per key, and the batch sizes
resolved against the world size."""
from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Optional

from pydantic import ValidationError

from .schema import Config, ConfigError, _fmt

logger = logging.getLogger("zerodp")

__all__ = ["PRESETS", "load_config", "get_preset", "resolve_batch_sizes"]


def _preset(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000},
    }


def _offload_preset(stage: int) -> dict:
    """Stage 2 or 3 with the optimizer (and at stage 3 the parameters) in pinned host memory."""
    cfg = _preset(stage)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return cfg


PRESETS: dict[str, dict] = {**{f"zero{stage}": _preset(stage) for stage in range(4)},
                            "zero2_offload": _offload_preset(2), "zero3_offload": _offload_preset(3)}


def get_preset(name: str) -> dict:
    """A deep copy of ``PRESETS[name]``; raises :class:`ConfigError` for unknown names."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


_OPS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_ALLOWED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "a whole number",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false", "string_type": "a string",
    "dict_type": "a JSON object", "model_type": "a JSON object", "model_attributes_type": "a JSON object",
}


def _error_line(err: dict) -> str:
    path = ".".join(str(part) for part in err["loc"])
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "missing":
        return f"{path}: missing required key"
    if kind == "value_error" and "error" in ctx:
        detail = str(ctx["error"])
    elif kind == "literal_error":
        detail = "allowed: " + ctx["expected"].replace(" or ", ", ")
    elif kind in _OPS:
        detail = f"allowed: a number {_OPS[kind]} {next(iter(ctx.values()))}"
    else:
        detail = f"allowed: {_ALLOWED[kind]}" if kind in _ALLOWED else err["msg"]
    if not path:  # whole-config (model-level) problem: the input is the entire config
        return f"config: {detail}"
    return f"{path}: got {_fmt(err.get('input'))}; {detail}"


def _deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_json(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror or e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def _without_dotted_keys(data: dict) -> dict:
    """The config without top-level keys such as ``"zero_optimization.reduce_bucket_size"``,
    whose first part names a section: TRL writes them for its reference models, and DeepSpeed,
    which has no such keys, ignores them without a word. So does zerodp (logged at debug level)."""
    dotted = [k for k in data if isinstance(k, str) and "." in k and k.split(".")[0] in Config.model_fields]
    if not dotted:
        return data
    logger.debug("config: ignoring %s (dotted keys, as DeepSpeed ignores them)", ", ".join(dotted))
    return {k: v for k, v in data.items() if k not in dotted}


def load_config(config: dict | str | Path | Config | None = None, preset: str | None = None) -> Config:
    """Validate ``config`` (dict, JSON file path, :class:`Config` or None) into a :class:`Config`.

    With ``preset``, ``PRESETS[preset]`` is the base and ``config`` is deep-merged over it.
    Raises :class:`ConfigError` for unreadable files, unknown presets and schema errors.
    """
    if isinstance(config, Config) and preset is None:
        return config
    if config is None:
        data: dict = {}
    elif isinstance(config, Config):
        data = config.model_dump(exclude_unset=True)
    elif isinstance(config, (str, Path)):
        data = _read_json(Path(config))
    elif isinstance(config, dict):
        data = config
    else:
        raise ConfigError(f"config: got {type(config).__name__}; allowed: a dict, a JSON file path, a Config, None")
    if preset is not None:
        data = _deep_merge(get_preset(preset), data)
    data = _without_dotted_keys(data)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        lines = [_error_line(err) for err in e.errors()]
        message = lines[0] if len(lines) == 1 else f"{len(lines)} config errors:\n  " + "\n  ".join(lines)
        raise ConfigError(message) from None


def resolve_batch_sizes(cfg: Config, world_size: int,
                        deepspeed_ranks: Optional[int] = None) -> tuple[int, int, int]:
    """Resolve ``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``.

    Follows DeepSpeed's rule ``train_batch_size = micro * gas * world_size``, where ``world_size``
    is the number of data-parallel ranks (ranks that see different batches); ``"auto"`` and
    null count as not given, and missing values are derived (gas defaults to 1). As in
    DeepSpeed, ``train_batch_size`` or ``train_micro_batch_size_per_gpu`` must be given: with
    neither (nothing, ``"auto"``, or only ``gradient_accumulation_steps``) the batch size is
    unknown and :class:`ConfigError` names both keys. ``"auto"`` is a placeholder for whoever
    launches the job to fill in (the Hugging Face Trainer, ``zerodp train``); ``zerodp.initialize``
    fills ``train_micro_batch_size_per_gpu`` from a ``torch.utils.data.DataLoader`` passed as
    ``training_data``.

    ``deepspeed_ranks``: where DeepSpeed counts more ranks than that (tensor parallelism set by
    ``tensor_parallel.autotp_size`` or ``tp_model_init``, without an ``mpu``: DeepSpeed counts every
    rank of the world, the tensor-parallel ranks that share their batches included), a
    ``train_batch_size`` given with both other values may also follow DeepSpeed's count, as the
    Hugging Face Trainer's ``"auto"`` fills it. The returned ``train_batch_size`` is then the
    samples a step takes (``micro * gas * world_size``). A missing value is always derived with
    ``world_size``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size: got {world_size!r}; allowed: an integer >= 1")

    tbs, micro, gas = (None if v == "auto" else v for v in (
        cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps))
    ws = world_size

    def divide(factors: list[tuple[str, int]]) -> int:
        divisor = math.prod(v for _, v in factors)
        if tbs % divisor:
            spelled = " x ".join(f"{name} {v}" for name, v in factors)
            if len(factors) > 1:
                spelled += f" = {divisor}"
            raise ConfigError(f"train_batch_size {tbs} is not divisible by {spelled}")
        return tbs // divisor

    if tbs is not None and micro is not None and gas is not None:
        if deepspeed_ranks and deepspeed_ranks != ws and tbs == micro * gas * deepspeed_ranks:
            logger.info("train_batch_size %d counts all %d ranks, as DeepSpeed does under AutoTP; the %d "
                        "data-parallel ranks take %d samples per step (their tensor-parallel ranks share "
                        "batches)", tbs, deepspeed_ranks, ws, micro * gas * ws)
            tbs = micro * gas * ws
        elif tbs != micro * gas * ws:
            also = (f", nor x all {deepspeed_ranks} ranks as DeepSpeed counts them under AutoTP "
                    f"(= {micro * gas * deepspeed_ranks})" if deepspeed_ranks and deepspeed_ranks != ws else "")
            raise ConfigError(
                f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {micro} x "
                f"gradient_accumulation_steps {gas} x world_size {ws} (= {micro * gas * ws}){also}")
    elif tbs is not None and micro is not None:
        gas = divide([("train_micro_batch_size_per_gpu", micro), ("world_size", ws)])
    elif tbs is not None and gas is not None:
        micro = divide([("gradient_accumulation_steps", gas), ("world_size", ws)])
    elif tbs is not None:
        gas = 1
        micro = divide([("world_size", ws)])
    elif micro is not None:
        gas = gas or 1
        tbs = micro * gas * ws
    else:
        raise _no_batch_size(cfg)
    return tbs, micro, gas


def _no_batch_size(cfg: Config) -> ConfigError:
    """DeepSpeed's refusal of a config that fixes no batch size, naming what it holds."""
    given = [f"{name} {_fmt(value)}" for name in _BATCH_KEYS if (value := getattr(cfg, name)) is not None]
    got = ", ".join(given) if given else "none of " + ", ".join(_BATCH_KEYS)
    return ConfigError(
        f"train_batch_size, train_micro_batch_size_per_gpu: got {got}; allowed: an integer >= 1 for "
        "train_batch_size or train_micro_batch_size_per_gpu (as in DeepSpeed: \"Either train_batch_size or "
        "train_micro_batch_size_per_gpu needs to be provided\"), e.g. \"train_micro_batch_size_per_gpu\": 8. "
        "\"auto\" is a placeholder for the launcher to fill in (the Hugging Face Trainer and zerodp train "
        "do); zerodp.initialize fills train_micro_batch_size_per_gpu from a torch DataLoader passed as "
        "training_data")


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
