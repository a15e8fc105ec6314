"""The baselines swarm is measured against, as averaging backends (docs/baselines.md).

``averaging.backend: hivemind`` is ``hivemind.Optimizer`` (:mod:`._hivemind`); ``allreduce`` is
OpenDiLoCo's group all-reduce of pseudo-gradients (:mod:`._allreduce`). Both are for benchmarks and
comparisons, not for public runs: hivemind's averaging RPCs take no authorizer, so neither runs in a
private swarm. :func:`swarm.trainer.make_backend` imports each only when a config asks for it.
"""

from swarm.trainer.baselines._allreduce import AllReduceBackend
from swarm.trainer.baselines._hivemind import HivemindBackend, hivemind_codec, hivemind_run_id

__all__ = ["AllReduceBackend", "HivemindBackend", "hivemind_codec", "hivemind_run_id"]
