"""Damaged text rollouts: a rollouts file whose bytes were flipped, that was cut, edited or shortened is refused in
one line naming it and what to do, never used; a deleted one is sampled again with the same models and seed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from nip_like.errors import CheckpointError, RunInterrupted
from nip_like.experiment import run_experiment
from nip_like.scenarios.duplicates.chat import ScriptedDuplicatesModel
from nip_like.text.interface import Sampling
from nip_like.text.rollouts import load_rollouts, play_episodes, rollout_records, save_rollouts
from tests.test_text import chat_scenario
from tests.test_text_trainer import KEEP_ALL, config, stop_after_stages


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, str, tuple[str, ...]]:
    """A debate's rollouts file, the digest its writer returned and the agents."""
    scenario = chat_scenario("protocol=debate")
    players = {agent: ScriptedDuplicatesModel(scenario.role(agent)) for agent in scenario.agent_names}
    rollouts = play_episodes(scenario, players, {a: Sampling(8) for a in scenario.agent_names}, "train", 6, 3, by_agent=True)
    path = tmp_path_factory.mktemp("rollouts") / "iteration_0000.jsonl"
    digest = save_rollouts(rollouts, scenario.agent_names, scenario.protocol.num_rounds, path)
    return path, digest, scenario.agent_names


def flip_bytes(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes(byte ^ 0xFF for byte in data[middle : middle + 4]) + data[middle + 4 :]


def cut_mid_line(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


def edit_a_reward(data: bytes) -> bytes:
    lines = data.decode().splitlines(keepends=True)
    record = json.loads(lines[2])
    record["returns"] = {name: value + 1.0 for name, value in record["returns"].items()}
    lines[2] = json.dumps(record) + "\n"
    return "".join(lines).encode()


def remove_lines(data: bytes) -> bytes:
    lines = data.decode().splitlines(keepends=True)
    return "".join(lines[:-2]).encode()


def edit_with_a_new_header(data: bytes) -> bytes:
    """An episode edited and the header's checksum and count made to fit: only the run's own digest tells."""
    lines = edit_a_reward(data).decode().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["sha256"] = hashlib.sha256("".join(lines[1:]).encode()).hexdigest()
    return (json.dumps(header) + "\n" + "".join(lines[1:])).encode()


DAMAGES = {
    "flipped bytes": flip_bytes,
    "cut mid-line": cut_mid_line,
    "an edited value": edit_a_reward,
    "lines removed": remove_lines,
    "edited with its header": edit_with_a_new_header,
}


def test_a_saved_file_reads_back_whole_with_and_without_its_digest(saved):
    path, digest, names = saved
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    header = json.loads(path.read_text().splitlines()[0])
    assert header["episodes"] == 6 and len(header["sha256"]) == 64
    assert rollout_records(load_rollouts(path, digest), names) == rollout_records(load_rollouts(path), names)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_rollouts_file_is_refused_in_one_line_naming_it_and_what_to_do(saved, tmp_path, damage):
    path, digest, _ = saved
    damaged = tmp_path / path.name
    damaged.write_bytes(DAMAGES[damage](path.read_bytes()))
    with pytest.raises(CheckpointError) as refused:
        load_rollouts(damaged, digest)
    message = str(refused.value)
    assert "\n" not in message and "its sha256 is not the one the run recorded when it wrote it" in message
    assert message.startswith(f"rollouts file {damaged} is damaged or was edited")
    assert message.endswith("delete it and resume to sample the iteration again with the same models and seed")


@pytest.mark.parametrize("damage", ["flipped bytes", "cut mid-line", "an edited value", "lines removed"])
def test_without_the_runs_digest_the_header_still_catches_damage(saved, tmp_path, damage):
    path, _, _ = saved
    damaged = tmp_path / path.name
    damaged.write_bytes(DAMAGES[damage](path.read_bytes()))
    with pytest.raises(CheckpointError, match="do not match the header's sha256"):
        load_rollouts(damaged)


def test_a_header_that_is_not_utf8_json_or_an_older_layout_is_named(saved, tmp_path):
    path, _, _ = saved
    damaged = tmp_path / path.name
    damaged.write_bytes(b"\xff\xfe" + path.read_bytes())
    with pytest.raises(CheckpointError, match="its header line is not UTF-8 JSON"):
        load_rollouts(damaged)
    lines = path.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    del header["format"], header["sha256"]
    damaged.write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    with pytest.raises(CheckpointError, match="not a nip_like rollouts header of format 2"):
        load_rollouts(damaged)


@pytest.mark.slow
def test_a_resume_refuses_a_damaged_rollouts_file_and_samples_a_deleted_one_again(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    # Stopped after the warm start and the first iteration's sampling, both saved.
    stop_after_stages(monkeypatch, 2)
    with pytest.raises(RunInterrupted):
        run_experiment(config(KEEP_ALL), run_dir)
    monkeypatch.undo()
    path = run_dir / "rollouts" / "iteration_0000.jsonl"
    state_file = run_dir / "checkpoints" / "state.json"
    original, state = path.read_bytes(), state_file.read_text()
    assert json.loads(state)["stage"] == "log_stats"
    assert json.loads(state)["rollouts_sha256"] == hashlib.sha256(original).hexdigest()
    path.write_bytes(edit_with_a_new_header(original))
    with pytest.raises(CheckpointError, match="iteration_0000.jsonl is damaged or was edited"):
        run_experiment(config(KEEP_ALL), run_dir, resume=True)
    assert state_file.read_text() == state  # nothing was trained on it, nothing saved
    # Deleted, as the message says: the resume samples the iteration again, to the same file, and goes on.
    path.unlink()
    stop_after_stages(monkeypatch, 1)
    capsys.readouterr()
    with pytest.raises(RunInterrupted):
        run_experiment(config(KEEP_ALL), run_dir, resume=True)
    assert "is missing: sampling iteration 0's rollouts again with the same models and seed" in capsys.readouterr().out
    assert path.read_bytes() == original
    assert json.loads(state_file.read_text())["stage"] == "test"
