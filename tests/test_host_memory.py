"""Host memory in proportion to the model: an exchange and a checkpoint hold no whole-model float32
copies (docs/hosting.md, "How the estimate is computed").

Measured in a fresh process (tests/workers/host_memory.py): the kernel's high-water mark of the
resident set, reset right before each operation, so only what the operation itself holds counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _measure(*args: str) -> dict[str, int]:
    command = [sys.executable, "-m", "tests.workers.host_memory", *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_exchange_and_a_checkpoint_hold_no_whole_model_float32_copy() -> None:
    """Both sides of one int8 model exchange, in one process (offer, data phase, settle, apply), grow
    the peak by about 4.7 bytes a parameter each: the snapshot's bf16 progress (2) and the int8 frames
    in flight both ways (about 1.06 each), plus one tensor's temporaries. The bound, 6 a side, fails
    for any one more float32 copy (4 bytes a parameter) of the offer, our decoded frames, the pending
    residual, the partner's decoded tensors or the mean (20 a side before). Writing a checkpoint copies
    nothing; reading one holds the loaded state once, not the file's bytes beside it."""
    report = _measure("--layers", "16", "--width", "512")
    params = report["parameters"]
    print(report)
    assert report["exchange_growth"] < 2 * 6.0 * params  # two sides, at most 6 bytes a parameter each
    assert report["save_growth"] < 0.1 * report["checkpoint_bytes"]
    assert report["load_growth"] < 1.3 * report["checkpoint_bytes"]
    assert report["loaded_equal"]
