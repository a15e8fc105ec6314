"""Typed run configs: load, validate, hash and compare them.

Sources, lowest to highest precedence: defaults < YAML file < ``SWARM_<SECTION>__<KEY>`` environment
variables < ``--set section.key=value`` overrides. See docs/configuration.md.
"""

from swarm.config._errors import ConfigError
from swarm.config._exchange_sections import AveragingSection, CompressionSection
from swarm.config._load import load_config
from swarm.config._schema import (
    RUN_ID_PATTERN,
    SECTIONS,
    DataSection,
    ModelSection,
    MonitorSection,
    NetworkSection,
    RunConfig,
    RunSection,
    TrainSection,
)
from swarm.config._sources import ENV_ALLOWLIST
from swarm.config._view import PER_PEER_KEYS, diff_configs

__all__ = [
    "ENV_ALLOWLIST",
    "PER_PEER_KEYS",
    "RUN_ID_PATTERN",
    "SECTIONS",
    "AveragingSection",
    "CompressionSection",
    "ConfigError",
    "DataSection",
    "ModelSection",
    "MonitorSection",
    "NetworkSection",
    "RunConfig",
    "RunSection",
    "TrainSection",
    "diff_configs",
    "load_config",
]
