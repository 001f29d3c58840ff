"""The :class:`~agent.store.Store` over a real etcd, through ``aetcd``.

This is the only module that imports ``aetcd`` or ``grpc``; their errors end here::

    aetcd ConnectionFailedError, ConnectionTimeoutError, WatchTimeoutError, and the answers of a
    member that cannot serve for the moment ("raft: stopped", "leader changed", ...)
        retried (jittered exponential wait, bounded by a deadline and an attempt count),
        moving to the next endpoint each time; then StoreUnavailable
    aetcd RevisionCompactedError    StoreCompacted
    any other aetcd ClientError     StoreError

Values are JSON objects, encoded compactly with sorted keys; keys are UTF-8. A value that is not
a JSON object (or a key that is not UTF-8), written by some other client, is skipped on every read
and watch with one warning (:mod:`agent.skipped`), never raised.

What ``aetcd`` does not do, and this module adds:

- TLS: ``aetcd.Client`` only opens insecure channels; :class:`_Client` opens its own channel
  (secure when :class:`TlsOptions` are given) and also writes IPv6 targets correctly.
- Several endpoints: one client per endpoint, made on first use; a connection failure moves the
  store to the next endpoint for the following attempt (failover in list order).
- A watch that survives a broken stream: it is re-created from the revision after the last event
  it delivered (see :class:`_EtcdWatch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, TypeVar

# gRPC's default DNS resolver (c-ares) asks the DNS servers and may never look in /etc/hosts, where
# cluster host names often live; the system resolver does what every other program on the node does.
os.environ.setdefault("GRPC_DNS_RESOLVER", "native")

import aetcd  # noqa: E402
import grpc  # noqa: E402
import tenacity
from aetcd import rpc  # noqa: E402

from agent.address import format_endpoint
from agent.errors import ConfigError, LeaseNotFound, StoreCompacted, StoreError, StoreUnavailable
from agent.skipped import decode_key, decode_value
from agent.store import Entry, Event, Store, Watch

T = TypeVar("T")

MAX_ATTEMPTS = 10
SCHEMES = ("etcd", "http", "https")
CANCEL_TIMEOUT = 2.0  # seconds to wait for aetcd to enqueue a watch cancel request

_RETRYABLE = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, aetcd.WatchTimeoutError)

# What an etcd member answers while it cannot serve for the moment (stopping, electing a leader,
# overloaded, being removed): worth the next attempt, on the next endpoint.
_TRANSIENT = ("raft: stopped", "leader changed", "request timed out", "no leader", "server stopped",
              "too many requests", "not capable", "unhealthy cluster", "member has been permanently removed",
              "context deadline exceeded", "request cancelled", "timed out",
              "No status received")  # the call's connection closed under it (a member stopping)


def _cancelling() -> bool:
    """Whether the task running now has been asked to stop."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _client_error(exc: grpc.aio.AioRpcError) -> aetcd.ClientError:
    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return aetcd.ConnectionFailedError(exc.details())
    return aetcd.ClientError(exc.details())

# Keepalive pings so that a watch on a silently dead server fails instead of hanging. etcd's
# default enforcement allows one ping per 5 s.
_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
)


@dataclasses.dataclass(frozen=True)
class Member:
    """One member of the etcd cluster, as ``member list`` shows it."""

    id: int
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TlsOptions:
    """PEM files for a TLS connection; all optional (no cacert: the system's roots)."""

    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("TLS needs both a client certificate and its key, or neither")
        try:
            root, cert, key = (Path(p).read_bytes() if p else None for p in (self.cacert, self.cert, self.key))
        except OSError as exc:
            raise ConfigError(f"cannot read TLS file: {exc}") from exc
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)


@dataclasses.dataclass(frozen=True)
class Login:
    """etcd's own authentication: a user name and a file holding the password (0600, the user's own)."""

    user: str
    password_file: str

    def password(self) -> str:
        from agent.credentials import check_private

        check_private(Path(self.password_file), directory=False)
        try:
            text = Path(self.password_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the etcd password file {self.password_file}: {exc}") from exc
        return text.rstrip("\r\n")


# -- endpoints ---------------------------------------------------------------------------------

_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.%\w]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>\d+)$")


def parse_endpoint(text: str) -> list[tuple[str, int]]:
    """``etcd://h:p[,h:p...]``, ``h:p``, ``http://h:p`` or ``[::1]:p`` to a list of (host, port).

    Raises ConfigError with a one-line message on anything else.
    """
    items = [item.strip() for item in (text or "").strip().split(",")]
    if not any(items):
        raise ConfigError("etcd endpoint is empty; expected host:port")
    return [_parse_one(item, text) for item in items]


def _parse_one(item: str, whole: str) -> tuple[str, int]:
    if not item:
        raise ConfigError(f"empty entry in etcd endpoint list {whole!r}")
    if "://" in item:
        scheme, item = item.split("://", 1)
        if scheme.lower() not in SCHEMES:
            raise ConfigError(f"unknown scheme {scheme + '://'!r} in etcd endpoint {whole!r}; "
                              "use etcd://, http:// or https://")
        item = item.rstrip("/")
    match = _HOST_PORT.match(item)
    if match is None:
        if item.count(":") > 1 and not item.startswith("["):
            raise ConfigError(f"IPv6 address in etcd endpoint {whole!r} needs brackets, as in [::1]:2379")
        raise ConfigError(f"malformed etcd endpoint {item!r}; expected host:port")
    port = int(match["port"])
    if not 0 < port < 65536:
        raise ConfigError(f"port {port} out of range in etcd endpoint {item!r}")
    return (match["v6"] or match["host"], port)


def wants_tls(text: str) -> bool:
    """Whether an endpoint list asks for TLS (any entry written ``https://``)."""
    return any(item.strip().lower().startswith("https://") for item in (text or "").split(","))


def client_tls(endpoint: str, cacert: str | None, cert: str | None, key: str | None,
               credentials: Path | None) -> TlsOptions | None:
    """How to reach ``endpoint``: the TLS files given, else for an ``https://`` endpoint the user's
    tmrun credentials (``credentials``, their directory; see agent/credentials.py), else plain."""
    if cacert or cert or key:
        return TlsOptions(cacert, cert, key)
    if not wants_tls(endpoint):
        return None
    if credentials is None:
        raise ConfigError(f"etcd endpoint {endpoint!r} asks for TLS: give --etcd-cacert/--etcd-cert/--etcd-key")
    from agent.credentials import UserCredentials, checked

    creds = checked(UserCredentials(credentials))
    return TlsOptions(str(creds.ca), str(creds.client), str(creds.client_key))


# -- the client --------------------------------------------------------------------------------


class _Client(aetcd.Client):
    """``aetcd.Client`` over a channel of our making: IPv6-safe target, TLS when asked."""

    def __init__(self, host: str, port: int, *, timeout: float, credentials: grpc.ChannelCredentials | None,
                 login: Login | None = None):
        super().__init__(host=host, port=port, timeout=timeout)
        self._target = format_endpoint(host, port)
        self._credentials = credentials
        self._login = login
        self._lease_stream = None  # the LeaseKeepAlive stream (keep_lease_alive), opened on first use
        self._lease_lock = asyncio.Lock()

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._credentials is None:
            self.channel = grpc.aio.insecure_channel(self._target, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.aio.secure_channel(self._target, self._credentials, options=_CHANNEL_OPTIONS)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout)
        if self._login is not None:
            await self.authenticate()
        self._connected.set()

    async def authenticate(self) -> None:
        """Log in with the user name and password (again when etcd says the token expired)."""
        assert self._login is not None
        try:
            reply = await rpc.AuthStub(self.channel).Authenticate(
                rpc.AuthenticateRequest(name=self._login.user, password=self._login.password()), timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            raise _client_error(exc) from exc
        self.metadata = (("token", reply.token),)
        self._watcher._metadata = self.metadata  # aetcd's watcher keeps its own copy
        self._drop_lease_stream()  # opened with the old token

    async def keep_lease_alive(self, lease: int):
        """One LeaseKeepAlive on a stream kept open between refreshes (aetcd's ``refresh_lease``
        opens and abandons a stream per refresh: its setup and teardown cost the agent and etcd a
        dozen wake-ups each, once a second for every agent). Any error or cancel closes the
        stream, so a reply is never read for the wrong request; the next refresh opens another."""
        await self.connect()
        async with self._lease_lock:
            try:
                if self._lease_stream is not None and self._lease_stream.done():  # ended while idle (etcd went away)
                    self._drop_lease_stream()
                if self._lease_stream is None:
                    self._lease_stream = self.leasestub.LeaseKeepAlive(metadata=self.metadata)
                await asyncio.wait_for(self._lease_stream.write(rpc.LeaseKeepAliveRequest(ID=lease)), self._timeout)
                reply = await asyncio.wait_for(self._lease_stream.read(), self._timeout)
            except asyncio.TimeoutError:
                self._drop_lease_stream()
                raise aetcd.ConnectionTimeoutError("no answer to a lease keepalive in time") from None
            except asyncio.InvalidStateError as exc:  # gRPC's word for a write on a call that ended
                self._drop_lease_stream()
                raise aetcd.ConnectionFailedError(f"the lease keepalive stream ended: {exc}") from None
            except BaseException:
                self._drop_lease_stream()
                raise
            if reply is grpc.aio.EOF:
                self._drop_lease_stream()
                raise aetcd.ConnectionFailedError("etcd closed the lease keepalive stream")
            return reply

    def _drop_lease_stream(self) -> None:
        stream, self._lease_stream = getattr(self, "_lease_stream", None), None
        if stream is not None:
            stream.cancel()

    async def close(self) -> None:
        self._drop_lease_stream()
        await super().close()


def _encode(value: dict) -> bytes:
    if not isinstance(value, dict):
        raise TypeError(f"store values are dicts, not {type(value).__name__}")
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


def _entry(kv) -> Entry | None:
    """The entry, or None when its key or value is not what tmrun stores (warned once)."""
    key = decode_key(kv.key)
    value = None if key is None else decode_value(key, kv.value, kv.mod_revision)
    if value is None:
        return None
    return Entry(key, value, kv.create_revision, kv.mod_revision, kv.lease)


def _check_prefix(prefix: str) -> None:
    if not prefix:
        raise ValueError("an empty prefix would mean every key; give a non-empty prefix")


def _is_not_found(exc: BaseException) -> bool:
    cause = exc.__cause__
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.NOT_FOUND


class EtcdStore(Store):
    """A Store on one etcd cluster, reached through any of ``endpoints`` (tried in order)."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        *,
        tls: TlsOptions | None = None,
        login: Login | None = None,
        timeout: float = 5.0,
        retry_deadline: float = 20.0,
        max_attempts: int = MAX_ATTEMPTS,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not endpoints:
            raise ConfigError("EtcdStore needs at least one endpoint")
        self._endpoints = list(endpoints)
        self.endpoint = ",".join(format_endpoint(h, p) for h, p in self._endpoints)
        self._credentials = tls.credentials() if tls else None
        self._login = login  # its password file is checked by the CLI before anything starts
        self._timeout = timeout
        self._retry_deadline = retry_deadline
        self._max_attempts = max_attempts
        self._sleep = sleep
        self._clients: dict[int, _Client] = {}
        self._current = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"EtcdStore({self.endpoint!r})"

    # -- the retry boundary --------------------------------------------------------------------

    def _policy(self) -> tenacity.AsyncRetrying:
        return tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(_RETRYABLE),
            stop=tenacity.stop_before_delay(self._retry_deadline) | tenacity.stop_after_attempt(self._max_attempts),
            wait=tenacity.wait_random_exponential(multiplier=0.1, max=2),
            sleep=self._sleep,
        )

    def _client(self, index: int) -> _Client:
        client = self._clients.get(index)
        if client is None:
            host, port = self._endpoints[index]
            client = _Client(host, port, timeout=self._timeout, credentials=self._credentials, login=self._login)
            self._clients[index] = client
        return client

    async def _attempt(self, fn: Callable[[_Client], Awaitable[T]]) -> T:
        try:
            return await self._attempt_once(fn)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError) and _cancelling():
                # gRPC or aetcd turned our own cancellation into an RPC error; retrying it would
                # swallow the cancel, and the task that was told to stop would go on for ever
                raise asyncio.CancelledError from exc
            raise

    async def _attempt_once(self, fn: Callable[[_Client], Awaitable[T]]) -> T:
        if self._closed:
            raise StoreError(f"store for {self.endpoint} is closed")
        index = self._current
        client = self._client(index)
        try:
            try:
                return await fn(client)
            except grpc.aio.AioRpcError as exc:  # aetcd's async generators (member list) let these through
                raise _client_error(exc) from exc
            except aetcd.ClientError as exc:
                if self._login is not None and "invalid auth token" in str(exc):  # the token expired: log in again
                    await client.authenticate()
                    return await fn(client)
                if not isinstance(exc, _RETRYABLE) and any(text in str(exc) for text in _TRANSIENT):
                    raise aetcd.ConnectionFailedError(str(exc)) from exc
                raise
        except _RETRYABLE:
            if self._current == index:  # the first to see this endpoint fail moves everyone on
                self._current = (index + 1) % len(self._endpoints)
            raise

    async def _call(self, what: str, fn: Callable[[_Client], Awaitable[T]]) -> T:
        """Run one RPC under the retry policy; every aetcd error becomes a StoreError here."""
        started = time.monotonic()
        try:
            return await self._policy()(self._attempt, fn)
        except tenacity.RetryError as exc:
            last = exc.last_attempt
            raise StoreUnavailable(
                self.endpoint,
                f"gave up after {last.attempt_number} attempts in {time.monotonic() - started:.1f} s",
            ) from last.exception()
        except aetcd.RevisionCompactedError as exc:
            raise StoreCompacted(exc.compacted_revision) from exc
        except aetcd.ClientError as exc:
            if "lease not found" in str(exc) or _is_not_found(exc) and "lease" in what:
                raise LeaseNotFound(f"etcd {what} failed: {exc}") from exc
            raise StoreError(f"etcd {what} failed: {exc}") from exc

    # -- reads and writes ----------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        got = await self._call("get", lambda c: c.get(key.encode()))
        return None if got is None else _entry(got)

    async def stat(self, key: str) -> tuple[int, int]:
        raw = key.encode()
        got = await self._call("stat", lambda c: c.get_prefix(raw, keys_only=True))
        return next((kv.mod_revision for kv in got.kvs if kv.key == raw), 0), got.header.revision

    async def get_and_stat(self, key: str, other: str) -> tuple[Entry | None, int, int]:
        raw, other_raw = key.encode(), other.encode()
        request = rpc.TxnRequest(success=[rpc.RequestOp(request_range=rpc.RangeRequest(key=raw)),
                                          rpc.RequestOp(request_range=rpc.RangeRequest(key=other_raw, keys_only=True))])

        async def txn(c: _Client):
            await c.connect()
            return await c.kvstub.Txn(request, timeout=self._timeout, metadata=c.metadata)

        reply = await self._call("get_and_stat", txn)
        got, stat = (r.response_range for r in reply.responses)
        entry = next((_entry(kv) for kv in got.kvs if kv.key == raw), None)
        mod = next((kv.mod_revision for kv in stat.kvs if kv.key == other_raw), 0)
        return entry, mod, reply.header.revision

    async def keys(self, prefix: str) -> list[str]:
        _check_prefix(prefix)
        got = await self._call("keys", lambda c: c.get_prefix(prefix.encode(), keys_only=True))
        return sorted(key for key in (decode_key(kv.key) for kv in got.kvs) if key is not None)

    async def get_prefix(self, prefix: str) -> tuple[dict[str, Entry], int]:
        _check_prefix(prefix)
        got = await self._call("get_prefix", lambda c: c.get_prefix(prefix.encode()))
        entries = (_entry(kv) for kv in got.kvs)
        return {e.key: e for e in entries if e is not None}, got.header.revision

    async def put(self, key: str, value: dict, *, lease: int = 0) -> int:
        data = _encode(value)
        done = await self._call("put", lambda c: c.put(key.encode(), data, lease=lease))
        return done.header.revision

    async def put_raw(self, key: str, data: bytes) -> int:
        """Write ``data`` as it is, as another etcd client could (tests of what tmrun reads)."""
        done = await self._call("put", lambda c: c.put(key.encode(), data))
        return done.header.revision

    async def create(self, key: str, value: dict, *, lease: int = 0) -> bool:
        return await self.replace(key, value, mod_revision=0, lease=lease)

    async def replace(self, key: str, value: dict, *, mod_revision: int, lease: int = 0) -> bool:
        data, raw = _encode(value), key.encode()

        async def txn(c: _Client) -> bool:
            tx = c.transactions
            compare = tx.create(raw) == 0 if mod_revision == 0 else tx.mod(raw) == mod_revision
            succeeded, _ = await c.transaction(compare=[compare], success=[tx.put(raw, data, lease=lease)], failure=[])
            return succeeded

        return await self._call("replace", txn)

    async def delete(self, key: str) -> bool:
        done = await self._call("delete", lambda c: c.delete(key.encode()))
        return done is not None

    async def delete_prefix(self, prefix: str) -> int:
        _check_prefix(prefix)
        done = await self._call("delete_prefix", lambda c: c.delete_prefix(prefix.encode()))
        return done.deleted

    async def compact(self, revision: int) -> None:
        """Drop history below ``revision`` (watches from earlier revisions then fail)."""
        await self._call("compact", lambda c: c.compact(revision, physical=True))

    # -- cluster membership (the embedded etcd cluster's keeper, agent/etcd_cluster.py) -----------

    async def members(self) -> list[Member]:
        """The etcd cluster's members; a member added but not started yet has an empty name."""
        async def listing(c: _Client) -> list[Member]:
            return [Member(m.id, m.name, tuple(m.peer_urls), tuple(m.client_urls)) async for m in c.members()]

        return await self._call("member list", listing)

    async def add_member(self, peer_url: str) -> int:
        """``member add``: the cluster expects a new member at ``peer_url``; returns its id."""
        member = await self._call("member add", lambda c: c.add_member([peer_url]))
        return member.id

    async def remove_member(self, member_id: int) -> None:
        """``member remove``; a member that is already gone is not an error."""
        async def remove(c: _Client) -> None:
            try:
                await c.remove_member(member_id)
            except aetcd.ClientError as exc:
                if not _is_not_found(exc):
                    raise

        await self._call("member remove", remove)

    # -- leases --------------------------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> int:
        lease = await self._call("grant_lease", lambda c: c.lease(ttl))
        return lease.id

    async def refresh_lease(self, lease: int) -> int:
        reply = await self._call("refresh_lease", lambda c: c.keep_lease_alive(lease))
        return 0 if reply is None else max(0, reply.TTL)

    async def revoke_lease(self, lease: int) -> None:
        async def revoke(c: _Client) -> None:
            try:
                await c.revoke_lease(lease)
            except aetcd.ClientError as exc:
                if not _is_not_found(exc):  # an unknown or expired lease is already revoked
                    raise

        await self._call("revoke_lease", revoke)

    # -- watches -------------------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, *, start_revision: int) -> Watch:
        _check_prefix(prefix)
        if start_revision < 1:
            raise ValueError(f"start_revision must be >= 1 (get_prefix's revision + 1), not {start_revision}")
        watch = _EtcdWatch(self, prefix, start_revision)
        await watch.open()
        return watch

    async def close(self) -> None:
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()


class _EtcdWatch(Watch):
    """A prefix watch that re-creates its etcd watch after a broken stream.

    It remembers the revision after the last event it delivered and resumes from there, under
    the store's retry policy, so that a restarted or failed-over etcd loses no event. Iteration
    ends after ``cancel()`` or the store's ``close()``; it raises StoreUnavailable when the
    store stays unreachable and StoreCompacted when the history it needs is gone.
    """

    def __init__(self, store: EtcdStore, prefix: str, start_revision: int) -> None:
        self._store = store
        self._prefix = prefix.encode()
        self._next_revision = start_revision
        self._inner: aetcd.Watch | None = None
        self._client: _Client | None = None
        self._cancelled = False

    async def open(self) -> None:
        async def create(c: _Client) -> aetcd.Watch:
            watch = await c.watch_prefix(self._prefix, start_revision=self._next_revision)
            self._client = c
            return watch

        self._inner = await self._store._call("watch", create)
        if self._cancelled:  # cancel() came while we were (re)opening
            await self._cancel_inner()

    async def __aiter__(self) -> AsyncIterator[Event]:
        while not self._cancelled:
            try:
                async for raw in self._inner:
                    self._next_revision = raw.kv.mod_revision + 1
                    event = _event(raw)
                    if event is not None:
                        yield event
                return  # aetcd ends iteration on cancel and on client close
            except _RETRYABLE:
                if self._cancelled or self._store._closed:
                    return
                await self.open()
            except aetcd.RevisionCompactedError as exc:
                raise StoreCompacted(exc.compacted_revision) from exc
            except aetcd.ClientError as exc:
                raise StoreError(f"etcd watch on {self._prefix.decode()!r} failed: {exc}") from exc

    async def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        await self._cancel_inner()

    async def _cancel_inner(self) -> None:
        inner, client = self._inner, self._client
        if inner is None or client is None or client._watcher is None:  # client closed: already ended
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(inner.cancel(), CANCEL_TIMEOUT)


def _event(raw: aetcd.Event) -> Event | None:
    """The event, or None for a put of a value that is not a JSON object (warned once)."""
    kv = raw.kv
    key = decode_key(kv.key)
    if key is None:
        return None
    if raw.kind == aetcd.EventKind.PUT:
        value = decode_value(key, kv.value, kv.mod_revision)
        return None if value is None else Event("put", key, value, kv.mod_revision, kv.create_revision)
    return Event("delete", key, None, kv.mod_revision)
