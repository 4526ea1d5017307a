"""Which rank of how many this process is: arguments, ``torch.distributed``,
torchrun's ``$RANK``/``$WORLD_SIZE`` or a Slurm step (see :class:`~stoker.Loader`)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional, Tuple


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def _rank_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int, str]:
    """(rank, world_size, source) by the documented rules; see :class:`Loader`."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError(
                f"pass both rank and world_size, or neither (got rank={rank!r}, world_size={world_size!r})"
            )
        found: Tuple[int, int, str] = (int(rank), int(world_size), "argument")
    else:
        found = _detect_rank_world()
    r, w, source = found
    if w < 1 or not 0 <= r < w:
        raise ValueError(f"rank {r} must be in [0, world_size) and world_size {w} at least 1 (from {source})")
    return found


def _detect_rank_world() -> Tuple[int, int, str]:
    # torch.distributed only if the program already imported it: importing
    # torch costs seconds and would be a surprise of its own.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size()), "torch.distributed"
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if (rank is None) != (world is None):
        have, missing = ("RANK", "WORLD_SIZE") if rank is not None else ("WORLD_SIZE", "RANK")
        raise ValueError(
            f"${have} is set but ${missing} is not: set both (torchrun does), unset both, "
            "or pass rank= and world_size= to the Loader"
        )
    if rank is not None and world is not None:
        return rank, world, "env RANK/WORLD_SIZE"
    # Slurm sets SLURM_NTASKS in the batch script too (`sbatch --ntasks=4`),
    # where one process runs; only a task of a step launched by srun is one of
    # several ranks.
    if os.environ.get("SLURM_STEP_ID", "").strip():
        tasks = _env_int("SLURM_STEP_NUM_TASKS") or _env_int("SLURM_NTASKS")
        procid = _env_int("SLURM_PROCID")
        if tasks is not None and tasks > 1 and procid is not None:
            return procid, tasks, "slurm"
    return 0, 1, "default"


_logger = logging.getLogger("stoker")
_logged_choices: set = set()


def _log_rank_choice(rank: int, world: int, source: str) -> None:
    if (rank, world, source) not in _logged_choices:
        _logged_choices.add((rank, world, source))
        _logger.info("stoker: rank %d of world_size %d (from %s)", rank, world, source)
