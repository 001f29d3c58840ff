"""EtcdStore and EmbeddedEtcd when things go wrong: bad endpoints, no server, a restarting server,
a dying parent. Waiting is on events (watch events, pidfd readiness), never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent.errors import ConfigError, StoreError, StoreUnavailable
from agent.etcd_server import EmbeddedEtcd, find_etcd_binary, free_port
from agent.etcd_store import EtcdStore, TlsOptions, format_endpoint, parse_endpoint

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[1]


# -- parse_endpoint ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:2379", [("127.0.0.1", 2379)]),
        ("etcd://10.0.0.1:2379", [("10.0.0.1", 2379)]),
        ("http://node-1.cluster:32379/", [("node-1.cluster", 32379)]),
        ("etcd://a:1,b:2,c:65535", [("a", 1), ("b", 2), ("c", 65535)]),
        ("http://a:1, http://b:2", [("a", 1), ("b", 2)]),
        ("[::1]:2379", [("::1", 2379)]),
        ("etcd://[fe80::1]:2379,127.0.0.1:2380", [("fe80::1", 2379), ("127.0.0.1", 2380)]),
        ("  localhost:2379  ", [("localhost", 2379)]),
        ("https://node1:22345,node2:22345", [("node1", 22345), ("node2", 22345)]),  # TLS: see wants_tls
    ],
)
def test_parse_endpoint_accepts(text: str, expected: list) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("localhost", "expected host:port"),
        ("localhost:", "expected host:port"),
        (":2379", "expected host:port"),
        ("host:port", "expected host:port"),
        ("host:0", "out of range"),
        ("host:65536", "out of range"),
        ("grpc://host:2379", "unknown scheme"),
        ("::1:2379", "brackets"),
        ("a:1,,b:2", "empty entry"),
        ("a:1,", "empty entry"),
        ("etcd://", "expected host:port"),
        ("host name:2379", "expected host:port"),
    ],
)
def test_parse_endpoint_rejects(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_endpoint(text)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_format_endpoint_round_trips() -> None:
    for host, port in [("127.0.0.1", 1), ("::1", 2379), ("etcd-0", 65535)]:
        assert parse_endpoint(format_endpoint(host, port)) == [(host, port)]


# -- retries -----------------------------------------------------------------------------------


def closed_port() -> int:
    """A port nobody listens on (free a moment ago; nothing here binds it)."""
    return free_port()


class FakeSleep:
    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def test_unreachable_endpoint_gives_store_unavailable_within_deadline() -> None:
    port = closed_port()
    store = EtcdStore([("127.0.0.1", port)], retry_deadline=1.5, timeout=1.0)

    async def body() -> float:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as caught:
            await store.get("/k")
        await store.close()
        assert caught.value.endpoint == f"127.0.0.1:{port}"
        assert f"127.0.0.1:{port}" in str(caught.value)
        assert "gave up after" in str(caught.value)
        return time.monotonic() - started

    elapsed = asyncio.run(body())
    assert elapsed < 1.5 + 1.0  # the deadline, plus at most one attempt's own timeout


def test_retry_policy_makes_the_expected_number_of_attempts() -> None:
    sleep = FakeSleep()
    store = EtcdStore([("127.0.0.1", closed_port())], retry_deadline=60, max_attempts=4, sleep=sleep)

    async def body() -> StoreUnavailable:
        with pytest.raises(StoreUnavailable) as caught:
            await store.put("/k", {"v": 1})
        await store.close()
        return caught.value

    error = asyncio.run(body())
    assert "gave up after 4 attempts" in str(error)
    assert len(sleep.calls) == 3  # a wait between attempts, none after the last
    assert all(0 <= s <= 2 for s in sleep.calls)
    assert type(error.__cause__).__name__ == "ConnectionFailedError"


def test_fails_over_to_the_next_endpoint(etcd_server) -> None:
    sleep = FakeSleep()
    dead = ("127.0.0.1", closed_port())
    live = parse_endpoint(etcd_server.endpoint)[0]
    store = EtcdStore([dead, live], max_attempts=3, sleep=sleep)
    assert store.endpoint == f"{format_endpoint(*dead)},{etcd_server.endpoint}"

    async def body() -> None:
        rev = await store.put("/tmrun-test/failover", {"ok": True})
        assert rev > 0
        assert (await store.get("/tmrun-test/failover")).value == {"ok": True}
        await store.delete("/tmrun-test/failover")
        await store.close()

    asyncio.run(body())
    assert len(sleep.calls) == 1  # one failed attempt on the dead endpoint, then the live one


def test_tls_options_are_checked_and_used(tmp_path: Path, etcd_server) -> None:
    with pytest.raises(ConfigError, match="both"):
        EtcdStore([("127.0.0.1", 1)], tls=TlsOptions(cert="c.pem"))
    with pytest.raises(ConfigError, match="cannot read"):
        EtcdStore([("127.0.0.1", 1)], tls=TlsOptions(cacert=str(tmp_path / "missing.pem")))
    # TLS against a plaintext server: the handshake fails, which is "unreachable".
    store = EtcdStore(parse_endpoint(etcd_server.endpoint), tls=TlsOptions(), retry_deadline=1.0, timeout=1.0)

    async def body() -> None:
        with pytest.raises(StoreUnavailable):
            await store.get("/k")
        await store.close()

    asyncio.run(body())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_round_trip_with_client_certificate(tmp_path: Path) -> None:
    pem = make_certificates(tmp_path)
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    args = [
        find_etcd_binary(), "--data-dir", str(tmp_path / "data"), "--name", "tls",
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
        "--cert-file", pem["server.crt"], "--key-file", pem["server.key"],
        "--trusted-ca-file", pem["ca.crt"], "--client-cert-auth", "--log-level", "error",
    ]  # fmt: skip
    with open(tmp_path / "etcd.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        tls = TlsOptions(cacert=pem["ca.crt"], cert=pem["client.crt"], key=pem["client.key"])
        store = EtcdStore([("127.0.0.1", port)], tls=tls, retry_deadline=15.0)

        async def body() -> None:
            rev = await store.put("/tls", {"secure": True})  # the retry policy waits for startup
            assert (await store.get("/tls")).mod_revision == rev
            await store.close()

        asyncio.run(body())
    finally:
        proc.kill()
        proc.wait()


def make_certificates(directory: Path) -> dict[str, str]:
    """A throwaway CA, and a server (IP 127.0.0.1) and a client certificate signed by it."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=tmrun-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    (directory / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-extfile", "ext.cnf", "-out", f"{name}.crt")  # fmt: skip
    return {n: str(directory / n) for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


# -- a server that goes away and comes back ----------------------------------------------------


def test_watch_resumes_after_server_restart(tmp_path: Path) -> None:
    server = EmbeddedEtcd(tmp_path / "etcd", client_port=free_port(), peer_port=free_port()).start()
    try:
        store = EtcdStore(parse_endpoint(server.endpoint), retry_deadline=15.0)

        async def body() -> None:
            first = await store.put("/r/a", {"n": 1})
            watch = await store.watch_prefix("/r/", start_revision=first)
            events = aiter(watch)
            assert (await asyncio.wait_for(anext(events), 5)).key == "/r/a"
            server.stop()
            server.start()  # same ports and data; the watch's stream broke meanwhile
            second = await store.put("/r/b", {"n": 2})
            event = await asyncio.wait_for(anext(events), 10)
            assert (event.key, event.revision) == ("/r/b", second)  # nothing lost, nothing repeated
            await watch.cancel()
            await store.close()

        asyncio.run(body())
    finally:
        server.stop()


# -- EmbeddedEtcd ------------------------------------------------------------------------------


def wait_for_exit(pid: int, timeout: float) -> bool:
    """True once process ``pid`` has exited (pidfd readiness; no polling sleeps)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        return bool(ready)
    finally:
        os.close(fd)


def test_embedded_etcd_start_stop_leaves_no_process(tmp_path: Path) -> None:
    server = EmbeddedEtcd(tmp_path / "etcd")
    with server:
        pid = server.pid
        assert server.running()
        assert server.endpoint == f"127.0.0.1:{server.client_port}"
        os.kill(pid, 0)  # alive
    assert not server.running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    server.stop()  # idempotent


def test_embedded_etcd_reports_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedEtcd(tmp_path / "etcd", client_port=taken.getsockname()[1])
        with pytest.raises(StoreError, match="address already in use"):
            server.start(timeout=10)
    assert not server.running()


def test_embedded_etcd_dies_with_its_parent(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from agent.etcd_server import EmbeddedEtcd
        server = EmbeddedEtcd({str(tmp_path / "etcd")!r}).start()
        print(server.pid, flush=True)
        sys.stdin.read()  # until the test kills us
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        etcd_pid = int(parent.stdout.readline())
        assert not wait_for_exit(etcd_pid, 0)
        parent.kill()
        parent.wait()
        assert wait_for_exit(etcd_pid, 10), "etcd outlived its parent"
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.timeout(30)
def test_a_cancelled_call_ends_even_when_the_client_turns_the_cancel_into_an_rpc_error() -> None:
    """grpc/aetcd may answer a cancelled RPC with an error of their own ("Locally cancelled by
    application!"); the retry policy must not take it for a failed attempt and go on: the agent's
    background tasks are cancelled at the end of a job, and one that lived on kept the job alive."""
    import aetcd

    async def call_that_hides_the_cancel(client):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise aetcd.ConnectionFailedError("Locally cancelled by application!") from None

    async def go():
        store = EtcdStore([("127.0.0.1", 1)], retry_deadline=60, max_attempts=1000)
        task = asyncio.ensure_future(store._call("get", call_that_hides_the_cancel))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        await store.close()

    asyncio.run(go())
