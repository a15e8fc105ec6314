"""The ``swarm`` command: config tools, the peer programs (bootstrap, join, local, monitor), data, export."""

from __future__ import annotations

from peers import _signals  # first: a Ctrl+C during the imports below ends start-up in one line

if _signals.launched_as_program(__name__):
    _signals.install_startup_handler()
    from swarm.network import start_shm_manager_first

    start_shm_manager_first()  # a program's DHT starts torch's shm manager first, out of Ctrl+C's way

from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import typer

from peers import _common as common
from peers._signals import shutdown_on_signals
from peers.config_cmd import config_app, load_peer_config
from peers.data_cmd import data_app
from peers.doctor import doctor
from peers.export_cmd import export, generate
from peers.monitor import monitor_app

JOIN_STOPPING = "join: stopping: the step in progress ends first (Ctrl+C again to quit at once)"

app = typer.Typer(
    help="Decentralized training with quantized gossip. Start with `swarm local` or see README.md.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(config_app, name="config")
app.add_typer(monitor_app, name="monitor")
app.add_typer(data_app, name="data")


def peer_command(command: Callable[..., None]) -> Callable[..., None]:
    """Register a peer program (`swarm bootstrap`, `swarm join`): a command with the network options,
    declared once in peers/_common.py and given to it as its ``network_flags`` parameter."""
    return app.command()(common.with_network_options(command))


@peer_command
def bootstrap(
    config: Path | None = common.CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
    network_flags: common.NetworkFlags = common.NetworkFlags(),  # the network options (peers/_common.py)
    serve_state: bool = typer.Option(
        False, "--serve-state", help="Keep the live trainers' latest model state and serve it to joiners."
    ),
    state_dir: Path | None = typer.Option(
        None, "--state-dir", help="With --serve-state: also save the kept state here (atomic files)."
    ),
    state_interval: float = typer.Option(
        60.0, "--state-interval", min=1.0, help="With --serve-state: seconds between state refreshes."
    ),
    state_min_donors: int | None = typer.Option(
        None,
        "--state-min-donors",
        min=1,
        help="With --serve-state: keep the median of at least N distinct trainer states (default 3). "
        "Fewer trusts those trainers: one broken or hostile trainer's state may be served to every "
        "joiner (docs/state-sync.md).",
    ),
    status_interval: float = typer.Option(
        60.0, "--status-interval", min=1.0, help="Seconds between the lines saying where the run stands."
    ),
) -> None:
    """Start a stable entry peer and print the line others paste to join; then say who joins and
    leaves, where the run stands each minute, and a summary at exit."""
    from peers.bootstrap import run_bootstrap

    if state_dir is not None and not serve_state:  # how the flags go together, before any file is read
        common.fail("--state-dir needs --serve-state")
    if state_min_donors is not None and not serve_state:
        common.fail("--state-min-donors needs --serve-state")
    cfg = common.load_run_config(config, set_)
    network = common.resolve_network(cfg, network_flags)
    with shutdown_on_signals(acknowledge="bootstrap: shutting down", starting=True) as stop:
        run_bootstrap(
            cfg,
            network,
            public_name=network_flags.public_name,
            config_path=_str(config),
            stop=stop,
            serve_state=serve_state,
            state_dir=_str(state_dir),
            state_interval_s=state_interval,
            state_min_donors=state_min_donors,
            status_interval_s=status_interval,
        )


@peer_command
def join(
    config: Path | None = common.CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
    network_flags: common.NetworkFlags = common.NetworkFlags(),  # the network options (peers/_common.py)
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest valid checkpoint."),
    summary: Path | None = typer.Option(None, "--summary", help="Write this peer's final numbers as JSON."),
    history: Path | None = typer.Option(
        None, "--history", help="Append this peer's snapshot (monitor schema) per sync; plot it later."
    ),
    stage: str = typer.Option(
        "auto", "--stage", help="Pipeline runs: the stage to serve, or 'auto' (the least served one)."
    ),
) -> None:
    """Join a swarm through an initial peer and train in it."""
    from peers.join import run_join

    cfg, network = load_peer_config(config, set_ or (), network_flags, check=True)  # no --config: the swarm's
    if not network.initial_peers:
        common.fail("swarm join needs --initial-peers (the line `swarm bootstrap` printed)")
    with shutdown_on_signals(acknowledge=JOIN_STOPPING, starting=True) as stop:
        run_join(
            cfg,
            network,
            public_name=network_flags.public_name,
            resume=resume,
            summary_path=summary,
            history_path=history,
            stop=stop,
            stage=stage,
            check_swarm=config is not None,  # a config fetched from the swarm was checked on the way
        )


@app.command()
def local(
    config: Path | None = common.CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
    peers: int = typer.Option(
        3, "--peers", "-n", min=1, max=64, help="Number of peers besides the bootstrap."
    ),
    duration: float | None = typer.Option(
        600.0, "--duration", min=1.0, help="Stop after this many seconds even if the trainers are not done."
    ),
    forever: bool = typer.Option(False, "--forever", help="Run until Ctrl+C instead of --duration."),
    log_dir: Path | None = typer.Option(
        None, "--log-dir", help="Where peer logs go (default runs/local-<time>)."
    ),
    summary: Path | None = typer.Option(None, "--summary", help="Also write the final summary as JSON here."),
    stages: str = typer.Option(
        "round-robin", "--stages", help="Pipeline runs: 'round-robin' (peer i: stage i-1 mod S) or 'auto'."
    ),
) -> None:
    """Launch a bootstrap and N trainers on loopback; stop them all at the end or on Ctrl+C."""
    from peers.local import run_local

    cfg = common.load_run_config(config, set_)
    log_dir = log_dir or Path("runs") / f"local-{datetime.now():%Y%m%d-%H%M%S}"
    with shutdown_on_signals() as stop:
        status = run_local(
            cfg,
            peers=peers,
            duration_s=None if forever else duration,
            config_path=_str(config),
            overrides=list(set_ or ()),
            log_dir=log_dir,
            summary_path=summary,
            stop=stop,
            stages=stages,
        )
    raise typer.Exit(status)


app.command("export")(export)
app.command("generate")(generate)
app.command("doctor")(doctor)


def _str(path: Path | None) -> str | None:
    return str(path) if path is not None else None


def main() -> None:
    """Console-script entry point.

    Once the command has finished (a peer has closed its node, daemon and files), the process exits
    without the interpreter's teardown: its garbage collections over every object of torch, hivemind
    and the model took 5 to 7 s on a busy 2-core machine, most of a peer's shutdown grace period
    (docs/training.md, "Shutdown"). Exit handlers still run first (:func:`common.exit_now`)."""
    _signals.enter_command()
    common.setup_logging()
    common.enable_stack_dumps()
    try:
        app()
    except SystemExit as done:
        common.exit_now(done.code)
    except KeyboardInterrupt:  # a second Ctrl+C outside a command's body (typer exits 130 inside it)
        common.exit_now(_signals.EXIT_INTERRUPTED)
    common.exit_now(0)


if __name__ == "__main__":
    main()
