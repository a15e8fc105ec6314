"""Typed run configs: load, validate, hash and compare them.

Sources, lowest to highest precedence: defaults < YAML file < ``SWARM_<SECTION>__<KEY>`` environment
variables < ``--set section.key=value`` overrides. See docs/configuration.md.
"""

from swarm.config._errors import ConfigError
from swarm.config._exchange_sections import AveragingSection, CompressionSection
from swarm.config._load import load_config
from swarm.config._schema import (
    MOVED_KEYS,
    PER_PEER_KEYS,
    RUN_ID_PATTERN,
    SECTIONS,
    DataSection,
    EmulationSection,
    ModelSection,
    MonitorSection,
    NetworkSection,
    RunConfig,
    RunSection,
    TrainSection,
)
from swarm.config._sources import ENV_ALLOWLIST, swarm_home
from swarm.config._view import HASH_VERSION, diff_configs, per_peer_keys, swarm_view

__all__ = [
    "ENV_ALLOWLIST",
    "HASH_VERSION",
    "MOVED_KEYS",
    "PER_PEER_KEYS",
    "RUN_ID_PATTERN",
    "SECTIONS",
    "AveragingSection",
    "CompressionSection",
    "ConfigError",
    "DataSection",
    "EmulationSection",
    "ModelSection",
    "MonitorSection",
    "NetworkSection",
    "RunConfig",
    "RunSection",
    "TrainSection",
    "diff_configs",
    "load_config",
    "per_peer_keys",
    "swarm_home",
    "swarm_view",
]
