"""Frozen co-players (``frozen_from``): an agent of a finished run plays, untouched, beside agents that train."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from nip_like import experiment
from nip_like.checkpoint import load_checked, write_manifest
from nip_like.errors import CheckpointError, ConfigError
from nip_like.experiment import run_experiment
from nip_like.export import main as export_main
from tests.conftest import stopped_and_resumed
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_lm_chat import chat_config

IDS = torch.randint(300, 900, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def earlier_run(chat_model, tmp_path_factory):
    """A finished run of the tiny chat game whose agents trained LoRA adapters (2 iterations)."""
    folder = chat_model("qwen2")
    root = tmp_path_factory.mktemp("earlier")
    config = chat_config(folder, root, "scenario.default_agent.lora.r=4", "trainer.num_iterations=2")
    run_experiment(config, root / "run")
    return folder, root / "run"


def frozen(folder, tmp_path, source, *overrides: str):
    """The game with a new prover (rank-4 adapters) against the verifier loaded frozen from ``source``."""
    return chat_config(
        folder, tmp_path, "scenario.default_agent.lora.r=4",
        f"+scenario.agents.verifier={{frozen_from: {source}, max_new_tokens: 12}}", *overrides,
    )


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.slow
def test_a_new_prover_trains_against_the_frozen_verifier_of_an_earlier_run(earlier_run, tmp_path):
    folder, run = earlier_run
    trainer = experiment.build_trainer(frozen(folder, tmp_path, run, "trainer.num_iterations=2"), tmp_path / "run")
    verifier = trainer.policy.policy("verifier")
    # The verifier plays with the earlier run's last weights (its adapters merged into the base), all frozen.
    saved = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, local_files_only=True), run / "checkpoints" / "last" / "verifier")
    torch.testing.assert_close(logits(verifier.model), logits(saved), atol=1e-5, rtol=1e-5)
    assert not any(param.requires_grad for param in verifier.parameters())
    assert verifier.value_head is None  # none unless asked
    assert [group["agent"] for group in trainer.optimizer.param_groups] == ["prover"]
    assert not any(True for _ in trainer.reference_policy.parameters())  # its own reference: no copy
    before = {name: param.clone() for name, param in verifier.named_parameters()}
    prover_before = {name: param.clone() for name, param in trainer.policy.policy("prover").named_parameters() if param.requires_grad}

    trainer.train()
    trainer.save_checkpoint("last")
    assert all(torch.equal(param, before[name]) for name, param in verifier.named_parameters())
    prover = dict(trainer.policy.policy("prover").named_parameters())
    assert any(not torch.equal(prover[name], value) for name, value in prover_before.items())
    # The checkpoint holds none of the verifier's weights, only where they came from.
    state = load_checked(trainer.checkpoint_dir / "last.pt")["trainer"]
    assert not any("verifier" in key for key in state["loss_module"]) and any("prover" in key for key in state["loss_module"])
    record = state["frozen_agents"]["verifier"]
    assert record["folder"] == str((run / "checkpoints" / "last" / "verifier").resolve()) and len(record["checksum"]) == 64
    assert sorted(path.name for path in (trainer.checkpoint_dir / "last").iterdir()) == ["prover"]


@pytest.mark.slow
def test_a_frozen_co_player_plays_from_an_exported_folder(earlier_run, tmp_path):
    folder, run = earlier_run
    assert export_main([str(run), "--out", str(tmp_path / "exported")]) == 0
    exported = tmp_path / "exported" / "verifier"
    trainer = experiment.build_trainer(frozen(folder, tmp_path, exported, "+scenario.agents.verifier.value_head=true"), tmp_path / "run")
    verifier = trainer.policy.policy("verifier")
    merged = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    torch.testing.assert_close(logits(verifier.model), logits(merged), atol=1e-6, rtol=1e-6)
    # Asked for, the value head is the exported one, frozen too.
    assert verifier.value_head is not None and not any(param.requires_grad for param in verifier.value_head.parameters())
    trainer.train()


@pytest.mark.slow
def test_a_run_with_a_frozen_co_player_resumes_exactly_and_refuses_a_changed_source(earlier_run, tmp_path, monkeypatch):
    import shutil

    folder, run = earlier_run
    source = tmp_path / "source"
    shutil.copytree(run / "checkpoints" / "last" / "verifier", source)
    overrides = ("trainer.num_iterations=3", "run.checkpoint_every=1", "logger=csv")
    reference = run_experiment(frozen(folder, tmp_path / "a", source, *overrides), tmp_path / "reference")
    assert stopped_and_resumed(monkeypatch, frozen(folder, tmp_path / "a", source, *overrides), tmp_path / "resumed", 2) == reference

    # The source changed since the checkpoint: resuming is refused in one line, and the run folder is left as it was.
    config = json.loads((source / "adapter_config.json").read_text())
    (source / "adapter_config.json").write_text(json.dumps(config, indent=4))
    write_manifest(source)  # changed as nip_like changes a folder (an edit without it is refused as damage: test_export_integrity)
    written = sorted(path.name for path in (tmp_path / "resumed").rglob("*"))
    with pytest.raises(CheckpointError, match=r"^agent verifier was loaded frozen from .*source \(sha256 .*\), whose files have changed since") as raised:
        run_experiment(frozen(folder, tmp_path / "a", source, *overrides), tmp_path / "resumed", resume=True)
    assert "\n" not in str(raised.value)
    assert sorted(path.name for path in (tmp_path / "resumed").rglob("*")) == written


@pytest.mark.parametrize(
    "entry,message",
    [
        ("{frozen_from: /no/such/run}", r"scenario.agents.verifier.frozen_from: /no/such/run does not exist: give a run folder or a model folder$"),
        ("{frozen_from: RUN, lora: {r: 4}}", r"a frozen agent trains nothing, so it takes no LoRA adapters: set scenario.agents.verifier.lora.r=0$"),
        ("{frozen_from: RUN, pretrained_path: RUN}", r"frozen_from and scenario.agents.verifier.pretrained_path: give one of them"),
        ("{frozen_from: EMPTY}", r"is neither a model folder \(config.json, or adapter_config.json\) nor a run folder with checkpoints/last/verifier/$"),
        ("{frozen_from: RUN, frozen_checkpoint: best}", r"is neither a model folder .* nor a run folder with checkpoints/best/verifier/$"),
    ],
    ids=["missing", "lora", "both", "not-a-run", "no-best"],
)
def test_a_frozen_co_player_that_cannot_be_loaded_is_refused_in_one_line(earlier_run, tmp_path, entry, message):
    folder, run = earlier_run
    (tmp_path / "empty").mkdir()
    entry = entry.replace("RUN", str(run)).replace("EMPTY", str(tmp_path / "empty"))
    config = chat_config(folder, tmp_path, "scenario.default_agent.lora.r=4", f"+scenario.agents.verifier={entry}")
    with pytest.raises(ConfigError, match=message) as raised:
        experiment.preflight(config)
        experiment.build_trainer(config, tmp_path / "run")
    assert "\n" not in str(raised.value)


@pytest.mark.slow
def test_a_warm_start_of_a_frozen_co_player_is_refused(earlier_run, tmp_path):
    folder, run = earlier_run
    config = frozen(folder, tmp_path, run, 'trainer.pretrain.agents=["verifier"]')
    with pytest.raises(ConfigError, match=r"trainer.pretrain.agents names \['verifier'\], frozen co-players .* leave them out$"):
        experiment.build_trainer(config, tmp_path / "run")
    # "*" leaves the frozen co-player out: only the prover is warm-started.
    config = frozen(folder, tmp_path, run, 'trainer.pretrain.agents=["*"]', "trainer.pretrain.epochs=1",
                    f"trainer.pretrain.cache_dir={tmp_path / 'warm'}")
    trainer = experiment.build_trainer(config, tmp_path / "run2")
    assert "pretrain/prover/train_accuracy" in trainer.pretrain_metrics and not any("verifier" in key for key in trainer.pretrain_metrics)


@pytest.mark.slow
def test_adapters_added_after_a_full_warm_start_are_saved_with_their_base(chat_model, tmp_path):
    # lm_chat's agents: fitted whole in the warm start, then adapters. Their folder holds the fitted base (base/), so that
    # PeftModel over it, the export and a frozen co-player all rebuild the agent that played, not the start folder's.
    folder = chat_model("qwen2")
    config = chat_config(
        folder, tmp_path, "scenario.default_agent.lora.r=4", "scenario.default_agent.lora.warm_start=full",
        'trainer.pretrain.agents=["verifier"]', "trainer.pretrain.epochs=2", f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
    )
    trainer = experiment.build_trainer(config, tmp_path / "run")
    trainer.train()
    trainer.save_checkpoint("last")
    live = logits(trainer.policy.policy("verifier").model)
    saved = trainer.checkpoint_dir / "last" / "verifier"
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "base"  # relative to the adapter folder: it holds when the run is moved
    start = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert not torch.allclose(logits(PeftModel.from_pretrained(start, saved)), live, atol=1e-3)  # the start folder's base is not it
    base = AutoModelForCausalLM.from_pretrained(saved / "base", local_files_only=True)
    torch.testing.assert_close(logits(PeftModel.from_pretrained(base, saved)), live, atol=1e-5, rtol=1e-5)
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "exported")]) == 0
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "exported" / "verifier")), live, atol=1e-5, rtol=1e-5)
    frozen_run = experiment.build_trainer(frozen(folder, tmp_path / "b", tmp_path / "run"), tmp_path / "second")
    torch.testing.assert_close(logits(frozen_run.policy.policy("verifier").model), live, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_with_a_frozen_first_agent_each_gradient_norm_is_logged_under_its_own_agent(earlier_run, tmp_path):
    folder, run = earlier_run
    config = chat_config(folder, tmp_path, "scenario.default_agent.lora.r=4", f"+scenario.agents.prover={{frozen_from: {run}, max_new_tokens: 12}}")
    trainer = experiment.build_trainer(config, tmp_path / "run")
    assert [group["agent"] for group in trainer.optimizer.param_groups] == ["verifier"]
    metrics = trainer.train_iteration()
    assert "train/grad_norm/verifier" in metrics and "train/grad_norm/prover" not in metrics
