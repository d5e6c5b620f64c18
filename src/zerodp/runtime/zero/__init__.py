"""DeepSpeed's ``deepspeed.runtime.zero``: ``partition_parameters`` (what ``transformers`` reads
around ``zero.Init``) and ``Init`` / ``GatheredParameters`` under their DeepSpeed paths."""
from ...zero import GatheredParameters, Init, register_external_parameter
from . import partition_parameters  # noqa: F401 (read as an attribute)

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "partition_parameters"]
