"""DeepSpeed's ``deepspeed.utils.logging``: ``logger`` (zerodp's own logger, whose level
Lightning's DeepSpeed strategy sets) and ``log_dist``."""
from __future__ import annotations

import logging as _logging
from typing import Iterable, Optional

logger = _logging.getLogger("zerodp")

__all__ = ["logger", "log_dist"]


def log_dist(message: str, ranks: Optional[Iterable[int]] = None, level: int = _logging.INFO) -> None:
    """Log ``message`` on the given global ranks (all when ``ranks`` is None or holds -1)."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    wanted = None if ranks is None else set(ranks)
    if wanted is None or -1 in wanted or rank in wanted:
        logger.log(level, "[Rank %d] %s", rank, message)
