"""In-process hostile peers of tests/test_hostile_swarm.py (issue 28), and the run's organizer.

Each hostile node is a real :class:`SwarmNode` (its own DHT and p2p daemon) in the attacked swarm,
with a membership record that says it is a trainer of the run, claims ``10**15`` samples (finding 3)
and announces one poisoned state, which its real :class:`StateServer` serves with a progress of
``2**63 - 1`` samples (findings 2 and 7: Sybil donors agreeing on one digest, hostile progress). Two of
them also publish run configs under the run's key (findings 4 and 6): the honest config's hash with
hostile per-peer keys and a ``published_at`` far in the future, and a YAML alias bomb.

The organizer is the honest node a joiner is told about (``--initial-peers``): it publishes the run's
config, as a bootstrap does, and serves no state, so that a joiner trusting it must still choose
among the donors, Sybils included.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from hivemind.utils.timed_storage import get_dht_time

from swarm import NetworkOptions, NodeInfo, SwarmNode
from swarm.config import RunConfig
from swarm.learning import build_model
from swarm.membership import publish_run_config, run_config_key
from swarm.membership._run_config import RunConfigRecord
from swarm.state import StateServer, StateSnapshot, make_snapshot

CLAIMED_SAMPLES = 10**15
"""What every hostile record claims to have trained (the ledger must not credit it)."""

POISON_SHIFT = 10.0
"""How far every coordinate of the poisoned state is from the run's initial model."""

HOSTILE_STEP_TIME_S = 3600.0
"""``emulation.step_time_s`` (a per-peer key) in the config a hostile node publishes."""


def poisoned_state(config: RunConfig) -> StateSnapshot:
    """A state of the run's model that looks complete (every parameter and momentum buffer) but is
    ``POISON_SHIFT`` away from any honest state, with a progress that would end any run at once."""
    model = build_model(config.model, config.run.seed)
    tensors = {f"param/{name}": p.detach() + POISON_SHIFT for name, p in model.named_parameters()}
    tensors.update({f"momentum/{name}": torch.zeros_like(p) for name, p in model.named_parameters()})
    return make_snapshot(tensors, {"round": 10**5, "step": 10**6, "samples_total": 2**63 - 1})


def alias_bomb(levels: int = 9) -> str:
    """~600 bytes of YAML whose aliases expand into 10**levels strings (finding 6)."""
    lines = ["model:", "  kind: hf", "  hf_config:", "    a0: &a0 [" + ",".join(['"xxxxxxxx"'] * 10) + "]"]
    lines += [f"    a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _publish(node: SwarmNode, run_id: str, config_hash: str, text: str, published_at: float) -> None:
    """Publish ``text`` as the run's config the way a bootstrap does, but with any text and time."""
    record = RunConfigRecord(yaml=text, config_hash=config_hash, published_at=published_at)
    expiration = get_dht_time() + 60
    subkey = node.signer.local_public_key
    node.dht.store(run_config_key(run_id), record.dict(), expiration, subkey=subkey)
    node.dht.store("swarm_runs", {"run_id": run_id, "config_hash": config_hash}, expiration, subkey=subkey)


def _network(config: RunConfig, initial_peers: list[str]) -> NetworkOptions:
    return NetworkOptions(initial_peers=initial_peers, startup_timeout_s=config.network.startup_timeout_s)


def _fast_records(config: RunConfig) -> dict[str, float]:
    return {
        "record_interval_s": config.network.record_interval_s,
        "record_ttl_s": config.network.record_ttl_s,
    }


class HostileNodes:
    """``count`` hostile nodes joined through ``initial_peers``; :meth:`close` stops them all."""

    def __init__(self, config: RunConfig, initial_peers: list[str], count: int = 3) -> None:
        self.poison = poisoned_state(config)
        self.nodes: list[SwarmNode] = []
        self.servers: list[StateServer] = []
        run_id, config_hash = config.run.run_id, config.config_hash()
        status = {
            "state": "training",
            "step": 10**6,
            "round": 10**5,
            "samples_total": CLAIMED_SAMPLES,
            "state_hash": self.poison.digest,
        }
        network = NetworkOptions(
            initial_peers=initial_peers, startup_timeout_s=config.network.startup_timeout_s
        )
        try:
            for _ in range(count):
                info = NodeInfo(run_id, config_hash, "trainer")
                node = SwarmNode(network, info, status=lambda: dict(status), **_fast_records(config))
                self.nodes.append(node)
                server = StateServer(node.dht, run_id)
                self.servers.append(server)
                server.publish(self.poison)
        except BaseException:
            self.close()
            raise

    @property
    def peer_ids(self) -> list[str]:
        return [node.peer_id for node in self.nodes]

    def publish_configs(self, config: RunConfig) -> None:
        """The honest config's hash with a hostile per-peer key, published "later" than anyone could,
        and an alias bomb, later still (the old rule took the newest ``published_at``)."""
        hostile = config.model_copy(
            update={"emulation": config.emulation.model_copy(update={"step_time_s": HOSTILE_STEP_TIME_S})}
        )
        assert hostile.config_hash() == config.config_hash()  # per-peer keys are outside the hash
        now = get_dht_time()
        run_id = config.run.run_id
        _publish(self.nodes[0], run_id, config.config_hash(), hostile.to_yaml(), now + 1e6)
        _publish(self.nodes[1 % len(self.nodes)], run_id, config.config_hash(), alias_bomb(), now + 2e6)

    def close(self) -> None:
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.close()
        for node in self.nodes:
            node.close()


class Organizer:
    """The run's honest organizer: a bootstrap-role node that publishes the run's config."""

    def __init__(self, config: RunConfig, initial_peers: list[str]) -> None:
        network = NetworkOptions(
            initial_peers=initial_peers, startup_timeout_s=config.network.startup_timeout_s
        )
        info = NodeInfo(config.run.run_id, config.config_hash(), "bootstrap")
        self.node = SwarmNode(network, info, **_fast_records(config))
        try:
            assert publish_run_config(self.node.dht, config.run.run_id, config, self.node.signer, ttl_s=120)
        except BaseException:
            self.node.close()
            raise

    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.node.visible_maddrs()]

    def members(self) -> list[Any]:
        return self.node.members()

    def close(self) -> None:
        self.node.close()
