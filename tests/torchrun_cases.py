"""Run a case script under torchrun and read what its rank 0 reported: the scripts
(``hf_trainer_tasks.py``, ``lightning_tasks.py``) take ``OUT.json`` and their case names and
write one result per case."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")


def run_cases(python: str, script: Path, out: Path, args: list[str], cases: list[str], ranks: int,
              **env: str) -> dict:
    """``python -m torch.distributed.run`` of ``script OUT ARGS... CASES...`` on ``ranks``
    processes, one thread each, with ``src/`` importable and ``env`` added; returns OUT's
    results, one per case."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env,
                    PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                           str(script), str(out), *args, *cases],
                          env=full_env, capture_output=True, text=True, timeout=600)
    # judged by what rank 0 reported: an abort at exit after that is not the subject
    assert out.exists(), (proc.stdout + proc.stderr)[-6000:]
    found = json.loads(out.read_text())
    assert sorted(found) == sorted(cases)
    return found


def serve(run_case) -> None:
    """A case script's main: ``OUT CASE...`` from its arguments; ``run_case(case, dir of OUT)`` for each
    case on every rank, and rank 0 writes their results to OUT."""
    import sys
    out, cases = sys.argv[1], sys.argv[2:]
    results = {case: run_case(case, os.path.dirname(out)) for case in cases}
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(results, f)
