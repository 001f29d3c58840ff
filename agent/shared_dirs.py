"""Directories and files in shared places (``/tmp``), made and read without trusting anyone else.

tmrun keeps two things where other users can write: the runtime directory of local jobs
(``/tmp/tmrun-<uid>/``, :mod:`tmrun.jobs`) and, under SLURM, the job's etcd data
(``$TMPDIR/tmrun-<job>/``, :mod:`agent.etcd_member`). Both names can be guessed, so another user
could create them first, or plant a symbolic link in them to make tmrun write, read or delete
somewhere else. Here:

- :func:`private_dir` creates a directory with mode 0700, or accepts an existing one only if it is
  a real directory (not a link), owned by this user and not writable by group or others; anything
  else is a :class:`~agent.errors.ConfigError`, one line, exit code 2;
- :func:`write_private_file` writes a new file (``mkstemp``: ``O_EXCL``, mode 0600) and renames it
  into place, which replaces a planted link instead of following it;
- :func:`read_private_file` opens with ``O_NOFOLLOW`` and reads only a regular file of this user.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from agent.errors import ConfigError


def check_private_dir(path: Path, hint: str = "") -> None:
    """ConfigError unless ``path`` is a directory (not a link) of this user, not group/world writable."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"cannot use directory {path}: {exc.strerror}") from None
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "it is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "it is not a directory"
    elif st.st_uid != os.getuid():
        why = f"it belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        why = f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if why:
        raise ConfigError(f"refusing to use directory {path}: {why}" + (f"; {hint}" if hint else ""))


def private_dir(path: Path, hint: str = "") -> Path:
    """``path`` created with mode 0700 (its parents as usual), or checked if it exists."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create directory {path}: {exc.strerror}") from None
    check_private_dir(path, hint)
    return path


def write_private_file(directory: Path, name: str, data: bytes) -> Path:
    """Write ``directory/name`` (mode 0600) through a new temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, Path(directory) / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(directory) / name


def read_private_file(path: Path, limit: int = 1 << 20) -> bytes | None:
    """The file's first ``limit`` bytes; None when it is a link, not a regular file, not this
    user's, or cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        try:
            return f.read(limit)
        except OSError:
            return None
