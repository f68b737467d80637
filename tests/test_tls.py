"""TLS (`--ssl-certfile`, `--ssl-keyfile`) and mutual TLS (`--ssl-ca-certs`, `--ssl-cert-reqs`) over real
connections, with a CA made here: the openai and anthropic SDKs through it, client certificates refused and
accepted, certificates reloaded under a running server, handshakes bounded by the client timeout and counted
against --max-connections, and bad files refused at start-up."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server, wait_for
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NO_THINKING = {"thinking": {"type": "disabled"}}


@dataclass
class Issued:
    cert: Path
    key: Path
    serial: int


class CA:
    """A certificate authority that writes PEM files into `directory`."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory, self.name = directory, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.subject = subject
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )  # key_cert_sign, crl_sign
            .sign(self.key, hashes.SHA256())
        )
        self.pem = directory / f"{name}.pem"
        self.pem.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, cn: str, *, server: bool, stem: str | None = None) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        serial = x509.random_serial_number()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.subject)
            .public_key(key.public_key())
            .serial_number(serial)
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if server:
            san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
            usage = ExtendedKeyUsageOID.SERVER_AUTH
        else:
            usage = ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        stem = stem or cn
        out = Issued(self.directory / f"{stem}.pem", self.directory / f"{stem}.key", serial)
        out.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return out


@dataclass
class PKI:
    directory: Path
    ca: CA
    server: Issued
    client: Issued
    rogue_client: Issued  # signed by a CA the server does not trust

    def context(self, client: Issued | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca.pem))
        if client is not None:
            ctx.load_cert_chain(str(client.cert), str(client.key))
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca = CA(d, "test-ca")
    rogue = CA(d, "rogue-ca")
    return PKI(
        d,
        ca,
        ca.issue("server-1", server=True),
        ca.issue("client-1", server=False),
        rogue.issue("rogue-client", server=False),
    )


def tls_args(pki: PKI, reqs: int) -> list[str]:
    args = ["--ssl-certfile", str(pki.server.cert), "--ssl-keyfile", str(pki.server.key)]
    if reqs:
        args += ["--ssl-ca-certs", str(pki.ca.pem), "--ssl-cert-reqs", str(reqs)]
    return args


@pytest.fixture(scope="module")
def required(pki: PKI) -> Iterator[Server]:
    """Mutual TLS with a client certificate required."""
    srv = start_server("--served-model-name", MODEL, *tls_args(pki, 2))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def optional(pki: PKI) -> Iterator[Server]:
    """Client certificates asked for and checked when sent, not required."""
    srv = start_server("--served-model-name", MODEL, *tls_args(pki, 1))
    yield srv
    srv.stop()


def port(srv: Server) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def served_serial(srv: Server, pki: PKI) -> int:
    """The serial number of the certificate a new connection is given."""
    with (
        socket.create_connection(("127.0.0.1", port(srv)), timeout=5) as raw,
        pki.context().wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def refusal(srv: Server, ctx: ssl.SSLContext) -> str:
    """What a raw TLS client with `ctx` gets for a request: the alert that ended it, or the status line."""
    try:
        with (
            socket.create_connection(("127.0.0.1", port(srv)), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            tls.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return tls.recv(64).decode(errors="replace").split("\r\n")[0]
    except ssl.SSLError as e:
        return f"alert {e.reason}"


def test_the_sdks_over_mutual_tls(required: Server, pki: PKI) -> None:
    ctx = pki.context(pki.client)
    assert required.url.startswith("https://127.0.0.1:")
    hi = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(
        base_url=f"{required.url}/v1", api_key="k", max_retries=0, http_client=openai.DefaultHttpxClient(verify=ctx)
    ) as client:
        r = client.chat.completions.create(model=MODEL, messages=hi, max_tokens=8, extra_body=NO_THINKING)
        assert r.choices[0].message.content and r.usage is not None and r.usage.completion_tokens > 0
        stream = client.chat.completions.create(
            model=MODEL,
            messages=hi,
            max_tokens=8,
            stream=True,
            extra_body=NO_THINKING,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with anthropic.Anthropic(
        base_url=required.url, api_key="k", max_retries=0, http_client=anthropic.DefaultHttpxClient(verify=ctx)
    ) as claude:
        m = claude.messages.create(model=MODEL, max_tokens=8, messages=hi)
        assert m.content and m.content[0].type == "text" and m.content[0].text
        with claude.messages.stream(model=MODEL, max_tokens=8, messages=hi) as s:
            assert "".join(s.text_stream)


def test_a_required_client_certificate_is_required(required: Server, pki: PKI) -> None:
    with (
        openai.OpenAI(
            base_url=f"{required.url}/v1",
            api_key="k",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=pki.context()),
        ) as anonymous,
        pytest.raises(openai.APIConnectionError),
    ):
        anonymous.models.list()
    assert refusal(required, pki.context()) == "alert TLSV13_ALERT_CERTIFICATE_REQUIRED"
    assert refusal(required, pki.context(pki.rogue_client)) == "alert TLSV1_ALERT_UNKNOWN_CA"
    assert refusal(required, pki.context(pki.client)) == "HTTP/1.1 200 OK"
    # Plain HTTP on the TLS port gets no HTTP answer.
    with pytest.raises(httpx.HTTPError):
        httpx.get(required.url.replace("https://", "http://") + "/health", timeout=5)


def test_an_optional_client_certificate_is_checked_when_sent(optional: Server, pki: PKI) -> None:
    assert refusal(optional, pki.context()) == "HTTP/1.1 200 OK"
    assert refusal(optional, pki.context(pki.client)) == "HTTP/1.1 200 OK"
    assert refusal(optional, pki.context(pki.rogue_client)) == "alert TLSV1_ALERT_UNKNOWN_CA"
    with httpx.Client(base_url=optional.url, verify=pki.context(), timeout=30) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == MODEL
    # The server's own certificate is checked by the client as usual: a client that trusts another CA refuses it.
    stranger = ssl.create_default_context(cafile=str(pki.directory / "rogue-ca.pem"))
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{optional.url}/health", verify=stranger, timeout=5)


def replace(dst: Path, src: Path) -> None:
    """Swap in a file by rename, as a Kubernetes Secret volume swaps its files."""
    tmp = dst.with_suffix(".tmp")
    tmp.write_bytes(src.read_bytes())
    os.replace(tmp, dst)


def wait_for_serial(srv: Server, pki: PKI, serial: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while served_serial(srv, pki) != serial:
        assert time.monotonic() < deadline, f"the server never served certificate {serial:x}:\n{srv.log()[-2000:]}"
        time.sleep(0.2)


def test_new_certificates_are_loaded_without_a_restart(pki: PKI, tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    replace(cert, pki.server.cert)
    replace(key, pki.server.key)
    srv = start_server("--served-model-name", MODEL, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    try:
        old = pki.server.serial
        assert served_serial(srv, pki) == old
        with httpx.Client(base_url=srv.url, verify=pki.context(), timeout=30) as kept:
            first = kept.get("/health")
            assert first.status_code == 200
            stream = first.extensions["network_stream"]

            # Files that do not load (a certificate without its key) keep the current certificate.
            renewed = pki.ca.issue("server-2", server=True, stem="server-2")
            replace(cert, renewed.cert)
            deadline = time.monotonic() + 15
            while "keeping the current certificate" not in srv.log():
                assert time.monotonic() < deadline, srv.log()[-2000:]
                time.sleep(0.2)
            assert served_serial(srv, pki) == old

            # Its key too: new connections get the new certificate (new serial, new CN).
            replace(key, renewed.key)
            wait_for_serial(srv, pki, renewed.serial)
            wait_for("the reload's log line", lambda: "loaded the new certificate" in srv.log(), timeout=10)
            with (
                socket.create_connection(("127.0.0.1", port(srv))) as raw,
                pki.context().wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                peer = tls.getpeercert()
            assert tuple(x for x in peer["subject"]) == ((("commonName", "server-2"),),)

            # The connection opened before keeps its session and keeps working.
            again = kept.get("/v1/models")
            assert again.status_code == 200
            assert again.extensions["network_stream"] is stream, "the keep-alive connection was reused"
            der = stream.get_extra_info("ssl_object").getpeercert(True)
            assert x509.load_der_x509_certificate(der).serial_number == old
    finally:
        assert srv.stop() == 0


def test_a_client_that_never_finishes_its_handshake_is_cut_and_holds_a_connection_slot(pki: PKI) -> None:
    srv = start_server(
        "--served-model-name", MODEL, *tls_args(pki, 0), "--client-timeout", "1.5", "--max-connections", "2"
    )
    try:
        silent = [socket.create_connection(("127.0.0.1", port(srv))) for _ in range(2)]
        time.sleep(0.2)  # both accepted, both holding a slot
        started = time.monotonic()
        waited: list[float] = []

        def request() -> None:
            r = httpx.get(f"{srv.url}/health", verify=pki.context(), timeout=30)
            assert r.status_code == 200
            waited.append(time.monotonic() - started)

        t = threading.Thread(target=request)
        t.start()
        for s in silent:
            s.settimeout(10)
            assert s.recv(1) == b"", "cut without a handshake"
        cut = time.monotonic() - started
        t.join(15)
        assert 1.0 <= cut <= 4.0, cut
        # The request waited in the backlog until the silent clients' slots were freed.
        assert waited and waited[0] >= 1.0, waited
        for s in silent:
            s.close()
    finally:
        srv.stop()


def test_tls_over_a_unix_socket(pki: PKI, tmp_path: Path) -> None:
    path = tmp_path / "tls.sock"
    srv = start_server("--served-model-name", MODEL, *tls_args(pki, 2), "--uds", str(path))
    try:
        assert srv.url == f"https+unix:{path}"
        transport = httpx.HTTPTransport(uds=str(path), verify=pki.context(pki.client))
        with httpx.Client(transport=transport, base_url="https://127.0.0.1", timeout=30) as c:
            assert c.get("/health").json() == {"status": "ok"}
        anonymous = httpx.HTTPTransport(uds=str(path), verify=pki.context())
        with (
            httpx.Client(transport=anonymous, base_url="https://127.0.0.1", timeout=30) as c,
            pytest.raises(httpx.HTTPError),
        ):
            c.get("/health")
    finally:
        assert srv.stop() == 0


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "deepinfer_server", "--port", "0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "case",
    ["missing certificate", "not a certificate", "key of another certificate", "reqs without a CA", "CA alone"],
)
def test_bad_tls_options_stop_the_start_up_with_one_line(pki: PKI, tmp_path: Path, case: str) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    other = pki.ca.issue("other", server=True, stem="other")
    cert, key = str(pki.server.cert), str(pki.server.key)
    args, needle = {
        "missing certificate": (["--ssl-certfile", str(tmp_path / "nope.pem"), "--ssl-keyfile", key], "nope.pem"),
        "not a certificate": (["--ssl-certfile", str(garbage), "--ssl-keyfile", key], "garbage.pem"),
        "key of another certificate": (["--ssl-certfile", cert, "--ssl-keyfile", str(other.key)], "other.key"),
        "reqs without a CA": (["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"], "--ssl-ca-certs"),
        "CA alone": (
            ["--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", str(pki.ca.pem)],
            "--ssl-cert-reqs",
        ),
    }[case]
    r = run_cli(*args)
    assert r.returncode == 2, r
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("deepinfer-server: error: ") and needle in last, r.stderr
    assert "Traceback" not in r.stderr and "panicked" not in r.stderr
