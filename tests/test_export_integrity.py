"""The folders a run writes for its LM agents: exportable for every LoRA run, and checked against their checksums.

One tiny run of ``preset=lm_quick`` with LoRA adapters on bases built from
config serves every test here: the prover's adapters warm-started on the
base as built, the verifier's added after a warm start that fitted its whole
model. Each test that damages a file works on its own copy of the run folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from nip_like.checkpoint import MANIFEST_FILE, check_manifest, write_manifest
from nip_like.errors import CheckpointError
from nip_like.evaluate import main as evaluate_main
from nip_like.evaluate import evaluate_run, rebuilt_trainer
from nip_like.experiment import SUMMARY_FILE, run_experiment
from nip_like.export import export_run
from nip_like.export import main as export_main
from nip_like.resume import main as resume_main
from tests.conftest import make_config

#: The issue's run (``preset=lm_quick scenario.default_agent.lora.r=4``), made tiny: about two seconds on one core.
TINY_LM_QUICK = (
    "preset=lm_quick", "scenario.default_agent.lora.r=4", "scenario.num_lists=300",
    "scenario.default_agent.hidden_size=16", "scenario.default_agent.num_layers=1", "scenario.default_agent.num_heads=2",
    "scenario.default_agent.intermediate_size=32", "trainer.num_iterations=1", "trainer.num_envs=8",
    "trainer.frames_per_batch=48", "trainer.minibatch_size=24", "trainer.num_epochs=1", "trainer.pretrain.epochs=1",
    "trainer.pretrain.agent_epochs={}", "trainer.pretrain.warmup_steps=1", "trainer.num_test_episodes=16",
    "trainer.test_batch_episodes=16", "trainer.eval.every=1", "trainer.eval.num_episodes=16",
    "run.progress_bar=false", "logger=none",
    # The verifier's adapters come after a warm start that fits every weight: its base is neither the config's nor a folder.
    "+scenario.agents.verifier={lora: {r: 4, warm_start: full}}",
)
#: Prompts of the tiny models' vocabulary.
IDS = torch.tensor([[1, 5, 9, 12, 7, 3], [2, 4, 4, 8, 10, 6]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """The finished run folder (read only: tests that damage it copy it first)."""
    root = tmp_path_factory.mktemp("lora_run")
    config = make_config(*TINY_LM_QUICK, f"scenario.cache_dir={root / 'data'}", f"trainer.pretrain.cache_dir={root / 'warm'}")
    run_experiment(config, root / "run", handle_signals=False)
    return root / "run"


@pytest.fixture(scope="module")
def run_logits(lora_run) -> dict[str, torch.Tensor]:
    """Each agent's logits as the run's own trainer gives them: rebuilt as evaluate rebuilds it.

    The prover's from-config base comes from the config and seed, its adapters from ``last.pt``, none of it from
    the agent folders; the verifier's fitted base from its ``base/`` (the evaluate test shows that it is the one
    the run tested with).
    """
    with rebuilt_trainer(lora_run, "last") as (trainer, _, _):
        assert [trainer.policy.policy(name).fitted_base for name in ("prover", "verifier")] == [False, True]
        return {name: logits(trainer.policy.policy(name).model) for name in trainer.agent_names}


def test_evaluate_reproduces_the_logged_test_of_lora_agents_with_a_fitted_base(lora_run):
    # The checkpoint file leaves the verifier's fitted base out; evaluate (no warm start) reads it from base/.
    logged = json.loads((lora_run / SUMMARY_FILE).read_text())["test_metrics"]
    assert evaluate_run(lora_run, "last")["metrics"] == logged


def copied(run: Path, tmp_path: Path) -> Path:
    """A copy of the run folder, to damage."""
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def flip_bytes(path: Path, count: int = 64) -> None:
    """Invert ``count`` bytes in the middle of ``path``, in place (its size unchanged)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(255 - byte for byte in data[middle:middle + count])
    path.write_bytes(bytes(data))


def test_a_from_config_lora_run_exports_to_folders_that_give_its_logits(lora_run, run_logits, tmp_path, capsys):
    for name, live in run_logits.items():
        saved = lora_run / "checkpoints" / "last" / name
        # The adapter folder names a base a user can load: the from-config base the run trained on, saved beside it.
        base = json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert base == "base" and not (saved / "model.safetensors").exists()  # relative to the adapter folder
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(saved / base, local_files_only=True), saved)
        torch.testing.assert_close(logits(model), live, atol=1e-5, rtol=1e-5)
        assert check_manifest(saved) and check_manifest(saved / "base")
    assert export_main([str(lora_run), "--out", str(tmp_path / "exported")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "exported" / name) for name in sorted(run_logits)]
    for name, live in run_logits.items():
        exported = tmp_path / "exported" / name
        torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)), live, atol=1e-5, rtol=1e-5)
        assert check_manifest(exported)  # an exported folder is checked when a run starts from it


def test_a_moved_run_s_adapters_still_name_their_base(lora_run, run_logits, tmp_path):
    run = copied(lora_run, tmp_path)
    moved = run.rename(tmp_path / "moved")
    for name, live in run_logits.items():
        saved = moved / "checkpoints" / "last" / name
        named = json.loads((saved / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert (saved / named).resolve() == (saved / "base").resolve()  # the moved folder's own base, not the old one's
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(saved / named, local_files_only=True), saved)
        torch.testing.assert_close(logits(model), live, atol=1e-5, rtol=1e-5)


def test_export_refuses_a_run_whose_checkpoint_file_is_cut_short(lora_run, tmp_path, capsys):
    run = copied(lora_run, tmp_path)
    checkpoint = run / "checkpoints" / "last.pt"
    data = checkpoint.read_bytes()
    checkpoint.write_bytes(data[: len(data) // 2])
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(run), "--out", str(tmp_path / "exported")])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and error.count("\n") == 0, error
    assert error.startswith(f"error: checkpoint {checkpoint} is damaged: it holds ") and error.endswith(
        "(truncated or extended); it was not loaded; nothing was exported (its agent folders belong to it)"
    ), error
    assert not (tmp_path / "exported").exists()


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_the_folders_of_older_runs_without_their_base_export_with_the_base_rebuilt(lora_run, run_logits, tmp_path):
    # As nip_like wrote a from-config LoRA agent before: no base/, no manifest, and no base named.
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    for saved in run.glob("checkpoints/*/prover"):  # a fitted base (the verifier's) was saved by those versions too
        shutil.rmtree(saved / "base")
        (saved / MANIFEST_FILE).unlink()
        config = json.loads((saved / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = None
        (saved / "adapter_config.json").write_text(json.dumps(config))
    assert export_main([str(run), "--checkpoint", "last", "--out", str(tmp_path / "exported")]) == 0
    for name, live in run_logits.items():
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "exported" / name, local_files_only=True)
        torch.testing.assert_close(logits(model), live, atol=1e-5, rtol=1e-5)
    # A fitted base cannot be rebuilt from the config: without it, the export is refused, not made on the wrong base.
    verifier = run / "checkpoints" / "last" / "verifier"
    shutil.rmtree(verifier / "base")
    (verifier / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"verifier has no base/model\.safetensors: the base its adapters were added to \(fitted in the warm start\) was not saved$"):
        export_run(run, "last", tmp_path / "again")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize(
    "damaged",
    ["prover/adapter_model.safetensors", "verifier/base/model.safetensors", "prover/value_head.pt", "verifier/adapter_config.json"],
)
def test_a_damaged_file_of_an_agent_folder_fails_export_and_evaluate_in_one_line(lora_run, tmp_path, capsys, damaged):
    run = copied(lora_run, tmp_path)
    path = run / "checkpoints" / "last" / damaged
    flip_bytes(path, count=8 if path.suffix == ".json" else 64)
    before = sorted(str(item) for item in run.rglob("*"))
    for command in (
        lambda: export_main([str(run)]),
        lambda: evaluate_main([str(run), "--checkpoint", "last"]),
    ):
        with pytest.raises(SystemExit) as exit_info:
            command()
        error = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and error.count("\n") == 0, error
        assert error.startswith(f"error: {path} is damaged: its sha256 does not match"), error
    assert sorted(str(item) for item in run.rglob("*")) == before  # nothing written: no exported/, no evaluations/


def test_a_damaged_full_model_folder_fails_export_and_evaluate_and_a_missing_file_is_named(lora_run, tmp_path, capsys):
    # A whole model folder, as a full fine-tuning run saves it: its base/ put in the agent's place.
    run = copied(lora_run, tmp_path)
    agent = run / "checkpoints" / "last" / "prover"
    shutil.rmtree(agent)
    shutil.copytree(lora_run / "checkpoints" / "last" / "prover" / "base", agent)
    assert export_main([str(run), "--out", str(tmp_path / "whole")]) == 0 and (tmp_path / "whole" / "prover" / "model.safetensors").is_file()
    capsys.readouterr()
    flip_bytes(agent / "model.safetensors")
    for command in (lambda: export_main([str(run), "--out", str(tmp_path / "again")]), lambda: evaluate_main([str(run), "--checkpoint", "last"])):
        with pytest.raises(SystemExit) as exit_info:
            command()
        error = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and error == (
            f"error: {agent / 'model.safetensors'} is damaged: its sha256 does not match its folder's {MANIFEST_FILE} "
            f"(flipped bytes, or edited since it was written); nothing of agent folder {agent} was loaded"
        )
    assert not (tmp_path / "again").exists() and not (run / "evaluations").exists()
    (agent / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"is incomplete: .*model\.safetensors is missing, which its checksums\.json lists"):
        check_manifest(agent)


def test_resuming_refuses_a_damaged_agent_folder_of_the_checkpoint(lora_run, tmp_path, capsys):
    run = copied(lora_run, tmp_path)
    path = run / "checkpoints" / "last" / "verifier" / "adapter_model.safetensors"
    flip_bytes(path)
    with pytest.raises(SystemExit) as exit_info:
        resume_main([str(run)])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and error.startswith(f"error: {path} is damaged: its sha256 does not match") and "\n" not in error


def test_folders_without_a_manifest_are_accepted_unchecked_and_a_truncated_file_is_named(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"0123456789" * 100)
    assert check_manifest(folder) is False  # written by an older nip_like, or by the user: no check
    write_manifest(folder)
    assert check_manifest(folder) is True
    (folder / "weights.bin").write_bytes(b"0123456789" * 50)
    with pytest.raises(CheckpointError, match=r"weights\.bin is damaged: it holds 500 bytes, its folder's checksums\.json says 1000"):
        check_manifest(folder)
