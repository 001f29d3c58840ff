"""The ``tmrun`` command's parsing and bad-input handling, and the pure helpers it builds on.

Bad input must end with one line ``tmrun: error: …`` on stderr and the documented exit code, never
a traceback. Each case runs twice: in-process through ``tmrun.cli.main(argv)`` (which returns the
code) and as a real ``tmrun`` process (which exits with it). Cases that talk to the network run
only as processes. No case starts a job: each fails before anything is launched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import (AgentConfig, Timeouts, WorkerSpec, parse_nnodes, parse_rdzv_conf,
                          timeouts_from_conf)
from agent.errors import ConfigError
from agent.output import parse_std_spec
from agent.records import Plan
from agent.worker_env import worker_env
from tmrun.cli import main

pytestmark = pytest.mark.timeout(30)

ERROR = "tmrun: error: "
WARNING = "tmrun: warning: "


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No torchrun, SLURM or tmrun variable from the outer shell (but the test's own runtime and log
    directories, so no job or history of the user's is found); run in tmp_path with a script."""
    for name in list(os.environ):
        if name.startswith(("PET_", "SLURM_", "TMRUN_")) and name not in ("TMRUN_RUNTIME_DIR", "TMRUN_LOG_DIR"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "script.py").write_text("print('hello')\n")
    return tmp_path


def run_tmrun(args: list[str], env: dict[str, str] | None = None, timeout: float = 20.0,
              cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from tmrun.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def error_line(stderr: str, *parts: str, warnings: bool = False) -> str:
    """The one ``tmrun: error:`` line; stderr holds nothing else (but warnings, when allowed)."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    errors = [line for line in lines if line.startswith(ERROR)]
    assert len(errors) == 1, stderr
    others = [line for line in lines if line not in errors]
    if warnings:
        assert all(line.startswith(WARNING) for line in others), stderr
    else:
        assert not others, stderr
    for part in parts:
        assert part in errors[0], errors[0]
    return errors[0]


# -- bad input ---------------------------------------------------------------------------------

BAD_INPUT = [
    # (id, argv, env, exit code, parts of the message)
    ("nnodes-min-above-max", ["--nnodes", "3:2", "script.py"], {}, 2, ["--nnodes 3:2", "MIN <= MAX"]),
    ("nnodes-not-a-number", ["--nnodes", "abc", "script.py"], {}, 2, ["--nnodes 'abc'"]),
    ("nnodes-zero", ["--nnodes", "0", "script.py"], {}, 2, ["--nnodes 0"]),
    ("nnodes-from-env", ["script.py"], {"PET_NNODES": "3:2"}, 2, ["--nnodes 3:2", "MIN <= MAX"]),
    ("unknown-flag", ["--bogus", "script.py"], {}, 2, ["--bogus"]),
    ("no-script", [], {}, 2, ["script"]),
    ("missing-script", ["missing.py"], {}, 2, ["script 'missing.py' not found"]),
    ("nproc-word", ["--nproc-per-node", "zero", "script.py"], {}, 2, ["--nproc-per-node 'zero'"]),
    ("nproc-zero-dashes", ["--nproc-per-node", "0", "script.py"], {}, 2, ["--nproc-per-node must be at least 1"]),
    ("nproc-zero-underscores", ["--nproc_per_node", "0", "script.py"], {}, 2,
     ["--nproc-per-node must be at least 1"]),
    ("nproc-zero-from-env", ["script.py"], {"PET_NPROC_PER_NODE": "0"}, 2, ["--nproc-per-node must be at least 1"]),
    ("module-and-no-python", ["-m", "--no-python", "script"], {}, 2, ["--module and --no-python"]),
    ("module-not-found", ["-m", "no_such_module_xyz"], {}, 2, ["module 'no_such_module_xyz' not found"]),
    ("executable-not-found", ["--no-python", "no-such-executable-xyz"], {}, 2,
     ["executable 'no-such-executable-xyz' not found"]),
    ("redirects-out-of-range", ["--redirects", "9", "script.py"], {}, 2, ["--redirects '9'"]),
    ("tee-malformed", ["--tee", "0:x", "script.py"], {}, 2, ["--tee '0:x'"]),
    ("rdzv-conf-bad-pair", ["--rdzv-conf", "badpair", "script.py"], {}, 2, ["--rdzv-conf item 'badpair'"]),
    ("rdzv-conf-bad-number", ["--rdzv-conf", "join_timeout=soon", "script.py"], {}, 2,
     ["join_timeout='soon'", "expected a number"]),
    ("local-ranks-filter", ["--local-ranks-filter", "a,b", "script.py"], {}, 2, ["--local-ranks-filter 'a,b'"]),
    ("max-restarts-negative", ["--max-restarts", "-1", "script.py"], {}, 2, ["--max-restarts"]),
    ("rdzv-backend-unknown", ["--rdzv-backend", "zookeeper", "script.py"], {}, 2, ["zookeeper"]),
    ("bad-job-id", ["--rdzv-id", "bad id!", "script.py"], {}, 2, ["--rdzv-id 'bad id!'"]),
    # numbers: ASCII digits only, finite, within bounds (NaN, "²" and absurd sizes are usage errors)
    ("nproc-superscript", ["--nproc-per-node", "²", "script.py"], {}, 2, ["--nproc-per-node '²'"]),
    ("nproc-absurd", ["--nproc-per-node", "100000", "script.py"], {}, 2, ["--nproc-per-node 100000", "0 to 1024"]),
    ("nproc-huge", ["--nproc-per-node", "9" * 30, "script.py"], {}, 2, ["--nproc-per-node", "0 to 1024"]),
    ("nnodes-arabic-indic", ["--nnodes", "\u0662", "script.py"], {}, 2, ["--nnodes '\u0662'"]),
    ("nnodes-absurd", ["--nnodes", "1:1000000000", "script.py"], {}, 2, ["at most 100000 nodes"]),
    ("standby-absurd", ["--standby", "1000000000", "script.py"], {}, 2, ["--standby", "0 to 100000"]),
    ("standby-superscript", ["--standby", "²", "script.py"], {}, 2, ["--standby", "'²': expected an integer"]),
    ("standby-local-too-many", ["--standby", "1000", "script.py"], {}, 2, ["local cluster of 1001 nodes"]),
    ("standby-nan-from-env", ["script.py"], {"TMRUN_STANDBY": "nan"}, 2, ["--standby", "'nan'"]),
    ("max-restarts-absurd", ["--max-restarts", "1000000000", "script.py"], {}, 2, ["--max-restarts", "0 to 10000"]),
    ("monitor-interval-nan", ["--monitor-interval", "nan", "script.py"], {}, 2, ["--monitor-interval", "'nan'"]),
    ("monitor-interval-inf", ["--monitor-interval", "inf", "script.py"], {}, 2, ["--monitor-interval", "'inf'"]),
    ("shutdown-timeout-nan", ["--shutdown-timeout", "NaN", "script.py"], {}, 2, ["--shutdown-timeout", "'NaN'"]),
    ("shutdown-timeout-absurd", ["--shutdown-timeout", "1e300", "script.py"], {}, 2, ["--shutdown-timeout"]),
    ("master-port-absurd", ["--master-port", "70000", "script.py"], {}, 2, ["--master-port", "0 to 65535"]),
    ("local-ranks-filter-superscript", ["--local-ranks-filter", "0,²", "script.py"], {}, 2,
     ["--local-ranks-filter '0,²'"]),
    ("rdzv-conf-nan", ["--rdzv-conf", "join_timeout=nan", "script.py"], {}, 2, ["join_timeout='nan'"]),
    ("rdzv-conf-inf", ["--rdzv-conf", "failure_window=inf", "script.py"], {}, 2, ["failure_window='inf'"]),
    ("rdzv-conf-absurd", ["--rdzv-conf", "join_timeout=1e300", "script.py"], {}, 2, ["join_timeout=1e300"]),
    ("rdzv-conf-lease-superscript", ["--rdzv-conf", "lease_ttl=\u00b3", "script.py"], {}, 2, ["lease_ttl="]),
    ("status-timeout-nan", ["status", "--store-timeout", "nan"], {}, 2, ["--store-timeout", "'nan'"]),
    ("drain-timeout-inf", ["drain", "n", "--timeout", "inf"], {}, 2, ["--timeout", "'inf'"]),
    ("status-no-job", ["status"], {}, 5, ["no running tmrun job"]),
    ("status-unknown-job", ["status", "--job", "nope"], {}, 5, ["no running job named 'nope'"]),
    ("events-no-job", ["events"], {}, 5, ["no running tmrun job"]),
    ("drain-no-job", ["drain", "node-1"], {}, 5, ["no running tmrun job"]),
    ("drain-no-node", ["drain"], {}, 2, ["node"]),
    ("status-unknown-flag", ["status", "--bogus"], {}, 2, ["--bogus"]),
    ("status-bad-timeout", ["status", "--store-timeout", "soon"], {}, 2, ["--store-timeout"]),
]


@pytest.mark.parametrize(("argv", "env", "code", "parts"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_in_process(argv, env, code, parts, monkeypatch, capsys) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(list(argv)) == code
    captured = capsys.readouterr()
    error_line(captured.err, *parts)
    assert captured.out == ""


# A real process for one case of each kind of error (a process costs about half a second).
IN_A_PROCESS = [c for c in BAD_INPUT if c[0] in {
    "nnodes-min-above-max", "nnodes-from-env", "unknown-flag", "missing-script", "nproc-zero-underscores",
    "max-restarts-negative", "status-no-job", "drain-no-node", "nproc-superscript", "monitor-interval-nan",
    "standby-absurd"}]


@pytest.mark.parametrize(("argv", "env", "code", "parts"), [c[1:] for c in IN_A_PROCESS],
                         ids=[c[0] for c in IN_A_PROCESS])
def test_bad_input_process(argv, env, code, parts) -> None:
    result = run_tmrun(argv, env)
    assert result.returncode == code, result.stderr
    error_line(result.stderr, *parts)
    assert result.stdout == ""


def test_unreachable_endpoint_exits_3(tmp_path: Path) -> None:
    result = run_tmrun(["--rdzv-endpoint", "etcd://127.0.0.1:1", "--rdzv-conf", "store_timeout=1.5",
                        str(tmp_path / "script.py")])
    assert result.returncode == 3, result.stderr
    error_line(result.stderr, "127.0.0.1:1", "unreachable")


def test_status_unreachable_endpoint_exits_3() -> None:
    result = run_tmrun(["status", "--rdzv-endpoint", "127.0.0.1:1", "--store-timeout", "1"])
    assert result.returncode == 3, result.stderr
    error_line(result.stderr, "127.0.0.1:1", "unreachable")


def test_status_malformed_endpoint_exits_2() -> None:
    result = run_tmrun(["status", "--rdzv-endpoint", "nohost", "--store-timeout", "1"])
    assert result.returncode == 2, result.stderr
    error_line(result.stderr, "nohost")


# -- warnings ----------------------------------------------------------------------------------

WARNS = [
    # (id, flags, a part of the warning)
    ("start-method", ["--start-method", "fork"], "--start-method has no effect"),
    ("start-method-underscore", ["--start_method", "fork"], "--start-method has no effect"),
    ("master-port", ["--master-port", "1234"], "--master-port has no effect"),
    ("node-rank", ["--node-rank", "1"], "--node-rank has no effect"),
    ("rdzv-backend", ["--rdzv-backend", "c10d"], "--rdzv-backend c10d"),
    ("unknown-rdzv-conf-key", ["--rdzv-conf", "colour=blue"], "--rdzv-conf colour: unknown key"),
    ("grow-with-a-fixed-size", ["--grow", "--nnodes", "2"], "--grow has no effect with a fixed --nnodes 2"),
]


@pytest.mark.parametrize(("flags", "part"), [w[1:] for w in WARNS], ids=[w[0] for w in WARNS])
def test_flag_without_effect_warns_before_the_error(flags, part, capsys) -> None:
    assert main([*flags, "missing.py"]) == 2
    err = capsys.readouterr().err
    error_line(err, "script 'missing.py' not found", warnings=True)
    lines = err.splitlines()
    warnings = [i for i, line in enumerate(lines) if line.startswith(WARNING) and part in line]
    assert len(warnings) == 1, err
    assert warnings[0] < len(lines) - 1 and lines[-1].startswith(ERROR), err


def test_warning_and_error_in_a_process() -> None:
    result = run_tmrun(["--start-method", "fork", "missing.py"])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith(WARNING) and "--start-method" in lines[0], result.stderr
    error_line(result.stderr, "script 'missing.py' not found", warnings=True)


def test_flags_left_alone_do_not_warn(capsys) -> None:
    assert main(["--rdzv-backend", "etcd", "missing.py"]) == 2
    assert main(["missing.py"]) == 2
    assert main(["--grow", "--nnodes", "2:4", "missing.py"]) == 2  # an elastic job: --grow has an effect
    assert WARNING not in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--start-method", "spawn"], ["--node-rank", "0"], ["--master-port", "29500"]],
                         ids=["start-method-spawn", "node-rank-0", "master-port-29500"])
def test_torchrun_defaults_given_explicitly_do_not_warn(flags, capsys) -> None:
    assert main([*flags, "missing.py"]) == 2
    assert WARNING not in capsys.readouterr().err


# -- accepted spellings: an error raised after a flag is parsed proves the flag was accepted ---

ACCEPTED = [
    # (id, argv, env)
    ("nproc-dashes", ["--nproc-per-node", "2"], {}),
    ("nproc-underscores", ["--nproc_per_node", "2"], {}),
    ("nproc-env", [], {"PET_NPROC_PER_NODE": "2"}),
    ("nproc-cpu", ["--nproc-per-node", "cpu"], {}),
    ("nnodes-env", [], {"PET_NNODES": "2:3"}),
    ("nnodes-equals", ["--nnodes=1:4"], {}),
    ("rdzv-conf-underscore", ["--rdzv_conf", "join_timeout=5,lease_ttl=3"], {}),
    ("max-restarts-underscore", ["--max_restarts", "3"], {}),
    ("redirects-per-rank", ["--redirects", "0:3,1:1", "--tee", "2"], {}),
    ("local-ranks-filter", ["--local_ranks_filter", "0,1"], {}),
]


@pytest.mark.parametrize(("argv", "env"), [a[1:] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_accepted_spellings(argv, env, monkeypatch, capsys) -> None:
    # The job id is checked after every launch flag and after the script was found.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main([*argv, "--rdzv-id", "bad id!", "script.py"]) == 2
    error_line(capsys.readouterr().err, "--rdzv-id 'bad id!'")


# -- subcommand names versus scripts -----------------------------------------------------------


def test_dot_slash_status_is_a_script_not_the_subcommand(tmp_path: Path) -> None:
    result = run_tmrun(["./status"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    error_line(result.stderr, "script './status' not found")


def test_existing_script_named_status_launches(tmp_path: Path, capsys) -> None:
    (tmp_path / "status").write_text("print('a script')\n")
    assert main(["--rdzv-id", "bad id!", "./status"]) == 2  # found, then the launch checks the job id
    error_line(capsys.readouterr().err, "--rdzv-id 'bad id!'")
    assert main(["status"]) == 5  # the bare word is still the subcommand
    error_line(capsys.readouterr().err, "no running tmrun job")


def test_help_exits_0(capsys) -> None:
    assert main(["--help"]) == 0
    assert "--nproc-per-node" in capsys.readouterr().out
    assert main(["status", "--help"]) == 0
    assert "--json" in capsys.readouterr().out


# -- agent.config ------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4)), ("3:3", (3, 3)), (" 2", (2, 2)), ("02:010", (2, 10)),
])
def test_parse_nnodes(text, expected) -> None:
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize(("text", "part"), [
    ("", "expected N or MIN:MAX"), ("abc", "expected N or MIN:MAX"), ("1:", "expected N or MIN:MAX"),
    (":2", "expected N or MIN:MAX"), ("1:2:3", "expected N or MIN:MAX"), ("1.5", "expected N or MIN:MAX"),
    ("0", "1 <= MIN <= MAX"), ("-1", "1 <= MIN <= MAX"), ("3:2", "1 <= MIN <= MAX"), ("0:2", "1 <= MIN <= MAX"),
])
def test_parse_nnodes_rejects(text, part) -> None:
    with pytest.raises(ConfigError, match="--nnodes") as info:
        parse_nnodes(text)
    assert part in str(info.value)


@pytest.mark.parametrize(("text", "expected"), [
    ("", {}),
    ("   ", {}),
    ("join_timeout=30", {"join_timeout": "30"}),
    ("a=1,b=2", {"a": "1", "b": "2"}),
    (" a = 1 , , b = 2 ,", {"a": "1", "b": "2"}),
    ("k=", {"k": ""}),
    ("url=a=b", {"url": "a=b"}),
    ("a=1,a=2", {"a": "2"}),
])
def test_parse_rdzv_conf(text, expected) -> None:
    assert parse_rdzv_conf(text) == expected


@pytest.mark.parametrize("text", ["badpair", "=1", "a=1,b", "a=1,=2"])
def test_parse_rdzv_conf_rejects(text) -> None:
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_rdzv_conf(text)


@pytest.mark.parametrize(("conf", "stop_grace", "expected"), [
    ({}, None, Timeouts()),
    ({"join_timeout": "30"}, None, Timeouts(join=30.0)),
    ({"timeout": "45"}, None, Timeouts(join=45.0)),
    ({"timeout": "45", "join_timeout": "30"}, None, Timeouts(join=30.0)),
    ({"last_call_timeout": "0.5"}, None, Timeouts(last_call=0.5)),
    ({"lease_ttl": "3"}, None, Timeouts(lease_ttl=3, failure_window=4.0)),
    ({"lease_ttl": "3", "failure_window": "2"}, None, Timeouts(lease_ttl=3, failure_window=2.0)),
    ({"failure_window": "0"}, None, Timeouts(failure_window=0.0)),
    ({"close_timeout": "7"}, None, Timeouts(stop_grace=7.0)),
    ({}, 9.0, Timeouts(stop_grace=9.0)),
    ({"store_timeout": "1.5"}, None, Timeouts(store_retry=1.5)),
    ({"read_timeout": "60", "is_host": "1"}, None, Timeouts()),
])
def test_timeouts_from_conf(conf, stop_grace, expected) -> None:
    assert timeouts_from_conf(conf, stop_grace) == expected


@pytest.mark.parametrize(("conf", "part"), [
    ({"join_timeout": "soon"}, "join_timeout='soon'"),
    ({"timeout": "x"}, "timeout='x'"),
    ({"lease_ttl": "abc"}, "lease_ttl='abc'"),
    ({"lease_ttl": "1"}, "lease_ttl must be at least 2"),
    ({"join_timeout": "-1"}, "non-negative"),
    ({"store_timeout": "-0.5"}, "non-negative"),
])
def test_timeouts_from_conf_rejects(conf, part) -> None:
    with pytest.raises(ConfigError) as info:
        timeouts_from_conf(conf)
    assert part in str(info.value)


def full_config(**kw) -> AgentConfig:
    worker = WorkerSpec(("python", "-u", "train.py", "--lr", "0.1"), nproc_per_node=2, role="trainer",
                        log_dir="/tmp/logs", redirects="0:3,1:1", tee="2", local_ranks_filter=(0, 1), max_restarts=3)
    values = dict(job_id="job-1", node="n1", host="10.0.0.2", endpoint="etcd://10.0.0.1:2379", worker=worker,
                  min_nodes=2, max_nodes=4, standby_hint=True,
                  timeouts=Timeouts(join=30.0, last_call=0.5, lease_ttl=3, failure_window=4.0, stop_grace=2.0,
                                    store_retry=7.0),
                  monitor_interval=0.5, tls_cacert="/ca.pem", tls_cert="/c.pem", tls_key="/k.pem", hosts_store=True)
    values.update(kw)
    return AgentConfig(**values)


@pytest.mark.parametrize("cfg", [
    full_config(),
    AgentConfig(job_id="j", node="node-0", host="127.0.0.1", endpoint="", worker=WorkerSpec(("x",))),
], ids=["everything-set", "defaults"])
def test_agent_config_json_round_trip(cfg: AgentConfig) -> None:
    text = cfg.to_json()
    json.loads(text)  # plain JSON, nothing pickled
    assert AgentConfig.from_json(text) == cfg
    assert AgentConfig.from_json(text).to_json() == text


def test_agent_config_json_rejects_other_schema() -> None:
    data = json.loads(full_config().to_json())
    data["v"] = 99
    with pytest.raises(ConfigError, match="schema"):
        AgentConfig.from_json(json.dumps(data))


@pytest.mark.parametrize(("kw", "part"), [
    (dict(min_nodes=3, max_nodes=2), "--nnodes 3:2"),
    (dict(min_nodes=0, max_nodes=2), "--nnodes 0:2"),
    (dict(node=""), "bad node name"),
    (dict(node="a/b"), "bad node name"),
])
def test_agent_config_rejects(kw, part) -> None:
    with pytest.raises(ConfigError) as info:
        full_config(**kw)
    assert part in str(info.value)


@pytest.mark.parametrize(("kw", "part"), [
    (dict(argv=()), "no script"),
    (dict(argv=("x",), nproc_per_node=0), "--nproc-per-node"),
    (dict(argv=("x",), max_restarts=-1), "--max-restarts"),
])
def test_worker_spec_rejects(kw, part) -> None:
    with pytest.raises(ConfigError, match=part):
        WorkerSpec(**kw)


# -- agent.output.parse_std_spec ---------------------------------------------------------------


@pytest.mark.parametrize(("spec", "expected"), [
    ("0", {None: 0}), ("1", {None: 1}), ("3", {None: 3}), ("", {None: 0}), (" 2 ", {None: 2}),
    ("0:3", {0: 3}), ("0:3,1:1", {0: 3, 1: 1}), ("0:3, 1:0", {0: 3, 1: 0}), ("7:2", {7: 2}),
])
def test_parse_std_spec(spec, expected) -> None:
    assert parse_std_spec(spec) == expected


@pytest.mark.parametrize("spec", ["4", "9", "-1", "a", "0:4", "0:", ":1", "x:1", "0:3,", "0:3,1", "1.5"])
@pytest.mark.parametrize("flag", ["--redirects", "--tee"])
def test_parse_std_spec_rejects(spec, flag) -> None:
    with pytest.raises(ConfigError) as info:
        parse_std_spec(spec, flag)
    assert str(info.value).startswith(f"{flag} ")


# -- agent.worker_env --------------------------------------------------------------------------

PLAN = Plan(gen=3, members=("n0", "n1"), slots={"n0": 2, "n1": 2}, store_host="10.0.0.1", store_port=29400,
            leader="n0", restarts=2, in_place_restarts=1)


def env_config(node: str, nproc: int = 2) -> AgentConfig:
    return AgentConfig(job_id="job-7", node=node, host="h", endpoint="", min_nodes=2, max_nodes=2,
                       worker=WorkerSpec(("python", "train.py"), nproc_per_node=nproc, role="trainer",
                                         max_restarts=5))


@pytest.mark.parametrize(("node", "local_rank", "rank", "group_rank"), [
    ("n0", 0, 0, 0), ("n0", 1, 1, 0), ("n1", 0, 2, 1), ("n1", 1, 3, 1),
])
def test_worker_env(node, local_rank, rank, group_rank) -> None:
    base = {"PATH": "/usr/bin", "RANK": "99", "WORLD_SIZE": "99"}
    env = worker_env(base, env_config(node), PLAN, local_rank, "/logs/error.json")
    expected = {
        "PATH": "/usr/bin",
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "trainer",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "job-7",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_ERROR_FILE": "/logs/error.json",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1",
    }
    assert {k: env[k] for k in expected} == expected
    assert env["TMRUN_GENERATION"] == "3" and env["TMRUN_NODE"] == node
    assert all(isinstance(v, str) for v in env.values())
    assert base == {"PATH": "/usr/bin", "RANK": "99", "WORLD_SIZE": "99"}  # the base is not changed


@pytest.mark.parametrize(("base", "nproc", "expected"), [
    ({}, 2, "1"),
    ({"OMP_NUM_THREADS": "8"}, 2, "8"),
    ({}, 1, None),
    ({"OMP_NUM_THREADS": "8"}, 1, "8"),
])
def test_worker_env_omp_num_threads(base, nproc, expected) -> None:
    plan = Plan(1, ("n0",), {"n0": nproc}, "h", 1, "n0")
    env = worker_env(base, env_config("n0", nproc), plan, 0, "/e.json")
    assert env.get("OMP_NUM_THREADS") == expected


def test_worker_env_for_a_node_outside_the_plan_fails() -> None:
    with pytest.raises((KeyError, ValueError)):
        worker_env({}, env_config("n9"), PLAN, 0, "/e.json")
