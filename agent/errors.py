"""The agent's exception tree, one place for every error the agent and the CLI tell apart.

::

    TmrunError                      base of everything below
    ├── ConfigError                 bad flags or configuration (exit code 2)
    ├── StoreError                  anything the key-value store reported
    │   ├── StoreUnavailable        the endpoint cannot be reached, after retries (exit code 3)
    │   ├── StoreCompacted          a watch asked for a revision that was compacted away
    │   └── LeaseNotFound           a write named a lease that etcd no longer has (it expired)
    ├── JobNotFound                 no running job matches (events: nor a history file) (exit code 5)
    ├── HistoryError                a job's history file cannot be read or is malformed (exit code 1)
    ├── UnknownNode                 a node name the job has never seen (exit code 4)
    └── RequestRejected             the leader answered a request with "no" (exit code 6)

    ControlPlaneLost(BaseException) terminal: etcd stayed unreachable past the outage bound;
                                    stop the workers cleanly and exit (code 3).
                                    A BaseException, so that no stray ``except Exception``
                                    swallows it.

Third-party errors (aetcd, grpc) are mapped to these at the boundary, in ``etcd_store``.
"""

from __future__ import annotations


class TmrunError(Exception):
    """Base class of tmrun's own errors."""

    exit_code = 1


class ConfigError(TmrunError):
    """A flag or configuration value is malformed or inconsistent."""

    exit_code = 2


class StoreError(TmrunError):
    """The key-value store reported an error."""

    exit_code = 3


class StoreUnavailable(StoreError):
    """The store endpoint could not be reached (after the retry policy gave up)."""

    def __init__(self, endpoint: str, detail: str = "") -> None:
        self.endpoint = endpoint
        self.detail = detail
        text = f"etcd at {endpoint} is unreachable"
        super().__init__(f"{text} ({detail})" if detail else text)


class StoreCompacted(StoreError):
    """A watch started at a revision the store has already compacted."""

    def __init__(self, compacted_revision: int) -> None:
        self.compacted_revision = compacted_revision
        super().__init__(f"revision compacted below {compacted_revision}")


class LeaseNotFound(StoreError):
    """etcd answered that the lease named in a write does not exist (it expired or was revoked)."""


class JobNotFound(TmrunError):
    """No running job matches what was asked for, or several do and none was chosen."""

    exit_code = 5


class HistoryError(TmrunError):
    """A job's history file (``<log root>/<job>/events.jsonl``) cannot be read or is malformed."""


class UnknownNode(TmrunError):
    """A node name that is not part of the job."""

    exit_code = 4


class RequestRejected(TmrunError):
    """The leader refused a request (for example a drain with nobody to take over)."""

    exit_code = 6


class ControlPlaneLost(BaseException):
    """etcd stayed unreachable for longer than the outage bound: stop the workers and leave."""

    exit_code = 3
