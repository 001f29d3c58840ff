"""Table tests of :func:`agent.hostlist.expand_hostlist` against SLURM's host-list syntax."""

from __future__ import annotations

import pytest

from agent.errors import ConfigError
from agent.hostlist import MAX_HOSTS, expand_hostlist

EXPANSIONS = [
    # (text, expected hosts)
    ("node1", ["node1"]),
    ("a,b,c", ["a", "b", "c"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("a[008-011]", ["a008", "a009", "a010", "a011"]),
    ("x[9-11]", ["x9", "x10", "x11"]),
    ("x[09-11]", ["x09", "x10", "x11"]),
    ("x[1-010]", ["x1", "x2", "x3", "x4", "x5", "x6", "x7", "x8", "x9", "x10"]),
    ("x[7]", ["x7"]),
    ("x[07]", ["x07"]),
    ("x[0]", ["x0"]),
    ("x[3-3]", ["x3"]),
    ("n[1-2]-[3-4]", ["n1-3", "n1-4", "n2-3", "n2-4"]),
    ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
    ("a[1-2]b[3,5]c", ["a1b3c", "a1b5c", "a2b3c", "a2b5c"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("n[1-2].cluster.local", ["n1.cluster.local", "n2.cluster.local"]),
    ("[1-3]", ["1", "2", "3"]),
    ("node1,node[10-11],login", ["node1", "node10", "node11", "login"]),
    ("n[3,1,2]", ["n3", "n1", "n2"]),
    ("n[1-2],n[2-3],n1", ["n1", "n2", "n2", "n3", "n1"]),
    ("n[1,1]", ["n1", "n1"]),
    ("gpu-a100-[1-2]", ["gpu-a100-1", "gpu-a100-2"]),
    ("nid[00998-01001]", ["nid00998", "nid00999", "nid01000", "nid01001"]),
    # whitespace
    ("  node1 , node2  ", ["node1", "node2"]),
    ("gpu[ 01 - 02 , 07 ]", ["gpu01", "gpu02", "gpu07"]),
    ("a b", ["a", "b"]),
    ("a[1-2] b[1,3]\n", ["a1", "a2", "b1", "b3"]),
    ("\tn1,\n n2", ["n1", "n2"]),
    # nothing at all
    ("", []),
    ("   ", []),
]


@pytest.mark.parametrize(("text", "expected"), EXPANSIONS, ids=[repr(t) for t, _ in EXPANSIONS])
def test_expand(text: str, expected: list[str]) -> None:
    assert expand_hostlist(text) == expected


MALFORMED = [
    # (text, a part the message must name)
    ("gpu[01-03", "gpu[01-03"),
    ("gpu[1,2", "gpu[1,2"),
    ("a,gpu[1-2,b", "gpu[1-2,b"),
    ("gpu01-03]", "gpu01-03]"),
    ("a,b]c", "b]"),
    ("a[1[2]]", "a[1["),
    ("x[5-3]", "5-3"),
    ("x[01-03,9-2]", "9-2"),
    ("a,,b", "empty item"),
    ("a,", "empty item"),
    (",a", "empty item"),
    ("a, ,b", "empty item"),
    ("x[a-c]", "a-c"),
    ("x[1-c]", "1-c"),
    ("x[one]", "one"),
    ("x[1-3-5]", "1-3-5"),
    ("x[-3]", "-3"),
    ("x[3-]", "3-"),
    ("x[1.5]", "1.5"),
    ("x[+1]", "+1"),
    ("x[\u0663]", "x["),  # Arabic-Indic digit three: not an ASCII number
    ("x[]", "empty brackets"),
    ("x[ ]", "empty brackets"),
    ("x[1,,2]", "empty range"),
    ("x[1,]", "empty range"),
    ("x[1 2]", "1 2"),
    ("n[0-99999999]", "0-99999999"),
]


@pytest.mark.parametrize(("text", "named"), MALFORMED, ids=[repr(t) for t, _ in MALFORMED])
def test_malformed(text: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand_hostlist(text)
    message = str(info.value)
    assert named in message
    assert "\n" not in message


def test_product_over_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match="more than"):
        expand_hostlist("n[0-999]-[0-999]")


def test_total_over_limit_is_refused() -> None:
    half = MAX_HOSTS // 2 + 1
    with pytest.raises(ConfigError, match="more than"):
        expand_hostlist(f"a[1-{half}],b[1-{half}]")


def test_exactly_the_limit_is_accepted() -> None:
    assert len(expand_hostlist(f"n[1-{MAX_HOSTS}]")) == MAX_HOSTS


def test_not_a_string() -> None:
    with pytest.raises(ConfigError, match="expected a string"):
        expand_hostlist(None)  # type: ignore[arg-type]
