"""The cache entries a run used, recorded in its folder (nip_like.cache_record); run.fresh_cache; warnings on resume and evaluate."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nip_like import cache_record
from nip_like.cache_record import CACHES_FILE, changes, content_checksum, record, recording, redirected, warn_changes
from nip_like.checkpoint import file_sha256, write_manifest
from nip_like.cli import report_errors
from nip_like.config import run_id
from nip_like.evaluate import evaluate_run
from nip_like.experiment import SUMMARY_FILE, preflight, run_experiment
from nip_like.job_log import LOG
from nip_like.lm import gguf
from nip_like.scenarios.duplicates.data import DuplicateLists, DuplicateSpec, cache_path, load_or_generate
from tests.conftest import Stopped, smoke_config, stop_at

SPEC = DuplicateSpec(num_lists=8, length=2, num_values=4)


def header_checksum(path: Path) -> str:
    """The SHA-256 that a file written by save_atomic names in its header line."""
    return path.read_bytes().split(b"\n", 1)[0].decode().rsplit("sha256=", 1)[1]


def entries_of(run_dir: Path) -> list[dict[str, str]]:
    """The cache entries a run's summary records."""
    return json.loads((run_dir / SUMMARY_FILE).read_text())["caches"]


def listing(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` and its modification time (ns)."""
    return {str(path.relative_to(folder)): path.stat().st_mtime_ns for path in sorted(folder.rglob("*")) if path.is_file()}


# ------------------------------------------------------------------ the record


def test_a_run_records_each_entry_once_in_its_folder_as_it_is_used(tmp_path):
    file = tmp_path / "run" / CACHES_FILE
    with recording(file) as caches:
        assert json.loads(file.read_text()) == {"entries": []}  # written at once: a killed run keeps what it has
        load_or_generate(SPEC, tmp_path / "cache")
        load_or_generate(SPEC, tmp_path / "cache")  # read again in the same run: the same entry
    path = cache_path(SPEC, tmp_path / "cache")
    expected = {"kind": "dataset", "key": path.stem, "checksum": header_checksum(path), "path": str(path.resolve()), "action": "built"}
    assert caches.as_dicts() == [expected]
    assert json.loads(file.read_text()) == {"entries": [expected]}
    with recording(tmp_path / "second.json") as second:
        load_or_generate(SPEC, tmp_path / "cache")
    assert second.as_dicts() == [{**expected, "action": "reused"}]


def test_outside_a_run_nothing_is_recorded_and_an_unknown_kind_is_refused(tmp_path):
    load_or_generate(SPEC, tmp_path)
    assert cache_record.current() is None and record("dataset", "k", cache_path(SPEC, tmp_path), built=False) is None
    with pytest.raises(ValueError, match=r"kind must be one of \['dataset', 'warm start'"):
        record("datasets", "k", tmp_path, built=True)


def test_a_resumed_run_keeps_the_entries_of_its_earlier_sessions(tmp_path):
    file = tmp_path / CACHES_FILE
    with recording(file):
        record("chat model", "a", _folder(tmp_path / "a"), built=True)
    with recording(file, keep=True) as resumed:
        record("chat model", "a", tmp_path / "a", built=False)  # the same contents: listed once, as built
        record("chat model", "b", _folder(tmp_path / "b"), built=True)
    assert [(entry.key, entry.action) for entry in resumed.entries] == [("a", "built"), ("b", "built")]
    with recording(file) as fresh:
        pass
    assert fresh.entries == [] and json.loads(file.read_text()) == {"entries": []}


def _folder(folder: Path, text: str = "weights") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.bin").write_text(text)
    return folder


def test_the_checksum_is_the_one_the_cache_keeps_where_it_keeps_one(tmp_path):
    load_or_generate(SPEC, tmp_path)
    path = cache_path(SPEC, tmp_path)
    assert content_checksum(path) == header_checksum(path) != file_sha256(path)  # save_atomic's header
    plain = tmp_path / "plain.txt"
    plain.write_text("text")
    assert content_checksum(plain) == file_sha256(plain)
    folder = _folder(tmp_path / "model")
    before = content_checksum(folder)
    _folder(folder, "other weights")
    assert content_checksum(folder) != before  # no manifest: the files themselves
    manifest = write_manifest(folder)
    assert content_checksum(folder) == file_sha256(manifest)


def test_an_entry_is_one_line_of_the_job_log(tmp_path):
    log_file = tmp_path / "__main__.log"
    handler, root = logging.FileHandler(log_file), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        with recording():
            load_or_generate(SPEC, tmp_path)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()
    path = cache_path(SPEC, tmp_path)
    assert LOG.name == "nip_like.progress"
    assert log_file.read_text() == f"cache: dataset {path.stem} built (sha256 {header_checksum(path)[:12]}) {path.resolve()}\n"


# ------------------------------------------------------------------ changed and gone entries


def test_a_changed_or_gone_entry_is_one_warning_line_each(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with recording(run_dir / CACHES_FILE):
        load_or_generate(SPEC, tmp_path / "cache")
        model = record("chat model", "tiny", _folder(tmp_path / "tiny"), built=True)
    assert changes(run_dir) == [] and changes(tmp_path / "no run") == []
    path = cache_path(SPEC, tmp_path / "cache")
    other, metadata = DuplicateLists.read(path)
    other[[1, 0, *range(2, len(other))]].save(path, metadata=metadata)  # another dataset under the same key
    _folder(tmp_path / "tiny").joinpath("model.bin").unlink()
    (tmp_path / "tiny").rmdir()
    lines = warn_changes(run_dir)
    err = capsys.readouterr().err
    assert err == "".join(f"warning: {line}\n" for line in lines) and len(lines) == 2
    assert lines[0].startswith(f"the dataset cache entry {path.stem} that the run used ({path.resolve()}) has changed since: sha256 ")
    assert lines[1] == f"the chat model cache entry tiny that the run used ({model.path}) is gone; it will be built again if needed"


def test_an_unreadable_record_is_one_warning_line_and_a_resumed_record_starts_again(tmp_path):
    (tmp_path / CACHES_FILE).write_text("{not json")
    assert changes(tmp_path) == [f"{tmp_path / CACHES_FILE} cannot be read as a record of cache entries (JSONDecodeError)"]
    with recording(tmp_path / CACHES_FILE, keep=True) as resumed:
        assert resumed.entries == []
    assert json.loads((tmp_path / CACHES_FILE).read_text()) == {"entries": []}


# ------------------------------------------------------------------ run.fresh_cache


def test_fresh_cache_moves_every_cache_dir_into_the_run_folder_and_keeps_the_run_id(tmp_path):
    config = OmegaConf.create({
        "seed": 0, "protocol": {"name": "nip"}, "run": {"fresh_cache": True},
        "scenario": {"cache_dir": "/shared/data", "agents": [{"cache_dir": "/shared/models"}]},
        "trainer": {"pretrain": {"cache_dir": "/shared/warm", "epochs": 2}},
    })
    moved = redirected(config, tmp_path / "cache")
    assert moved.scenario.cache_dir == str(tmp_path / "cache" / "scenario")
    assert moved.scenario.agents[0].cache_dir == str(tmp_path / "cache" / "scenario.agents.0")
    assert moved.trainer.pretrain == {"cache_dir": str(tmp_path / "cache" / "trainer.pretrain"), "epochs": 2}
    assert config.scenario.cache_dir == "/shared/data"  # a copy
    assert run_id(moved) == run_id(config)


def test_gguf_conversions_go_into_the_fresh_cache_of_the_run_in_progress(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf.CACHE_ENV, str(tmp_path / "shared"))
    assert gguf.cache_root() == tmp_path / "shared"
    with recording(fresh_root=tmp_path / "run" / "cache"):
        assert gguf.cache_root() == tmp_path / "run" / "cache" / "gguf"
    with recording():
        assert gguf.cache_root() == tmp_path / "shared"


def test_fresh_cache_is_a_boolean_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info, report_errors():
        smoke_config("run.fresh_cache=maybe")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "run.fresh_cache" in err, err


def test_the_check_before_the_run_folder_touches_no_shared_cache_with_fresh_cache(tmp_path):
    config = smoke_config("scenario=graph_isomorphism", "protocol=nip", f"scenario.cache_dir={tmp_path / 'data'}", "run.fresh_cache=true")
    checked = preflight(config)
    assert checked.scenario.config.cache_dir != str(tmp_path / "data") and not (tmp_path / "data").exists()


# ------------------------------------------------------------------ whole runs


def graph_run(tmp_path: Path, *overrides: str):
    """A graph-isomorphism run of a few seconds with a dataset and a warm start, both cached under ``tmp_path``."""
    return smoke_config(
        "scenario=graph_isomorphism", "protocol=nip", "protocol.max_rounds=2", "scenario.num_pairs=60",
        f"scenario.cache_dir={tmp_path / 'data'}", f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
        "trainer.pretrain.agents=[verifier]", "trainer.pretrain.epochs=1", "trainer.num_iterations=2",
        "trainer.eval.every=0", "trainer.num_test_episodes=32", "trainer.test_batch_episodes=32", *overrides,
    )


@pytest.mark.slow  # three short runs: about 10 s
def test_runs_record_their_entries_built_then_reused_and_fresh_cache_builds_them_in_the_run_folder(tmp_path, capsys):
    config = graph_run(tmp_path)
    run_experiment(config, tmp_path / "first", handle_signals=False)
    first = {entry["kind"]: entry for entry in entries_of(tmp_path / "first")}
    assert sorted(first) == ["dataset", "warm start"] and {entry["action"] for entry in first.values()} == {"built"}
    assert Path(first["dataset"]["path"]).parent == tmp_path / "data" and Path(first["warm start"]["path"]).parent == tmp_path / "warm"
    assert json.loads((tmp_path / "first" / CACHES_FILE).read_text())["entries"] == entries_of(tmp_path / "first")
    shared = listing(tmp_path)

    run_experiment(config, tmp_path / "second", handle_signals=False)
    second = {entry["kind"]: entry for entry in entries_of(tmp_path / "second")}
    assert second == {kind: {**entry, "action": "reused"} for kind, entry in first.items()}

    run_experiment(graph_run(tmp_path, "run.fresh_cache=true"), tmp_path / "fresh", handle_signals=False)
    fresh = {entry["kind"]: entry for entry in entries_of(tmp_path / "fresh")}
    own = tmp_path / "fresh" / "cache"
    assert Path(fresh["dataset"]["path"]) == own / "scenario" / Path(first["dataset"]["path"]).name
    assert Path(fresh["warm start"]["path"]) == own / "trainer.pretrain" / Path(first["warm start"]["path"]).name
    assert {entry["action"] for entry in fresh.values()} == {"built"}
    assert json.loads((tmp_path / "fresh" / SUMMARY_FILE).read_text())["fresh_cache"] is True
    assert {name: time for name, time in listing(tmp_path).items() if name.startswith(("data/", "warm/"))} == {
        name: time for name, time in shared.items() if name.startswith(("data/", "warm/"))
    }
    # Evaluating the fresh run reads its own caches: nothing changed, nothing warned, the shared ones untouched.
    capsys.readouterr()
    evaluate_run(tmp_path / "fresh")
    assert "warning:" not in capsys.readouterr().err
    assert sorted(name for name in listing(tmp_path) if name.startswith(("data/", "warm/"))) == sorted(
        name for name in shared if name.startswith(("data/", "warm/"))
    )


@pytest.mark.slow  # a stopped run, resumed, then evaluated: about 8 s
def test_resume_and_evaluate_warn_of_an_entry_changed_or_gone_since_the_run_used_it(tmp_path, monkeypatch, capsys):
    from nip_like.resume import main as resume

    config = graph_run(tmp_path, "run.checkpoint_every=1")
    run_dir = tmp_path / "run"
    stop_at(monkeypatch, 1, Stopped)
    with pytest.raises(Stopped):
        run_experiment(config, run_dir, handle_signals=False)
    monkeypatch.undo()
    assert not (run_dir / SUMMARY_FILE).exists()
    used = {entry["kind"]: entry for entry in json.loads((run_dir / CACHES_FILE).read_text())["entries"]}
    assert sorted(used) == ["dataset", "warm start"]  # the killed run's record is in its folder
    dataset, warm = Path(used["dataset"]["path"]), Path(used["warm start"]["path"])
    pairs, metadata = load_dataset(dataset)
    pairs[list(range(len(pairs)))[::-1]].save(dataset, metadata=metadata)  # other data under the same key
    warm.unlink()
    capsys.readouterr()
    assert resume([str(run_dir)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2, warnings
    assert f"the dataset cache entry {dataset.stem} that the run used ({dataset}) has changed since" in warnings[0]
    assert warnings[1] == f"warning: the warm start cache entry {warm.stem} that the run used ({warm}) is gone; it will be built again if needed"
    # The resumed session read the dataset as it is now and built the warm start again: the record lists both sessions'.
    entries = entries_of(run_dir)
    assert [entry["action"] for entry in entries if entry["kind"] == "dataset"] == ["built", "reused"] and warm.is_file()
    warm_starts = [entry["action"] for entry in entries if entry["kind"] == "warm start"]
    assert warm_starts and set(warm_starts) == {"built"}  # once, or twice if the second fit's file differs
    assert changes(run_dir) == []

    dataset.unlink()
    evaluate_run(run_dir)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings == [f"warning: the dataset cache entry {dataset.stem} that the run used ({dataset}) is gone; it will be built again if needed"]


def load_dataset(path: Path):
    """The graph pairs of a cache file and their metadata."""
    from nip_like.scenarios.graph_isomorphism.data import GraphPairs

    return GraphPairs.read(path)
