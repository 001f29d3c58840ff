"""The job's history file (agent/history.py) against the in-memory store, and ``tmrun events``
reading it once the job is gone.

The end-to-end test runs a short local job for real and reads its events after it ended.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from agent.errors import HistoryError, JobNotFound, StoreError, TmrunError
from agent import history
from agent.history import (append_event, default_log_root, history_path, list_histories, load_history, read_events,
                           save_history)
from agent.keys import JobKeys
from agent.memory_store import MemoryStore
from agent.records import EventRecord, Outcome
from tests.harness import EXAMPLE, FAST, run_tmrun
from tmrun import admin
from tmrun.cli import main

pytestmark = pytest.mark.timeout(30)

JOB = "hist-unit"


def test_events_are_capped_to_the_latest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history, "MAX_EVENTS", 5)
    keys = JobKeys(JOB)

    async def go() -> tuple[list[dict], dict]:
        store = MemoryStore()
        await store.put(keys.plan, {"v": 1})  # other keys are never touched
        for seq in range(1, 13):
            await append_event(store, keys, seq, EventRecord(float(seq), "start", f"event {seq}", seq))
        await append_event(store, keys, 12, EventRecord(99.0, "swap", "again", 12), once=True)  # kept the first
        await append_event(store, keys, 13, EventRecord(13.0, "swap", "event 13", 13), once=True)
        entries, _ = await store.get_prefix(keys.root)
        return await read_events(store, JOB), entries

    rows, entries = asyncio.run(go())
    assert [row["text"] for row in rows] == [f"event {seq}" for seq in range(9, 14)]
    assert keys.plan in entries and len(entries) == 6


def _fill(store: MemoryStore, job: str = JOB, *, outcome: bool = True) -> None:
    keys = JobKeys(job)

    async def go() -> None:
        await store.put(keys.event(2), EventRecord(2.0, "failure", "node-1 failed", 2, {"members": ["a"]}).to_dict())
        await store.put(keys.event(1), EventRecord(1.0, "start", "generation 1", 1, {"members": ["a", "b"]}).to_dict())
        await store.put(keys.event(3), {"v": 99, "at": 3.0})  # another version: skipped, as for a live job
        if outcome:
            await store.put(keys.outcome, Outcome("succeeded", "all workers exited 0", 2, 4.0).to_dict())

    asyncio.run(go())


def _save(store: MemoryStore, root: Path, job: str = JOB) -> Path | None:
    return asyncio.run(save_history(store, job, root))


# -- paths -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("environ", "expected"), [
    ({"TMRUN_LOG_DIR": "/x/logs", "XDG_STATE_HOME": "/s", "HOME": "/h"}, "/x/logs"),
    ({"TMRUN_LOG_DIR": "", "XDG_STATE_HOME": "/s", "HOME": "/h"}, "/s/tmrun/logs"),
    ({"HOME": "/h"}, "/h/.local/state/tmrun/logs"),
])
def test_default_log_root(environ, expected) -> None:
    assert default_log_root(environ) == Path(expected)


def test_default_log_root_without_home_is_absolute() -> None:
    assert default_log_root({}).is_absolute()


def test_history_path(tmp_path: Path) -> None:
    assert history_path(tmp_path, "job-1") == tmp_path / "job-1" / "events.jsonl"
    assert history_path(str(tmp_path), "job-1") == tmp_path / "job-1" / "events.jsonl"


# -- save and load -----------------------------------------------------------------------------


def test_round_trip_has_the_rows_of_a_live_job(tmp_path: Path) -> None:
    store = MemoryStore()
    _fill(store)
    path = _save(store, tmp_path)
    assert path == history_path(tmp_path, JOB)
    header, rows = load_history(path)
    assert rows == asyncio.run(admin.events(store, JOB))  # the same rows as `tmrun events` on the live job
    assert [r["kind"] for r in rows] == ["start", "failure"]
    assert header["v"] == 1 and header["job"] == JOB
    assert header["outcome"] == Outcome("succeeded", "all workers exited 0", 2, 4.0).to_dict()
    assert isinstance(header["written"], float)
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and all(isinstance(json.loads(line), dict) for line in lines)
    assert os.listdir(path.parent) == ["events.jsonl"]  # no temporary file left behind


def test_no_outcome_yet_and_no_events(tmp_path: Path) -> None:
    store = MemoryStore()
    header, rows = load_history(_save(store, tmp_path))
    assert header["outcome"] is None and rows == []


def test_a_new_save_replaces_the_old(tmp_path: Path) -> None:
    store = MemoryStore()
    _fill(store, outcome=False)
    first = _save(store, tmp_path)
    assert load_history(first)[0]["outcome"] is None
    _fill(store)
    assert _save(store, tmp_path) == first
    header, rows = load_history(first)
    assert header["outcome"]["state"] == "succeeded" and len(rows) == 2


def test_only_this_jobs_events(tmp_path: Path) -> None:
    store = MemoryStore()
    _fill(store)
    _fill(store, "other")
    asyncio.run(store.put(JobKeys("other").event(9), EventRecord(9.0, "drain", "x", 3).to_dict()))
    _, rows = load_history(_save(store, tmp_path))
    assert len(rows) == 2
    assert list_histories(tmp_path) == [JOB]
    _save(store, tmp_path, "other")
    assert list_histories(tmp_path) == [JOB, "other"]
    assert list_histories(tmp_path / "missing") == []


def test_store_gone_returns_none_with_one_warning(tmp_path: Path, caplog) -> None:
    store = MemoryStore()
    _fill(store)
    asyncio.run(store.close())
    with caplog.at_level("WARNING", logger="tmrun.history"):
        assert _save(store, tmp_path) is None
    assert len(caplog.records) == 1 and JOB in caplog.records[0].getMessage()
    assert not history_path(tmp_path, JOB).exists()


def test_unwritable_log_root_returns_none(tmp_path: Path, caplog) -> None:
    (tmp_path / "file").write_text("")
    store = MemoryStore()
    with caplog.at_level("WARNING", logger="tmrun.history"):
        assert _save(store, tmp_path / "file") is None  # a file where the directory should be
    assert len(caplog.records) == 1


def test_read_events_raises_store_errors() -> None:
    store = MemoryStore()
    asyncio.run(store.close())
    with pytest.raises(StoreError):
        asyncio.run(read_events(store, JOB))


def test_missing_file_is_job_not_found(tmp_path: Path) -> None:
    with pytest.raises(JobNotFound) as info:
        load_history(history_path(tmp_path, "nope"))
    assert info.value.exit_code == 5
    assert "\n" not in str(info.value) and "nope" in str(info.value)


HEADER = json.dumps({"v": 1, "job": JOB, "outcome": None, "written": 1.0})
ROW = json.dumps(EventRecord(1.0, "start", "generation 1", 1).to_dict())


@pytest.mark.parametrize(("text", "part"), [
    ("", "empty"),
    ("\n\n", "empty"),
    ("{not json\n", "line 1: not JSON"),
    ("[1, 2]\n", "line 1: not a JSON object"),
    (json.dumps({"v": 2, "job": JOB, "outcome": None}) + "\n", "not a version 1 header"),
    (json.dumps({"v": 1, "outcome": None}) + "\n", "not a version 1 header"),
    (json.dumps({"v": 1, "job": JOB}) + "\n", "not a version 1 header"),
    (json.dumps({"v": 1, "job": JOB, "outcome": {"v": 1, "state": "succeeded"}}) + "\n", "line 1: Outcome"),
    (HEADER + "\n" + ROW + "\n" + "{\"v\": 1, \"kind\": \"x\"}\n", "line 3: EventRecord"),
    (HEADER + "\n" + json.dumps({"v": 1, "at": "noon", "kind": "start", "text": "", "gen": 1}) + "\n",
     "line 2: EventRecord.at: 'noon' is not float"),
    (HEADER + "\n" + ROW + "\ntruncated", "line 3: not JSON"),
])
def test_malformed_file(tmp_path: Path, text: str, part: str) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(text)
    with pytest.raises(HistoryError) as info:
        load_history(path)
    assert isinstance(info.value, TmrunError) and info.value.exit_code == 1
    assert part in str(info.value) and "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_directory_is_not_a_history(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").mkdir()
    with pytest.raises(HistoryError):
        load_history(tmp_path / "events.jsonl")


# -- `tmrun events` on a history, in process -----------------------------------------------------


def _one_error_line(err: str, *parts: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("tmrun: error: "), err
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def test_events_reads_the_history_of_a_job_that_is_not_running(tmp_path: Path, capsys) -> None:
    store = MemoryStore()
    _fill(store)
    _save(store, tmp_path / "logs")  # TMRUN_LOG_DIR (tests/conftest.py)
    assert main(["events", "--job", JOB, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == asyncio.run(admin.events(store, JOB))
    assert captured.err == ""
    assert main(["events", "--job", JOB]) == 0
    captured = capsys.readouterr()
    assert "generation 1" in captured.out and "node-1 failed" in captured.out
    assert "has ended (succeeded: all workers exited 0)" in captured.err


def test_events_without_job_takes_the_only_history(tmp_path: Path, capsys) -> None:
    store = MemoryStore()
    _fill(store)
    _save(store, tmp_path / "logs")
    assert main(["events", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2
    _save(store, tmp_path / "logs", "second")
    assert main(["events", "--json"]) == 5
    captured = capsys.readouterr()
    _one_error_line(captured.err, "2 job histories", JOB, "second", "--job")
    assert captured.out == ""


def test_events_log_dir_flag_wins(tmp_path: Path, capsys) -> None:
    store = MemoryStore()
    _fill(store)
    _save(store, tmp_path / "elsewhere")
    assert main(["events", "--job", JOB, "--json"]) == 5
    capsys.readouterr()
    assert main(["events", "--job", JOB, "--json", "--log-dir", str(tmp_path / "elsewhere")]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2


def test_events_unknown_job_exits_5_and_names_where_it_looked(tmp_path: Path, _runtime_dir, capsys) -> None:
    assert main(["events", "--job", "nope"]) == 5
    captured = capsys.readouterr()
    _one_error_line(captured.err, "'nope'", str(_runtime_dir), str(tmp_path / "logs" / "nope" / "events.jsonl"))
    assert captured.out == ""


def test_events_malformed_history_exits_1(tmp_path: Path, capsys) -> None:
    path = history_path(tmp_path / "logs", JOB)
    path.parent.mkdir(parents=True)
    path.write_text("{not json\n")
    assert main(["events", "--job", JOB]) == 1
    _one_error_line(capsys.readouterr().err, str(path), "not JSON")


def test_events_with_an_endpoint_reads_only_etcd(tmp_path: Path, capsys) -> None:
    store = MemoryStore()
    _fill(store)
    _save(store, tmp_path / "logs")
    code = main(["events", "--job", JOB, "--rdzv-endpoint", "etcd://127.0.0.1:1", "--store-timeout", "0.5"])
    assert code == 3
    _one_error_line(capsys.readouterr().err, "unreachable")


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_events_after_a_local_job_ended(jobs, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    env = {"TMRUN_LOG_DIR": str(logs)}
    job = jobs(["--nnodes", "1", "--rdzv-id", "hist-test", "--rdzv-conf", FAST, str(EXAMPLE), "--steps", "3",
                "--out", str(tmp_path / "final.pt")], env=env)
    assert job.wait(120) == 0, job.err.text()[-3000:]
    path = history_path(logs, "hist-test")
    assert f"job hist-test: history in {path}" in job.err.text()

    done = run_tmrun(["events", "--job", "hist-test", "--json"], tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert rows[0]["kind"] == "start" and rows[0]["gen"] == 1
    assert rows[-1]["kind"] == "succeeded"
    header, _ = load_history(path)
    assert header["job"] == "hist-test" and header["outcome"]["state"] == "succeeded"

    missing = run_tmrun(["events", "--job", "nope"], tmp_path, env=env)
    assert missing.returncode == 5
    _one_error_line(missing.stderr, "'nope'", str(history_path(logs, "nope")))
    assert missing.stdout == ""
