"""The emulated accelerator a pipeline stage's work is timed on (``emulation.step_time_s``)."""

from __future__ import annotations

import time


class DeviceClock:
    """``emulation.step_time_s`` and ``emulation.slowdown`` per unit of work: an emulated accelerator.

    Work worth ``share`` of an inner step (forward and backward of a micro-batch of ``samples`` out of
    ``batch_size`` is ``samples / batch_size``; a forward alone a third of that) takes at least
    ``share * step_time_s`` of device time, stretched by
    ``slowdown``; the caller sleeps for the difference, the way a process waits on its busy device.
    Returns the device time.
    """

    def __init__(self, step_time_s: float, slowdown: float, batch_size: int) -> None:
        self.step_time_s, self.slowdown, self.batch_size = step_time_s, slowdown, batch_size

    def pad(self, compute_s: float, share: float) -> float:
        device = max(compute_s, self.step_time_s * share) * self.slowdown
        if device > compute_s:
            time.sleep(device - compute_s)
        return device

    def share(self, samples: int) -> float:
        return samples / self.batch_size
