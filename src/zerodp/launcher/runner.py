"""DeepSpeed's ``deepspeed.launcher.runner``: the name Accelerate's launcher reads
(``DEEPSPEED_ENVIRONMENT_NAME``, the file of environment variables DeepSpeed's multi-node
launcher exports) and ``main``, the ``deepspeed`` command, as ``zerodp launch`` (one node,
torchrun underneath: ``zerodp launch --help``)."""
from __future__ import annotations

import sys
from typing import Optional

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main"]


def main(args: Optional[list[str]] = None) -> int:
    """``deepspeed [options] script [args]`` as ``zerodp launch``; returns its exit code."""
    from ..tools.cli import main as cli_main
    return cli_main(["launch", *(sys.argv[1:] if args is None else args)])


if __name__ == "__main__":
    raise SystemExit(main())
