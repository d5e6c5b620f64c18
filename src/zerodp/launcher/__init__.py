"""DeepSpeed's ``deepspeed.launcher``: ``runner`` (the ``deepspeed`` command's module), which
Accelerate imports to launch a DeepSpeed run."""
from . import runner  # noqa: F401 (read as an attribute)
