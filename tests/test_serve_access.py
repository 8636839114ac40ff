"""``serve``'s exposure: TLS (and client certificates), and no listening beyond loopback
without access tokens and TLS unless ``--insecure`` (docs/operations.md, "Access")."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from secondbox_scheduler.infrastructure import SchedulerApplication
from secondbox_scheduler.infrastructure.access.tokens import issue_token
from secondbox_scheduler.infrastructure.cli import cli
from secondbox_scheduler.infrastructure.cli.serve import exposure, is_loopback
from secondbox_scheduler.infrastructure.http import create_app
from secondbox_scheduler.infrastructure.http.server import TlsFiles, serving_in_thread

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl(*arguments: str, cwd: Path) -> None:
    subprocess.run(["openssl", *arguments], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-signed server certificate for 127.0.0.1, a client CA and a client
    certificate it signed (EC keys: quick to make)."""
    here = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", *EC, "-keyout", "server.key", "-out", "server.pem", "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            cwd=here)  # fmt: skip
    openssl("req", "-x509", *EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=clients", cwd=here)  # fmt: skip
    openssl("req", *EC, "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=cp",
            cwd=here)  # fmt: skip
    openssl("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "client.pem", "-days", "1", cwd=here)  # fmt: skip
    return here


def test_only_loopback_addresses_count_as_loopback() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.7", "example.com", ""]))
    assert exposure("127.0.0.1", tokens=0, tls=False) == ""
    assert exposure("0.0.0.0", tokens=3, tls=True) == ""
    assert "no access token" in exposure("0.0.0.0", tokens=0, tls=True)
    assert "no TLS" in exposure("0.0.0.0", tokens=3, tls=False)


@pytest.mark.parametrize(
    ("options", "tokens", "message"),
    [
        ([], False, "no access token exists"),
        ([], True, "no TLS"),
        (["--tls-cert", "server.pem"], True, "give both --tls-cert and --tls-key"),
        (["--tls-client-ca", "ca.pem"], True, "--tls-client-ca needs --tls-cert"),
        (["--tls-cert", "server.pem", "--tls-key", "ca.key"], True, "cannot load the TLS"),
    ],
    ids=["no-tokens", "no-tls", "cert-alone", "ca-alone", "mismatched-key"],
)
def test_serve_refuses_to_listen_beyond_loopback_unprotected(
    options: list[str], tokens: bool, message: str, certificates: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    if tokens:
        app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": url})
        issue_token(app, role="auditor")
        app.close()
    arguments = [str(certificates / o) if o.endswith((".pem", ".key")) else o for o in options]
    done = CliRunner().invoke(
        cli, ["serve", "--host", "0.0.0.0", "--port", "0", "--database-url", url, *arguments]
    )
    assert done.exit_code == 2, done.output
    assert message in done.output


def _client_context(certificates: Path, *, with_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certificates / "server.pem"))
    if with_certificate:
        context.load_cert_chain(str(certificates / "client.pem"), str(certificates / "client.key"))
    return context


def test_tls_serves_https_and_still_asks_for_a_token(certificates: Path, tmp_path: Path) -> None:
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path / 't.db'}"})
    try:
        token = issue_token(app, role="auditor")
        tls = TlsFiles(str(certificates / "server.pem"), str(certificates / "server.key"))
        with serving_in_thread(create_app(app), tls=tls) as url:
            assert url.startswith("https://")
            context = _client_context(certificates, with_certificate=False)
            with httpx.Client(base_url=url, verify=context, timeout=30) as client:
                assert client.get("/healthz").status_code == 200
                assert client.get("/v1/runners").status_code == 401
                auth = {"Authorization": f"Bearer {token.token}"}
                assert client.get("/v1/runners", headers=auth).status_code == 200
            with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port
                httpx.get(url.replace("https", "http") + "/healthz", timeout=30)
    finally:
        app.close()


def test_a_client_ca_requires_a_client_certificate(certificates: Path, tmp_path: Path) -> None:
    app = SchedulerApplication(env={"SECONDBOX_DATABASE_URL": f"sqlite:///{tmp_path / 'm.db'}"})
    try:
        tls = TlsFiles(
            str(certificates / "server.pem"),
            str(certificates / "server.key"),
            str(certificates / "ca.pem"),
        )
        tls.check()
        with serving_in_thread(create_app(app), tls=tls) as url:
            signed = _client_context(certificates, with_certificate=True)
            with httpx.Client(base_url=url, verify=signed, timeout=30) as client:
                assert client.get("/healthz").status_code == 200
            unsigned = _client_context(certificates, with_certificate=False)
            with (
                pytest.raises(httpx.TransportError),
                httpx.Client(base_url=url, verify=unsigned, timeout=30) as client,
            ):
                client.get("/healthz")
    finally:
        app.close()
