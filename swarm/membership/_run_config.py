"""The run's config, published in the DHT so that joiners can fetch it and check theirs against it.

A publisher (the bootstrap) stores two signed records, refreshed by :class:`ConfigPublisher`:

* under ``<run_id>_config``, subkey = its public key: the config as YAML and its hash;
* under ``swarm_runs``, subkey = its public key: the run id, so that someone who only knows the
  bootstrap's address (``swarm config pull --initial-peers ...``) can find out which run it hosts.

Anyone can store such records, so a joiner takes only those signed by a peer it was told to trust:
its initial peers, whose ``/p2p/<id>`` the user pasted (:func:`list_published_configs`). Others are
never parsed, however many there are and whatever they claim. A trusted record still counts only if
its YAML loads as a :class:`~swarm.config.RunConfig` (aliases refused, a node budget kept) and that
config's hash equals the announced one. The published YAML leaves out every per-peer key
(:data:`~swarm.config.PER_PEER_KEYS`: devices, paths, timeouts, ban times; none of them is in the
hash), and a joiner strips them again from what it takes, so it always keeps its own values for them.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hivemind
import pydantic.v1 as pydantic
import yaml
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey
from hivemind.utils.timed_storage import get_dht_time
from pydantic.v1 import confloat, constr

from swarm._periodic import PeriodicTask
from swarm.config import PER_PEER_KEYS, RUN_ID_PATTERN, RunConfig, load_config, swarm_view
from swarm.membership._record import FrozenModel
from swarm.membership._signed import StrictSchemaValidator, signer_peer_id

logger = logging.getLogger(__name__)

CONFIG_KEY_SUFFIX = "config"
RUNS_KEY = "swarm_runs"
MAX_CONFIG_BYTES = 64 * 1024
"""Largest published config; a resolved config is about 2 KiB, so this is only a safety bound."""

if TYPE_CHECKING:  # a type checker cannot read pydantic.v1's constrained types; to it they are plain types
    _Hash = str
    _Time = float
    _Yaml = str
    _RunId = str
else:
    _Hash = constr(strict=True, regex=r"^[0-9a-f]{16,64}$")
    _Time = confloat(strict=True, ge=0.0, le=1e12, allow_inf_nan=False)
    _Yaml = constr(strict=True, min_length=1, max_length=MAX_CONFIG_BYTES)
    _RunId = constr(strict=True, regex=RUN_ID_PATTERN)


class RunConfigRecord(FrozenModel):
    """A published run config: full YAML text, its config hash, and when it was published."""

    yaml: _Yaml
    config_hash: _Hash
    published_at: _Time


class RunAnnouncement(FrozenModel):
    """Which run a publisher hosts (the value under :data:`RUNS_KEY`)."""

    run_id: _RunId
    config_hash: _Hash


class _RunConfigSchema(pydantic.BaseModel):
    config: dict[BytesWithPublicKey, RunConfigRecord]


class _RunsSchema(pydantic.BaseModel):
    swarm_runs: dict[BytesWithPublicKey, RunAnnouncement]


@dataclass(frozen=True)
class PublishedConfig:
    """A validated published config and who published it."""

    yaml: str
    config_hash: str
    publisher: str
    published_at: float
    config: RunConfig


def run_config_key(run_id: str) -> str:
    """The DHT key under which run ``run_id``'s config is published."""
    return f"{run_id}_{CONFIG_KEY_SUFFIX}"


def run_config_validators(run_id: str) -> list[StrictSchemaValidator]:
    """Schema validators for the two published-config keys; merge them into the DHT's validators."""
    return [
        StrictSchemaValidator(_RunConfigSchema, allow_extra_keys=True, prefix=run_id),
        StrictSchemaValidator(_RunsSchema, allow_extra_keys=True),
    ]


def shareable_dump(config: RunConfig) -> dict[str, Any]:
    """A JSON-mode dump of ``config`` without its per-peer keys (:data:`~swarm.config.PER_PEER_KEYS`).

    Loading it gives those keys their defaults, so a joiner keeps its own values (environment,
    ``--set``) for them, and the hash is the same: none of them is in it. Every other key is published
    as written, ``pipeline.num_stages: auto`` included: the hash covers ``auto`` (with the swarm-wide
    ``pipeline.memory_budget_gb`` each peer resolves it from), so the published YAML must say ``auto``
    too, or its hash would not match it and every joiner would drop it.
    """
    return swarm_view(config.model_dump(mode="json"), PER_PEER_KEYS)


def shareable_yaml(config: RunConfig) -> str:
    """``config`` as published: YAML of :func:`shareable_dump`."""
    return yaml.safe_dump(shareable_dump(config), sort_keys=False, allow_unicode=True)


def shareable_config(config: RunConfig) -> RunConfig:
    """``config`` with every per-peer key at its default (same hash), as a joiner loads it."""
    return RunConfig.model_validate(shareable_dump(config))


def parse_config_text(text: str) -> RunConfig:
    """Load YAML text exactly as ``load_config`` loads a file, ignoring this process' environment.

    Raises :class:`~swarm.config.ConfigError`.
    """
    with tempfile.TemporaryDirectory(prefix="swarm-config-") as directory:
        path = Path(directory) / "published.yaml"
        path.write_text(text, encoding="utf-8")
        return load_config(path, env={})


def run_config_record(config: RunConfig) -> RunConfigRecord:
    """The record :func:`publish_run_config` stores for ``config``: its shareable YAML and its hash,
    which a joiner recomputes from that YAML (:func:`read_run_config_record`)."""
    text = shareable_yaml(config)
    if len(text.encode("utf-8")) > MAX_CONFIG_BYTES:
        raise ValueError(f"the run config is larger than {MAX_CONFIG_BYTES} bytes as YAML")
    return RunConfigRecord(yaml=text, config_hash=config.config_hash(), published_at=get_dht_time())


def publish_run_config(
    dht: hivemind.DHT, run_id: str, config: RunConfig, signer: RSASignatureValidator, ttl_s: float
) -> bool:
    """Store ``config`` (and the run announcement) signed by ``signer``; True if a node accepted it."""
    record = run_config_record(config)
    announcement = RunAnnouncement(run_id=run_id, config_hash=record.config_hash)
    expiration = get_dht_time() + ttl_s
    subkey = signer.local_public_key
    stored = dht.store(run_config_key(run_id), record.dict(), expiration, subkey=subkey)
    announced = dht.store(RUNS_KEY, announcement.dict(), expiration, subkey=subkey)
    return bool(stored) and bool(announced)


class ConfigPublisher:
    """Re-publishes the run config every ``interval_s`` so it outlives churn and record expiry."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        config: RunConfig,
        signer: RSASignatureValidator,
        *,
        interval_s: float = 30.0,
        ttl_s: float = 120.0,
    ):
        if ttl_s < interval_s:
            raise ValueError(f"config ttl {ttl_s}s must not be shorter than the interval {interval_s}s")
        self._args = (dht, run_id, config, signer, ttl_s)
        self._task = PeriodicTask(self.publish_now, interval_s, name="swarm-config-publisher")

    def start(self) -> bool:
        """Publish once synchronously (so a joiner can fetch it on return), then keep publishing."""
        return bool(self._task.start())

    def publish_now(self) -> bool:
        published = publish_run_config(*self._args)
        if not published:
            logger.warning("no DHT node accepted the published run config")
        return published

    def stop(self) -> None:
        self._task.stop()


def _get(dht: hivemind.DHT, key: str, timeout_s: float) -> dict:
    try:
        found = dht.get(key, latest=True, return_future=True).result(timeout=timeout_s)
    except TimeoutError:
        logger.warning("lookup of %s timed out after %.0fs", key, timeout_s)
        return {}
    if found is None or not isinstance(found.value, dict):
        return {}
    now = get_dht_time()
    return {
        subkey: item.value
        for subkey, item in found.value.items()
        if getattr(item, "expiration_time", 0.0) > now
    }


def _signed_by(records: dict, publishers: Sequence[str]) -> Iterator[tuple[str, object]]:
    """``(publisher, value)`` of the records signed by ``publishers``, in their order; others skipped."""
    by_signer: dict[str, object] = {}
    for subkey, value in records.items():
        try:
            by_signer.setdefault(signer_peer_id(subkey), value)
        except Exception as exc:  # untrusted subkey
            logger.debug("ignoring a published config under a malformed subkey: %s", exc)
    for publisher in dict.fromkeys(publishers):
        if publisher in by_signer:
            yield publisher, by_signer[publisher]


def read_run_config_record(run_id: str, publisher: str, value: object) -> PublishedConfig | None:
    """A published record (untrusted: any value) as a joiner takes it, or None (logged) when it is not
    a record, its YAML is not a valid config, or that config's hash is not the announced one."""
    try:
        record = RunConfigRecord.parse_obj(value)
        config = parse_config_text(record.yaml)
    except Exception as exc:  # untrusted input: anything wrong means "not published"
        logger.warning("ignoring an invalid config for %s published by %s: %s", run_id, publisher, exc)
        return None
    if config.config_hash() != record.config_hash:
        logger.warning("ignoring config published by %s: its hash does not match its YAML", publisher)
        return None
    # what a joiner takes never carries the publisher's per-peer keys, whatever it published
    return PublishedConfig(shareable_yaml(config), record.config_hash, publisher, record.published_at, config)


def _published_by(
    dht: hivemind.DHT, run_id: str, publishers: Sequence[str], timeout_s: float
) -> Iterator[PublishedConfig]:
    """Valid configs of ``run_id`` signed by ``publishers``, in their order, each parsed when reached."""
    records = _get(dht, run_config_key(run_id), timeout_s) if publishers else {}
    for publisher, value in _signed_by(records, publishers):
        published = read_run_config_record(run_id, publisher, value)
        if published is not None:
            yield published


def list_published_configs(
    dht: hivemind.DHT, run_id: str, publishers: Sequence[str], timeout_s: float = 10.0
) -> list[PublishedConfig]:
    """Every valid config published for ``run_id`` by one of ``publishers`` (peer ids, e.g. the initial
    peers'), in their order; records signed by anyone else are ignored unread."""
    return list(_published_by(dht, run_id, publishers, timeout_s))


def choose_published(
    published: Sequence[PublishedConfig], publishers: Sequence[str]
) -> PublishedConfig | None:
    """The config of the first of ``publishers`` that published one; no one else's, whatever trainers
    announce or records claim (votes and ``published_at`` are anyone's to forge)."""
    for publisher in publishers:
        for candidate in published:
            if candidate.publisher == publisher:
                return candidate
    return None


def fetch_run_config(
    dht: hivemind.DHT, run_id: str, publishers: Sequence[str], timeout_s: float = 10.0
) -> PublishedConfig | None:
    """Run ``run_id``'s config as the first of ``publishers`` publishes it, or None.

    Only that one record is parsed fully (and those of earlier publishers, when invalid).
    """
    return next(_published_by(dht, run_id, publishers, timeout_s), None)


def published_runs(dht: hivemind.DHT, timeout_s: float = 10.0) -> dict[str, str]:
    """``{publisher peer id: run id}`` of every run announced under :data:`RUNS_KEY`."""
    runs = {}
    for subkey, value in _get(dht, RUNS_KEY, timeout_s).items():
        try:
            runs[signer_peer_id(subkey)] = RunAnnouncement.parse_obj(value).run_id
        except Exception as exc:
            logger.debug("ignoring an invalid run announcement: %s", exc)
    return runs


def discover_run_id(
    dht: hivemind.DHT, preferred_publishers: Sequence[str], timeout_s: float = 10.0
) -> str | None:
    """The run hosted by the first of ``preferred_publishers`` (e.g. the initial peers) that announces
    one; None when none does (an announcement by anyone else could point a joiner at another run)."""
    runs = published_runs(dht, timeout_s)
    for peer_id in preferred_publishers:
        if peer_id in runs:
            return runs[peer_id]
    return None
