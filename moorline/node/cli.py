"""``moorline run``: start one node (the embedded default); ``moorline passwd``: manage users."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from moorline.config import LOG_LEVELS, ConfigError, load_config
from moorline.testing.faults import NO_FAULTS, Faults

# Set only by the test entry point (moorline/testing/faulty_node.py), never from the environment.
_injected_faults: Faults = NO_FAULTS


def inject_faults(faults: Faults) -> None:
    global _injected_faults
    _injected_faults = faults


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """``text`` with control characters (newlines, escape sequences) written as Python escapes."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


class EscapeControls(logging.Filter):
    """A log record's message never spans lines or carries terminal escapes, whatever a value that
    came from the network holds: a client id or peer name cannot forge a log line (issue 30.7). Values
    from the network are also logged with %r where they are; this catches every other call."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if not msg.isprintable():
            record.msg, record.args = escape_controls(msg), None
        return True


class JsonFormatter(logging.Formatter):
    """log.format = "json": one JSON object per line (ts, level, logger, msg; exc when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
                 "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=True)


def _stopped_before_start(signum: int, _frame: object) -> None:
    """SIGTERM or SIGINT before the node opens anything: a clean exit (0) that says so."""
    print(f"moorline: stopped by {signal.Signals(signum).name} during start-up", file=sys.stderr, flush=True)
    raise SystemExit(0)


def setup_logging(level: str, fmt: str) -> None:
    """The process's logging (stderr): log.level and log.format (text or json), times in UTC."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        formatter: logging.Formatter = JsonFormatter()
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    handler.addFilter(EscapeControls())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def run(
    data_dir: Annotated[Path | None, typer.Option(help="data directory [default: ./moorline-data]")] = None,
    mqtt: Annotated[str | None, typer.Option(help="MQTT listener HOST:PORT [default: 127.0.0.1:1883]")] = None,
    http: Annotated[str | None, typer.Option(help="HTTP (admin/fetch) listener HOST:PORT [default: 127.0.0.1:8888]")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML configuration file")] = None,
    shards: Annotated[int | None, typer.Option(help="shard count (fixed when the data dir is created)")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning, error [default: log.level, info]")] = None,
    node_id: Annotated[str | None, typer.Option(help="cluster: this node's name in --initial-cluster")] = None,
    cluster: Annotated[str | None, typer.Option(help="cluster: HOST:PORT for peers (outgoing traffic leaves from HOST)")] = None,
    initial_cluster: Annotated[str | None, typer.Option(help="cluster: n1=HOST:PORT,n2=HOST:PORT,n3=HOST:PORT")] = None,
    join: Annotated[str | None, typer.Option(help="cluster: join a running cluster (admitted first with `moorline "
                                             "cluster join`): HOST:PORT[,HOST:PORT] of members' --cluster")] = None,
    cluster_secret_file: Annotated[Path | None, typer.Option(help="cluster: shared secret file (required off loopback)")] = None,
    zone: Annotated[str | None, typer.Option(help="cluster: this node's zone (cluster.zone): a shard's voters "
                                             "go to distinct zones while there are enough")] = None,
) -> None:
    """Start a moorline node: one node with no cluster flags (the embedded default), else a member
    of the cluster named by --initial-cluster."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # until the event loop takes them over (server.serve)
        signal.signal(sig, _stopped_before_start)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload asked for during start-up never stops the node
    overrides: dict[str, object] = {}
    if log_level is not None:
        if log_level.lower() not in LOG_LEVELS:
            raise typer.BadParameter(f"must be one of {', '.join(LOG_LEVELS)}, not {log_level!r}",
                                     param_hint="--log-level")
        overrides["log.level"] = log_level.lower()
    for key, value in (("cluster.node_id", node_id), ("cluster.listen", cluster),
                       ("cluster.initial_cluster", initial_cluster),
                       ("cluster.join", join),
                       ("cluster.secret_file", str(cluster_secret_file) if cluster_secret_file else None),
                       ("cluster.zone", zone)):
        if value is not None:
            overrides[key] = value
    if data_dir is not None:
        overrides["data_dir"] = str(data_dir)
    if mqtt is not None:
        overrides["listeners.mqtt"] = mqtt
    if http is not None:
        overrides["listeners.http"] = http
    if shards is not None:
        overrides["shard.count"] = shards
    try:
        cfg = load_config(config, overrides, environ=dict(os.environ))
    except ConfigError as exc:
        typer.echo(f"moorline: configuration error: {exc}", err=True)
        raise typer.Exit(2) from exc
    setup_logging(cfg.log.level, cfg.log.format)
    # Everything the node creates (data directory, WAL, stores, snapshots) is private to its user:
    # 0700 directories, 0600 files; 0750 / 0640 with storage.allow_group_read.
    os.umask(0o027 if cfg.storage.allow_group_read else 0o077)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    from moorline.cluster import ClusterConfigError
    from moorline.node.edge.server import serve
    from moorline.node.replication.cluster_link import StorageMismatch
    from moorline.storage.dirlock import DataDirInUse, DataDirUnusable
    from moorline.storage.identity import StorageIdError
    from moorline.storage.wal import WalCorruption

    try:
        code = asyncio.run(serve(cfg, _injected_faults))
    except (DataDirInUse, DataDirUnusable, ClusterConfigError, StorageMismatch, StorageIdError) as exc:
        typer.echo(f"moorline: {exc}", err=True)
        raise typer.Exit(2) from exc
    except WalCorruption as exc:
        typer.echo(f"moorline: refusing to start: WAL corruption in {exc.path} at offset {exc.offset}: {exc}", err=True)
        raise typer.Exit(3) from exc
    except (ConfigError, OSError) as exc:
        typer.echo(f"moorline: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)


def passwd(
    file: Annotated[Path, typer.Argument(help="password file")],
    user: Annotated[str, typer.Argument()],
    password: Annotated[str | None, typer.Argument(help="omit to be prompted")] = None,
) -> None:
    """Add or change a user in a password file (salted scrypt hashes)."""
    from moorline.node.edge.credentials import set_password

    if password is None:
        password = typer.prompt("password", hide_input=True, confirmation_prompt=True)
    try:
        set_password(file, user, password)
    except ConfigError as exc:
        typer.echo(f"moorline passwd: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"user {user} written to {file}")


def token(
    file: Annotated[Path, typer.Argument(help="token file (auth.token_file)")],
    user: Annotated[str, typer.Argument()],
) -> None:
    """Give a user a new HTTP bearer token (replacing an earlier one); prints it once, stores its hash."""
    from moorline.node.edge.credentials import new_token

    try:
        secret = new_token(file, user)
    except ConfigError as exc:
        typer.echo(f"moorline token: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"token for {user} written (hashed) to {file}; send it as 'Authorization: Bearer <token>':",
               err=True)
    typer.echo(secret)
