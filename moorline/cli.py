"""The ``moorline`` command. Subcommands live next to the layer they drive and are registered here."""

from __future__ import annotations

import importlib
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="moorline: a durable, replicated MQTT broker.")


def _print_version(value: bool) -> None:
    if value:
        from moorline import __version__

        typer.echo(f"moorline {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """moorline: a durable, replicated MQTT broker."""

# (command name, module, function): each module defines a typer-annotated function.
_COMMANDS: list[tuple[str, str, str]] = [
    ("run", "moorline.node.cli", "run"),
    ("passwd", "moorline.node.cli", "passwd"),
    ("token", "moorline.node.cli", "token"),
    ("sim", "moorline.sim.cli", "sim"),
    ("verify", "moorline.verify.cli", "verify"),
    ("chaos", "moorline.chaos.cli", "chaos"),
    ("groups", "moorline.node.admin.groups_cli", "groups"),
    ("bench", "bench.cli", "bench"),
]

# (group name, module, typer app): commands with subcommands (``moorline certs dev``).
_GROUPS: list[tuple[str, str, str]] = [
    ("certs", "moorline.certs", "app"),
    ("cluster", "moorline.node.admin.cluster_cli", "app"),
    ("clients", "moorline.node.admin.console_cli", "clients_app"),
    ("sessions", "moorline.node.admin.console_cli", "sessions_app"),
    ("retained", "moorline.node.admin.console_cli", "retained_app"),
]

for _name, _module, _func in _COMMANDS:
    try:
        _mod = importlib.import_module(_module)
    except ModuleNotFoundError as exc:  # a layer not installed (e.g. bench outside a checkout)
        if exc.name is not None and _module.startswith(exc.name):
            continue
        raise
    app.command(_name)(getattr(_mod, _func))

for _name, _module, _attr in _GROUPS:
    app.add_typer(getattr(importlib.import_module(_module), _attr), name=_name)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
