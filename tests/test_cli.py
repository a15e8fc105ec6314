"""The `swarm` command end to end: input errors, the bootstrap line contract, shutdown, local swarms."""

from __future__ import annotations

import json
import logging
import signal
import stat
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from peers.bootstrap import JOIN_LINE_PREFIX
from peers.cli import app
from swarm.metrics import read_history
from swarm.network import IDENTITY_FILE_MODE, peer_id_of_identity
from swarm.state import list_checkpoints, read_checkpoint
from tests._cli import refused_output
from tests._processes import kill_all, session_processes, swarm_cli, terminate_and_wait
from tests.workers.tiny import BACKGROUND, cli_sets, tiny

runner = CliRunner()
TINY_SETS = cli_sets(tiny(*BACKGROUND))  # its peers only have to be there, and to stop cleanly


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
    assert quoted in refused_output(args)


@pytest.mark.parametrize(
    ("address", "meant"),
    [
        ("203.0.113.7:31337", "/ip4/203.0.113.7/tcp/31337/p2p/<peer id>"),
        ("example.org:31337/p2p/QmPeer", "/dns/example.org/tcp/31337/p2p/QmPeer"),
        ("[2001:db8::1]:31337", "/ip6/2001:db8::1/tcp/31337/p2p/<peer id>"),
    ],
)
def test_a_host_port_address_is_shown_as_the_multiaddr_it_means(address: str, meant: str) -> None:
    output = refused_output(["join", "--initial-peers", address])
    assert f"write it as {meant}" in output


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["join", "--set", "train.lrr=0.1"], "train.lrr"),
        (["bootstrap", "--set", "train.batch_size=many"], "train.batch_size"),
        (["local", "--set", "nosuchsection.key=1"], "nosuchsection"),
    ],
)
def test_bad_config_exits_2_and_names_the_key(args: list[str], named: str) -> None:
    assert named in refused_output(args)


def test_bad_config_file_line_is_named(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("run:\n  run_id: ok\ntrain:\n  batch_size: [1, 2]\n")
    output = refused_output(["bootstrap", "--config", str(config)])
    assert "train.batch_size" in output and "run.yaml:4" in output


def test_join_without_initial_peers_is_refused() -> None:
    assert "--initial-peers" in refused_output(["join"])


def test_bootstrap_state_dir_without_serve_state_is_refused(tmp_path) -> None:
    assert "--state-dir needs --serve-state" in refused_output(["bootstrap", "--state-dir", str(tmp_path)])


NETWORK_FLAGS = {
    "--initial-peers", "--host-maddrs", "--announce-maddrs", "--port", "--public-ip", "--identity-path",
    "--client-mode", "--public-name",
}  # fmt: skip


def _network_options(command: str) -> dict[str, tuple[tuple[str, ...], str | None]]:
    import typer.main

    params = typer.main.get_command(app).commands[command].params
    return {
        p.opts[0]: (tuple(p.opts + p.secondary_opts), p.help) for p in params if p.opts[0] in NETWORK_FLAGS
    }


def test_bootstrap_and_join_take_the_same_network_options(monkeypatch, tmp_path) -> None:
    """One definition (peers/_common.py): the same flags, with the same help, reaching both commands
    the same way."""
    assert set(_network_options("bootstrap")) == NETWORK_FLAGS
    assert _network_options("bootstrap") == _network_options("join")

    import peers.bootstrap
    import peers.join

    seen = {}
    monkeypatch.setattr(
        peers.bootstrap, "run_bootstrap", lambda cfg, network, **kw: seen.update(bootstrap=(network, kw))
    )
    monkeypatch.setattr(peers.join, "run_join", lambda cfg, network, **kw: seen.update(join=(network, kw)))
    peer = "/ip4/127.0.0.1/tcp/4000/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    flags = [
        "--initial-peers", f"{peer},{peer}", "--port", "4001", "--public-ip", "203.0.113.7",
        "--identity-path", str(tmp_path / "id.key"), "--client-mode", "--public-name", "alice",
    ]  # fmt: skip
    for command in ("bootstrap", "join"):  # with a config file: a join without one would look for the swarm's
        result = runner.invoke(app, [command, *flags, "--config", "configs/local-tiny.yaml"])
        assert result.exit_code == 0, result.output
    (boot, boot_kwargs), (joiner, join_kwargs) = seen["bootstrap"], seen["join"]
    assert boot == joiner
    assert boot.initial_peers == [peer, peer]
    assert boot.host_maddrs == ["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/4001"]
    assert boot.announce_maddrs == ["/ip4/203.0.113.7/tcp/4001"]
    assert str(boot.identity_path) == str(tmp_path / "id.key") and boot.client_mode is True
    assert boot_kwargs["public_name"] == join_kwargs["public_name"] == "alice"


def _monitor_peers(output: str) -> list[dict]:
    """The ``peers`` of the JSON snapshot printed by ``swarm monitor --once --format json``."""
    start = output.index("\n{") + 1 if not output.startswith("{") else 0
    snapshot, _ = json.JSONDecoder().raw_decode(output[start:])
    return snapshot["peers"]


@pytest.mark.multipeer
def test_bootstrap_line_contract_end_to_end(spawn, tmp_path) -> None:
    identity = tmp_path / "boot" / "id.key"
    boot = spawn(
        swarm_cli("bootstrap", "--identity-path", str(identity), "--public-name", "entry", *TINY_SETS)
    )
    line = boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=90)
    maddr = line[len(JOIN_LINE_PREFIX) :]
    assert stat.S_IMODE(identity.stat().st_mode) == IDENTITY_FILE_MODE
    boot_id = peer_id_of_identity(identity)
    assert maddr.endswith(f"/p2p/{boot_id}")

    joiner = spawn(swarm_cli(*line.split()[1:], "--public-name", "volunteer", *TINY_SETS))
    # longer than the DHT's startup timeout (TINY_SETS), so a start that fails shows its own error
    joined = joiner.wait_for_line(lambda text: text.startswith("peer ") and "joined run" in text, timeout=180)
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
    local = spawn(
        swarm_cli("local", "--peers", "2", "--duration", "4", "--log-dir", str(tmp_path / "logs"), *TINY_SETS)
    )
    assert local.wait(timeout=180) == 0, local.output()
    output = local.output()
    assert "[local] started 2 peers" in output and "[local] all peers stopped" in output
    logs = tmp_path / "logs"
    found = {p.name for p in logs.iterdir()}
    expected_logs = {"bootstrap.log", "peer-1.log", "peer-2.log"}
    assert expected_logs <= found, found
    # How far a trainer got in 4 s depends on the machine. One that reached the end of its run saved a
    # checkpoint (peer-N/checkpoints) and then wrote its summary; one stopped while starting up did
    # neither; one that finished a round in the time wrote its history. Nothing else may be there.
    optional = {f"peer-{i}{suffix}" for i in (1, 2) for suffix in ("", ".summary.json", ".history.jsonl")}
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
            if written["steps"]:  # stopped after its first step: the way out saved that step
                assert saved and saved[0][0] == written["steps"], (saved, written)
            else:  # stopped between joining and its first step: nothing trained, nothing saved
                assert not saved, (saved, written)
            assert f"peer {written['peer_id']} joined run" in (logs / f"peer-{index}.log").read_text()
    assert ("[local] no peer wrote a summary" in output) == (not summaries), output
    for history in logs.glob("peer-*.history.jsonl"):
        assert read_history(history), f"{history.name} holds no readable record"


@pytest.mark.multipeer
def test_a_pipelined_local_swarm_trains_to_its_limit_and_each_stage_peer_leaves_with_a_summary(
    spawn, tmp_path
) -> None:
    """`swarm join` of stage peers, through `swarm local`: a data holder and a stage server each join,
    run and leave; the data holder's summary holds a held-out loss evaluated through the other stage,
    which only works before it leaves the swarm."""
    sets = cli_sets(tiny("model.n_layer=2", "train.max_steps=6", "pipeline.num_stages=2"))
    logs = tmp_path / "logs"
    local = spawn(swarm_cli("local", "--peers", "2", "--log-dir", str(logs), *sets))
    assert local.wait(timeout=240) == 0, local.output()
    for index, role in ((1, "data holder of stage 0"), (2, "stage server of stage 1")):
        log = (logs / f"peer-{index}.log").read_text()
        assert f"joined run 'swarm-local' as {role} of 2" in log and "join: left the swarm in" in log, log
    holder, server = (json.loads((logs / f"peer-{i}.summary.json").read_text()) for i in (1, 2))
    assert holder["stage"] == 0 and holder["steps"] == 6, holder
    assert holder["eval_loss"] is not None and 0 < holder["eval_loss"] < 9, holder  # 8 bits: a byte
    assert server["stage"] == 1 and server["eval_loss"] is None and server["steps"] > 0, server


@pytest.mark.multipeer
def test_local_swarm_interrupted_leaves_nothing(spawn, tmp_path) -> None:
    local = spawn(
        swarm_cli("local", "--peers", "2", "--forever", "--log-dir", str(tmp_path / "logs"), *TINY_SETS)
    )
    local.wait_for_line(lambda text: "started 2 peers" in text, timeout=120)
    local.signal(signal.SIGINT)
    assert local.wait(timeout=30) == 0, local.output()
    assert "[local] all peers stopped" in local.output()


def test_local_stop_kills_only_what_outlives_its_peer(monkeypatch, tmp_path, capsys) -> None:
    """`swarm local`'s stop: a peer that exits on SIGTERM leaves nothing; one that ignores it is killed
    after the grace period; a process left behind by a peer that exited is a leak, named and killed."""
    import peers.local as local

    monkeypatch.setattr(local, "SHUTDOWN_GRACE_S", 1.0)
    monkeypatch.setattr(local, "ORPHAN_WAIT_S", 1.0)
    ready = "print('ready', flush=True); signal.pause()"
    scripts = {
        "clean": f"import signal; {ready}",
        "stubborn": f"import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); {ready}",
        # exits on SIGTERM, but leaves a child of its own running (in its session, like a p2pd)
        "leaky": f"import signal, subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import signal; "
        f"signal.pause()']); {ready}",
    }
    swarm = local.LocalSwarm(tmp_path)
    for name, script in scripts.items():
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        swarm.processes.append((name, proc))
        assert proc.stdout.readline().strip() == "ready"
    sessions = {proc.pid for _, proc in swarm.processes}
    try:
        outlived = swarm.stop()
    finally:
        kill_all(session_processes(sessions))
    assert len(outlived) == 1 and "python" in outlived[0], outlived
    assert "stubborn did not stop within 1 s; killed it" in capsys.readouterr().err
    assert not session_processes(sessions)
    for _, proc in swarm.processes:
        proc.stdout.close()


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


def test_debug_logs_keep_the_libraries_quiet(monkeypatch) -> None:
    """SWARM_LOG_LEVEL=DEBUG shows our debug lines, not every address py-multiaddr parses."""
    from peers import _common

    root = logging.getLogger()
    saved = (
        root.level,
        list(root.handlers),
        {n: logging.getLogger(n).level for n in ("hivemind", "multiaddr")},
    )
    monkeypatch.setenv("SWARM_LOG_LEVEL", "DEBUG")
    root.handlers.clear()  # basicConfig configures only a root logger without handlers
    try:
        _common.setup_logging()
        assert logging.getLogger("swarm.trainer").isEnabledFor(logging.DEBUG)
        for noisy in ("hivemind", "multiaddr.codecs.cid"):
            assert not logging.getLogger(noisy).isEnabledFor(logging.INFO), noisy
            assert logging.getLogger(noisy).isEnabledFor(logging.WARNING), noisy
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)
