"""TensorBoard, optional (``trainer.tensorboard``): every scalar of metrics.csv (at each epoch) and memory.csv (at
each of its rows) also goes to ``<run>/tb/`` as TensorBoard events, when the ``tensorboard`` package is installed.
Without it (``auto``), nothing changes and nothing is said; ``true`` without it is a config error."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def wanted(setting: bool | str) -> bool:
    """trainer.tensorboard: true, or auto with the package installed (config refuses true without it)."""
    return setting is True or (setting == "auto" and available())


class TensorBoardLog:
    """Scalars of a run's CSV rows as TensorBoard events in ``directory``; ``purge_step``: a resumed run's step,
    past which the events of the run before are hidden (they were not kept: the run goes on from its checkpoint)."""

    def __init__(self, directory: str, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter  # the optional package: only when it is wanted

        self.directory = directory
        self.writer = SummaryWriter(directory, purge_step=purge_step)

    def mirror(self, prefix: str, step_key: str) -> Callable[[dict], None]:
        """What a CsvLog calls with each row it appended: its numbers as scalars ``prefix + column`` at the row's
        ``step_key``."""

        def write(row: dict) -> None:
            step = int(row[step_key])
            for key, value in row.items():
                if key != step_key and isinstance(value, (int, float)) and not isinstance(value, bool):
                    if math.isfinite(value):
                        self.writer.add_scalar(prefix + key, value, step)
            self.writer.flush()

        return write

    def close(self) -> None:
        self.writer.close()
