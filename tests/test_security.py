"""The job's etcd is closed: only holders of the user's credentials get in (agent/credentials.py).

Real etcd servers with TLS and client-certificate authentication; a real second Unix user.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys

import pytest

from agent.credentials import check_private, server_certificate, user_credentials
from agent.errors import ConfigError, StoreError
from agent.etcd_server import EmbeddedEtcd
from agent.etcd_store import EtcdStore, TlsOptions, client_tls, parse_endpoint
from tests.harness import run_tmrun

pytestmark = pytest.mark.timeout(60)


def test_credentials_are_private_and_made_once(tmp_path):
    creds = user_credentials(tmp_path / "c")
    assert stat.S_IMODE(os.lstat(creds.directory).st_mode) == 0o700
    for path in (creds.ca, creds.ca_key, creds.client, creds.client_key):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600, path
    again = user_credentials(tmp_path / "c")
    assert again.ca.read_bytes() == creds.ca.read_bytes()  # the same CA, not a new one


def test_credentials_open_to_others_are_refused(tmp_path):
    creds = user_credentials(tmp_path / "c")
    os.chmod(creds.directory, 0o750)
    with pytest.raises(ConfigError, match=r"mode 0750 lets others in; chmod 700"):
        user_credentials(tmp_path / "c")
    os.chmod(creds.directory, 0o700)
    os.chmod(creds.client_key, 0o644)
    with pytest.raises(ConfigError, match=r"client-key.pem: mode 0644"):
        user_credentials(tmp_path / "c")


def test_a_planted_link_is_never_followed(tmp_path):
    creds = user_credentials(tmp_path / "c")
    target = tmp_path / "elsewhere.pem"
    target.write_bytes(creds.client_key.read_bytes())
    os.chmod(target, 0o600)
    creds.client_key.unlink()
    creds.client_key.symlink_to(target)
    with pytest.raises(ConfigError, match="it is a symbolic link"):
        user_credentials(tmp_path / "c")
    # nor a directory planted as a link: the job's member directory is refused, nothing written there
    real = user_credentials(tmp_path / "d")
    (tmp_path / "victim").mkdir(mode=0o700)
    (tmp_path / "member").symlink_to(tmp_path / "victim")
    with pytest.raises(ConfigError, match="it is a symbolic link"):
        server_certificate(real, tmp_path / "member", ["localhost"])
    assert not list((tmp_path / "victim").iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand the directory to another user")
def test_a_directory_of_another_user_is_refused(tmp_path):
    creds = user_credentials(tmp_path / "c")
    os.chown(creds.directory, 65534, 65534)
    with pytest.raises(ConfigError, match=r"owned by uid 65534, not by you"):
        check_private(creds.directory, directory=True)


@pytest.fixture(scope="module")
def closed_etcd(tmp_path_factory):
    root = tmp_path_factory.mktemp("closed")
    creds = user_credentials(root / "creds")
    tls = server_certificate(creds, root / "etcd" / "tls", ["localhost", "127.0.0.1"])
    server = EmbeddedEtcd(root / "etcd", tls=tls).start()
    yield server, creds
    server.stop()


def _put(endpoint: str, tls: TlsOptions | None) -> None:
    async def go():
        store = EtcdStore(parse_endpoint(endpoint), tls=tls, retry_deadline=2, max_attempts=2)
        try:
            await store.put("/tmrun/closed/k", {"v": 1})
        finally:
            await store.close()

    asyncio.run(go())


def test_only_holders_of_the_credentials_get_in(closed_etcd, tmp_path):
    server, creds = closed_etcd
    assert server.url.startswith("https://")
    _put(server.url, client_tls(server.url, None, None, None, creds.directory))  # the user: in
    with pytest.raises(StoreError):
        _put(server.endpoint, None)  # plain HTTP
    with pytest.raises(StoreError):
        _put(server.url, TlsOptions(str(creds.ca)))  # TLS, but no client certificate
    stranger = user_credentials(tmp_path / "stranger")  # a certificate, from another CA
    with pytest.raises(StoreError):
        _put(server.url, TlsOptions(str(creds.ca), str(stranger.client), str(stranger.client_key)))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_local_user_is_refused(closed_etcd):
    server, creds = closed_etcd
    script = (
        "import asyncio, sys\n"
        "from agent.etcd_store import EtcdStore, TlsOptions, parse_endpoint\n"
        "from agent.errors import ConfigError, StoreError\n"
        f"ca, cert, key = {str(creds.ca)!r}, {str(creds.client)!r}, {str(creds.client_key)!r}\n"
        "try:\n"
        "    open(key, 'rb')\n"
        "    print('read the key'); sys.exit(1)\n"
        "except PermissionError:\n"
        "    print('key: permission denied')\n"
        "async def go():\n"
        f"    store = EtcdStore(parse_endpoint({server.url!r}), retry_deadline=2, max_attempts=2)\n"
        "    try:\n"
        "        await store.put('/tmrun/closed/x', {'v': 1})\n"
        "    finally:\n"
        "        await store.close()\n"
        "try:\n"
        "    asyncio.run(go())\n"
        "    print('got in'); sys.exit(1)\n"
        "except StoreError as exc:\n"
        "    print('etcd: refused')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "HOME": "/nonexistent"}
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                           script], capture_output=True, text=True, env=env, timeout=50, cwd="/")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split("\n")[:2] == ["key: permission denied", "etcd: refused"], done.stdout


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_the_local_cluster_etcd_is_closed(jobs, tmp_path):
    """A running local job: its runtime file names https://, status gets in, a plain client does not."""
    from tests.harness import job_ref, wait_status
    from tmrun.jobs import running_jobs, runtime_dir

    gate = tmp_path / "gate"
    waiter = tmp_path / "wait_for_gate.py"
    waiter.write_text(f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.05)\n")
    job = jobs(["--nnodes", "1", str(waiter)])
    try:
        ref = job_ref(job)
        assert ref.endpoint.startswith("https://127.0.0.1:"), ref
        wait_status(ref, lambda d: d["state"] == "running", 60)
        status = run_tmrun(["status", "--json"], cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        with pytest.raises(StoreError):
            _put(ref.endpoint.removeprefix("https://"), None)
        assert [r.job for r in running_jobs(runtime_dir(os.environ))] == [ref.job]
    finally:
        gate.touch()
    assert job.wait(60) == 0


@pytest.fixture(scope="module")
def etcd_with_users(tmp_path_factory):
    """An external etcd with etcd's own authentication on (user root), tokens valid for 1 s of idleness."""
    import grpc
    from aetcd import rpc

    server = EmbeddedEtcd(tmp_path_factory.mktemp("auth"), extra_args=("--auth-token-ttl", "1")).start()

    async def enable():
        async with grpc.aio.insecure_channel(server.endpoint) as channel:
            auth = rpc.AuthStub(channel)
            await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="s3cret"))
            await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
            await auth.AuthEnable(rpc.AuthEnableRequest())

    asyncio.run(enable())
    yield server
    server.stop()


def test_an_external_etcd_with_a_user_name_and_password(etcd_with_users, tmp_path):
    import time

    from agent.etcd_store import Login

    password = tmp_path / "password"
    password.write_text("s3cret\n")
    os.chmod(password, 0o600)

    async def go(login, idle: float = 0.0):
        store = EtcdStore(parse_endpoint(etcd_with_users.endpoint), login=login, retry_deadline=2, max_attempts=2)
        try:
            await store.put("/tmrun/auth/k", {"v": 1})
            time.sleep(idle)  # the token expires while the client is idle (a TTL, not a synchronisation)
            return (await store.get("/tmrun/auth/k")).value
        finally:
            await store.close()

    assert asyncio.run(go(Login("root", str(password)), idle=2.5)) == {"v": 1}  # logs in again
    with pytest.raises(StoreError, match="user name is empty"):
        asyncio.run(go(None))
    # the commands take the same through the environment; a password file open to others is refused
    env = {"TMRUN_ETCD_USER": "root", "TMRUN_ETCD_PASSWORD_FILE": str(password)}
    status = run_tmrun(["status", "--rdzv-endpoint", etcd_with_users.endpoint, "--job", "nope"], cwd=tmp_path, env=env)
    assert status.returncode == 5 and status.stderr.startswith("tmrun: error: no job 'nope'"), status.stderr
    os.chmod(password, 0o644)
    status = run_tmrun(["status", "--rdzv-endpoint", etcd_with_users.endpoint, "--job", "nope"], cwd=tmp_path, env=env)
    assert status.returncode == 2 and "mode 0644 lets others in" in status.stderr, status.stderr
    assert len(status.stderr.strip().splitlines()) == 1, status.stderr
