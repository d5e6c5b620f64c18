"""DeepSpeed's ``deepspeed.runtime``: the modules scripts and the Hugging Face integration import
names from (``lr_schedules``, ``engine``). Faces over zerodp's own code; no logic here."""
from . import engine, lr_schedules, zero  # noqa: F401 (read as attributes: deepspeed.runtime.lr_schedules)
