"""A short description of the compute device, for membership records."""

from __future__ import annotations

import torch


def describe_device(device: str = "auto") -> tuple[str, float]:
    """Return ``(name, memory_gb)`` of the device this peer computes on (memory 0 for CPU)."""
    wants_cuda = device == "auto" or device.startswith("cuda")
    if not (wants_cuda and torch.cuda.is_available()):
        return "cpu", 0.0
    index = torch.device(device).index if device.startswith("cuda:") else None
    props = torch.cuda.get_device_properties(index or 0)
    return props.name[:128], round(props.total_memory / 2**30, 2)
