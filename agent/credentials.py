"""Credentials that close a job's embedded etcd to everyone but the user who started the job.

tmrun keeps one small certificate authority per user, made on first use::

    ~/.config/tmrun/credentials/        (or $XDG_CONFIG_HOME/tmrun/credentials, or $TMRUN_CREDENTIALS)
        ca.pem  ca-key.pem              the user's CA (EC P-256, 10 years)
        client.pem  client-key.pem      what tmrun's agents and commands present to etcd

The directory is the user's own and mode 0700, every file 0600; anything else (another owner, a
group- or world-readable mode, a symbolic link) is refused with one line and never used. It is
created whole or not at all: written in a fresh directory beside it, then renamed into place, so
that agents starting at once on several nodes of a shared home directory all end up with the same
one.

Each etcd member tmrun starts gets its own server certificate, signed by that CA, for the names
and addresses it is reached at (``server_certificate``); the member accepts only clients and peers
whose certificate the same CA signed (``--client-cert-auth``, ``--peer-client-cert-auth``). Who can
read the CA key can join; that is the user (and root). See docs/security.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import ipaddress
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Mapping

from agent.errors import ConfigError

CA, CA_KEY, CLIENT, CLIENT_KEY = "ca.pem", "ca-key.pem", "client.pem", "client-key.pem"
SERVER, SERVER_KEY = "server.pem", "server-key.pem"
CA_DAYS = 3650
LEAF_DAYS = 30


@dataclasses.dataclass(frozen=True)
class UserCredentials:
    """The user's CA and client certificate, as files (gRPC and etcd both read PEM files)."""

    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / CA

    @property
    def ca_key(self) -> Path:
        return self.directory / CA_KEY

    @property
    def client(self) -> Path:
        return self.directory / CLIENT

    @property
    def client_key(self) -> Path:
        return self.directory / CLIENT_KEY


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """What one etcd member needs: its certificate and key, the CA it trusts, and a client pair
    for its own health check."""

    ca: Path
    cert: Path
    key: Path
    client: Path
    client_key: Path


def credentials_dir(environ: Mapping[str, str]) -> Path:
    """Where the user's credentials live (``$TMRUN_CREDENTIALS`` wins)."""
    if environ.get("TMRUN_CREDENTIALS"):
        return Path(environ["TMRUN_CREDENTIALS"])
    config = environ.get("XDG_CONFIG_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".config")
    return Path(config) / "tmrun" / "credentials"


def check_private(path: Path, directory: bool) -> None:
    """Refuse (one line) a path that is a link, not the user's own, or open to others."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"cannot use {path}: {exc.strerror}") from exc
    kind_ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if stat.S_ISLNK(info.st_mode) or not kind_ok:
        what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a " + ("directory" if directory else "file")
        raise ConfigError(f"refusing {path}: it is {what}")
    if info.st_uid != os.geteuid():
        raise ConfigError(f"refusing {path}: owned by uid {info.st_uid}, not by you (uid {os.geteuid()})")
    if info.st_mode & 0o077:
        raise ConfigError(f"refusing {path}: mode {stat.S_IMODE(info.st_mode):04o} lets others in; "
                          f"chmod {'700' if directory else '600'} it")


def user_credentials(directory: Path) -> UserCredentials:
    """The user's credentials in ``directory``: checked when they exist, made when they do not."""
    if not os.path.lexists(directory):
        _create(directory)
    return checked(UserCredentials(directory), with_ca_key=True)


def checked(creds: UserCredentials, with_ca_key: bool = False) -> UserCredentials:
    """``creds`` once its directory and files passed :func:`check_private` (the CA key only when
    it will be used: clients need the CA and their own pair)."""
    check_private(creds.directory, directory=True)
    for path in (creds.ca, creds.client, creds.client_key) + ((creds.ca_key,) if with_ca_key else ()):
        check_private(path, directory=False)
    return creds


def _create(directory: Path) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fresh = Path(tempfile.mkdtemp(prefix=".credentials-", dir=directory.parent))  # mode 0700
    try:
        ca_key = _new_key()
        ca = _certificate("tmrun user CA", ca_key.public_key(), ca_key, None, CA_DAYS, ca=True)
        client_key = _new_key()
        client = _certificate("tmrun client", client_key.public_key(), ca_key, ca, CA_DAYS, usages=("client",))
        _write(fresh / CA, _pem(ca))
        _write(fresh / CA_KEY, _key_pem(ca_key))
        _write(fresh / CLIENT, _pem(client))
        _write(fresh / CLIENT_KEY, _key_pem(client_key))
        try:
            os.rename(fresh, directory)
        except OSError as exc:  # another tmrun made it first: use theirs
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise ConfigError(f"cannot create {directory}: {exc.strerror}") from exc
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def server_certificate(creds: UserCredentials, out: Path, names: list[str]) -> ServerTls:
    """Issue a certificate for one etcd member, valid for ``names`` (host names and IP addresses).

    Written into ``out`` (made 0700 when missing, checked when present). The certificate serves
    both ends: clients' connections and the other members' (peer) connections.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if not os.path.lexists(out):
        out.mkdir(parents=True, mode=0o700)
    check_private(out, directory=True)
    ca_key = serialization.load_pem_private_key(creds.ca_key.read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate(creds.ca.read_bytes())
    key = _new_key()
    cert = _certificate("tmrun etcd", key.public_key(), ca_key, ca, LEAF_DAYS, usages=("server", "client"),
                        names=names)
    tls = ServerTls(creds.ca, out / SERVER, out / SERVER_KEY, creds.client, creds.client_key)
    for path, data in ((tls.cert, _pem(cert)), (tls.key, _key_pem(key))):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _write(path, data)
    return tls


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _certificate(common_name: str, public_key, issuer_key, issuer, days: int, *, ca: bool = False,
                 usages: tuple[str, ...] = (), names: list[str] | None = None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(subject)
               .issuer_name(issuer.subject if issuer is not None else subject)
               .public_key(public_key)
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks of the nodes differ a little
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                                        critical=True)
    else:
        oids = {"server": ExtendedKeyUsageOID.SERVER_AUTH, "client": ExtendedKeyUsageOID.CLIENT_AUTH}
        builder = builder.add_extension(x509.ExtendedKeyUsage([oids[u] for u in usages]), critical=False)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]),
                                        critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _general_name(name: str):
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes) -> None:
    """A new file, 0600, never through a link and never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)

