"""TensorBoard sink: swarm-level scalars of each snapshot as event files (``monitor.tensorboard_dir``).

Each refresh adds one point per known total (an unknown one, ``null`` in the JSON, is left out) and
flushes, so a TensorBoard pointed at the directory follows the run live. The step is the snapshot's
DHT time in whole seconds, and the wall time the snapshot's time: a restarted monitor continues the
same curves instead of starting again at step 0 (TensorBoard's RELATIVE or WALL axis reads better).
"""

from __future__ import annotations

from pathlib import Path

from swarm.metrics import SwarmSnapshot

SCALARS: tuple[tuple[str, str], ...] = (
    ("swarm/eval_loss", "eval_loss_mean"),
    ("swarm/eval_bits_per_byte", "eval_bits_per_byte_mean"),
    ("swarm/train_loss", "loss_mean"),
    ("swarm/train_loss_best", "loss_best"),
    ("swarm/samples_per_s", "samples_per_s"),
    ("swarm/samples_total", "samples_total"),
    ("swarm/upload_bytes_per_s", "upload_bps"),
    ("swarm/download_bytes_per_s", "download_bps"),
    ("swarm/syncs_per_min", "syncs_per_min"),
    ("swarm/peers", "peers"),
    ("swarm/trainers", "trainers"),
    ("swarm/progress", "progress"),
)
"""TensorBoard tag and the ``SwarmTotals`` field it plots."""


class TensorBoardSink:
    """Writes :data:`SCALARS` of each snapshot under ``log_dir`` (created if missing).

    Raises ImportError when the ``tensorboard`` package is missing (``pip install 'swarm[tensorboard]'``)
    and OSError when the directory cannot be created.
    """

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"{exc}; install it with: pip install 'swarm[tensorboard]'") from exc
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))
        self._last_step: int | None = None

    def update(self, snapshot: SwarmSnapshot) -> None:
        """One point per known total at step ``int(snapshot.time)``; at most one snapshot per second."""
        step = int(snapshot.time)
        if self._last_step is not None and step <= self._last_step:
            return
        self._last_step = step
        for tag, field in SCALARS:
            value = getattr(snapshot.totals, field, None)
            if value is not None:
                self._writer.add_scalar(tag, float(value), global_step=step, walltime=snapshot.time)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
