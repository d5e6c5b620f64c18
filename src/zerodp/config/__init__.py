"""DeepSpeed-compatible configuration for zerodp.

:func:`load_config` validates a DeepSpeed-style JSON config into a :class:`Config` (the blocks'
models are in ``schema.py``, loading, presets and batch sizes in ``load.py``). Problems raise
:class:`ConfigError` naming the key path, the bad value and what is allowed. Unknown keys are
ignored with one ``UserWarning`` each; keys that would change the results if ignored are
refused unless they hold their neutral value: Apex AMP, gradient pre-scaling and pre-division,
sparse gradients, GPUDirect Storage and node-local checkpoint storage.
"""
from .load import PRESETS, get_preset, load_config, resolve_batch_sizes
from .schema import Config, ConfigError, OptimizerConfig, SchedulerConfig, ZeroConfig, describe_fields

__all__ = [
    "PRESETS", "ConfigError", "ZeroConfig", "OptimizerConfig", "SchedulerConfig", "Config",
    "load_config", "get_preset", "resolve_batch_sizes", "describe_fields",
]
