"""The `swarm` command end to end: input errors, the bootstrap line contract, shutdown, local swarms."""

from __future__ import annotations

import json
import signal
import stat

import pytest
from typer.testing import CliRunner

from peers.bootstrap import JOIN_LINE_PREFIX
from peers.cli import app
from swarm.network import IDENTITY_FILE_MODE, peer_id_of_identity
from swarm.state import list_checkpoints, read_checkpoint
from tests._processes import swarm_cli, terminate_and_wait

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "quoted"),
    [
        (
            [
                "join",
                "--initial-peers",
                "/ip4/300.1.1.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
            ],
            "/ip4/300.1.1.1",
        ),
        (["join", "--initial-peers", "not-an-address"], "'not-an-address'"),
        (["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/notaport"], "/tcp/notaport"),
        (["bootstrap", "--port", "1234", "--host-maddrs", "/ip4/127.0.0.1/tcp/1"], "--port or --host-maddrs"),
        (["monitor", "--initial-peers", "/dns/"], "'/dns/'"),
    ],
)
def test_malformed_address_exits_2_and_quotes_it(args: list[str], quoted: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert quoted in result.output


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["join", "--set", "train.lrr=0.1"], "train.lrr"),
        (["bootstrap", "--set", "train.batch_size=many"], "train.batch_size"),
        (["local", "--set", "nosuchsection.key=1"], "nosuchsection"),
    ],
)
def test_bad_config_exits_2_and_names_the_key(args: list[str], named: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert named in result.output


def test_bad_config_file_line_is_named(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("run:\n  run_id: ok\ntrain:\n  batch_size: [1, 2]\n")
    result = runner.invoke(app, ["bootstrap", "--config", str(config)])
    assert result.exit_code == 2
    assert "train.batch_size" in result.output and "run.yaml:4" in result.output


def test_join_without_initial_peers_is_refused() -> None:
    result = runner.invoke(app, ["join"])
    assert result.exit_code == 2
    assert "--initial-peers" in result.output


def _monitor_peers(output: str) -> list[dict]:
    """The ``peers`` of the JSON snapshot printed by ``swarm monitor --once --format json``."""
    start = output.index("\n{") + 1 if not output.startswith("{") else 0
    snapshot, _ = json.JSONDecoder().raw_decode(output[start:])
    return snapshot["peers"]


@pytest.mark.multipeer
def test_bootstrap_line_contract_end_to_end(spawn, tmp_path) -> None:
    identity = tmp_path / "boot" / "id.key"
    boot = spawn(swarm_cli("bootstrap", "--identity-path", str(identity), "--public-name", "entry"))
    line = boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=90)
    maddr = line[len(JOIN_LINE_PREFIX) :]
    assert stat.S_IMODE(identity.stat().st_mode) == IDENTITY_FILE_MODE
    boot_id = peer_id_of_identity(identity)
    assert maddr.endswith(f"/p2p/{boot_id}")

    joiner = spawn(swarm_cli(*line.split()[1:], "--public-name", "volunteer"))
    joined = joiner.wait_for_line(lambda text: text.startswith("peer ") and "joined run" in text, timeout=90)
    joiner_id = joined.split()[1]

    monitor = spawn(swarm_cli("monitor", "--initial-peers", maddr, "--once", "--format", "json"))
    assert monitor.wait(timeout=90) == 0, monitor.output()
    records = _monitor_peers(monitor.output())
    assert {r["peer_id"] for r in records} == {boot_id, joiner_id}
    assert {r["public_name"] for r in records} == {"entry", "volunteer"}

    assert terminate_and_wait(joiner) == 0
    assert terminate_and_wait(boot) == 0


@pytest.mark.multipeer
def test_local_swarm_runs_and_stops_cleanly(spawn, tmp_path) -> None:
    local = spawn(swarm_cli("local", "--peers", "2", "--duration", "4", "--log-dir", str(tmp_path / "logs")))
    assert local.wait(timeout=180) == 0, local.output()
    output = local.output()
    assert "[local] started 2 peers" in output and "[local] all peers stopped" in output
    logs = tmp_path / "logs"
    found = {p.name for p in logs.iterdir()}
    expected_logs = {"bootstrap.log", "peer-1.log", "peer-2.log"}
    assert expected_logs <= found, found
    # How far a trainer got in 4 s depends on the machine. One that reached the end of its run saved a
    # checkpoint (peer-N/checkpoints) and then wrote its summary; one stopped while starting up did
    # neither. Nothing else may be there.
    optional = {f"peer-{i}{suffix}" for i in (1, 2) for suffix in ("", ".summary.json")}
    assert found - expected_logs <= optional, found
    summaries = []
    for index in (1, 2):
        directory, summary = logs / f"peer-{index}", logs / f"peer-{index}.summary.json"
        if directory.exists():
            assert [p.name for p in directory.iterdir()] == ["checkpoints"]
            for step, path in list_checkpoints(directory / "checkpoints"):
                assert read_checkpoint(path)["progress"]["step"] == step, path
        if summary.exists():  # written after the shutdown checkpoint, by the trainer of that log
            written = json.loads(summary.read_text())
            summaries.append(written)
            saved = list_checkpoints(directory / "checkpoints")
            assert saved and saved[0][0] == written["steps"], (saved, written)
            assert f"peer {written['peer_id']} joined run" in (logs / f"peer-{index}.log").read_text()
    assert ("[local] no peer wrote a summary" in output) == (not summaries), output


@pytest.mark.multipeer
def test_local_swarm_interrupted_leaves_nothing(spawn, tmp_path) -> None:
    local = spawn(swarm_cli("local", "--peers", "2", "--forever", "--log-dir", str(tmp_path / "logs")))
    local.wait_for_line(lambda text: "started 2 peers" in text, timeout=120)
    local.signal(signal.SIGINT)
    assert local.wait(timeout=30) == 0, local.output()
    assert "[local] all peers stopped" in local.output()


def test_local_live_view_lists_trainers_in_a_narrow_terminal() -> None:
    from rich.console import Console

    from peers.local import progress_table
    from swarm import Member, PeerRecord

    def member(name: str, role: str, step: int) -> Member:
        record = PeerRecord(
            peer_id="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", protocol_version=1,
            package_version="0.1.0", config_hash="ab", role=role, public_name=name, state="training",
            step=step, eval_loss=3.61,
        )  # fmt: skip
        return Member(record.peer_id, record, expires_at=0.0)

    console = Console(width=70, record=True, color_system=None)
    console.print(
        progress_table(
            [
                member("local-2", "trainer", 20),
                member("boot", "bootstrap", 0),
                member("local-1", "trainer", 10),
            ],
            12.0,
        )
    )
    text = console.export_text()
    assert text.index("local-1") < text.index("local-2") and "boot" not in text
    assert "3.610" in text and all(len(line) <= 70 for line in text.splitlines())
