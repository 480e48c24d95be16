"""moorline certs dev: a CA, a server certificate for the given names and a client certificate that
moorline's TLS contexts load and that verify each other in a real handshake."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moorline.cli import app
from moorline.config import ConfigError, TlsConfig
from moorline.node.edge.tls import TlsContexts, certificate_login, server_context

pytestmark = pytest.mark.timeout(60)


class Peer:
    """A transport whose TLS peer presented ``cert``."""

    def __init__(self, cert: object) -> None:
        self.cert = cert

    def get_extra_info(self, key: str) -> object:
        return self.cert if key == "peercert" else None


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """A TLS handshake in memory; returns (server side, client side) once both are done."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    cli = client.wrap_bio(c_in, c_out, server_hostname=name)
    done = {"s": False, "c": False}
    for _ in range(20):
        for key, obj in (("c", cli), ("s", srv)):
            if not done[key]:
                try:
                    obj.do_handshake()
                    done[key] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return srv, cli
    raise AssertionError("handshake did not finish")


def test_certs_dev_writes_a_working_ca_server_and_client(tmp_path: Path) -> None:
    out = tmp_path / "tls"
    result = CliRunner().invoke(app, ["certs", "dev", "--out", str(out), "--name", "broker.example",
                                      "--name", "10.1.2.3", "--client", "sensor-1"])
    assert result.exit_code == 0, result.output
    for name in ("ca.crt", "ca.key", "server.crt", "server.key", "client.crt", "client.key", "moorline-tls.toml"):
        assert (out / name).exists()
    assert (out / "server.key").stat().st_mode & 0o077 == 0  # keys are private
    cfg = TlsConfig(str(out / "server.crt"), str(out / "server.key"), str(out / "ca.crt"), require_client_cert=True,
                    use_identity_as_username=True)
    server = server_context(cfg)
    assert server.minimum_version >= ssl.TLSVersion.TLSv1_2
    client = ssl.create_default_context(cafile=str(out / "ca.crt"))
    client.load_cert_chain(str(out / "client.crt"), str(out / "client.key"))
    for name in ("broker.example", "10.1.2.3"):  # both names are in the server certificate
        srv, _ = _handshake(server, client, name)
        assert certificate_login(Peer(srv.getpeercert()), cfg) == "sensor-1"
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, client, "other.example")
    # a client trusting another CA refuses the server
    other = tmp_path / "other"
    assert CliRunner().invoke(app, ["certs", "dev", "--out", str(other)]).exit_code == 0
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(server, ssl.create_default_context(cafile=str(other / "ca.crt")), "broker.example")


def test_tls_config_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing.crt"):
        server_context(TlsConfig(str(tmp_path / "missing.crt"), str(tmp_path / "missing.key")))
    (tmp_path / "bad.crt").write_text("not PEM")
    with pytest.raises(ConfigError, match="bad.crt"):
        server_context(TlsConfig(str(tmp_path / "bad.crt"), str(tmp_path / "bad.crt")))


def test_reload_swaps_the_context_handshakes_use(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["certs", "dev", "--out", str(tmp_path / "a")]).exit_code == 0
    assert runner.invoke(app, ["certs", "dev", "--out", str(tmp_path / "b")]).exit_code == 0
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.crt", "server.key"):
        (live / name).write_bytes((tmp_path / "a" / name).read_bytes())
    contexts = TlsContexts(TlsConfig(str(live / "server.crt"), str(live / "server.key")))
    trust_a = ssl.create_default_context(cafile=str(tmp_path / "a" / "ca.crt"))
    trust_b = ssl.create_default_context(cafile=str(tmp_path / "b" / "ca.crt"))
    _handshake(contexts.listening, trust_a, "localhost")
    (live / "server.crt").write_text("broken")
    with pytest.raises(ConfigError):
        contexts.reload()
    _handshake(contexts.listening, trust_a, "localhost")  # a failed reload keeps the old certificate
    for name in ("server.crt", "server.key"):
        (live / name).write_bytes((tmp_path / "b" / name).read_bytes())
    contexts.reload()
    _handshake(contexts.listening, trust_b, "localhost")  # the listening context now serves b's certificate
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(contexts.listening, trust_a, "localhost")
