"""Agents on one shared base (``share_base_with``): held once, trained like separate copies, saved like them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from nip_like import experiment
from nip_like.errors import ConfigError
from nip_like.evaluate import main as evaluate_main
from nip_like.experiment import run_experiment
from nip_like.export import main as export_main
from nip_like.lm.memory import check_lm_memory
from nip_like.lm.models import sharing_copy
from nip_like.lm.shared_models import check_shared_models
from nip_like.logging import read_csv_metric
from tests.conftest import smoke_config, stopped_and_resumed
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_lm_chat import chat_config

#: The verifier's entry: the same folder and adapters as default_agent's prover, on its own copy or on the prover's base.
VERIFIER = "+scenario.agents.verifier={{pretrained_path: {folder}, max_new_tokens: 12, lora: {{r: 4}}{extra}}}"


def game(folder: Path, tmp_path: Path, shared: bool, *overrides: str):
    """The tiny chat game, both agents on ``folder`` with rank-4 adapters, sharing one base or each with a copy."""
    extra = ", share_base_with: prover" if shared else ""
    return chat_config(
        folder, tmp_path, "scenario.default_agent.lora.r=4", VERIFIER.format(folder=folder, extra=extra), *overrides
    )


def frozen_pointers(module: torch.nn.Module) -> set[int]:
    return {param.data_ptr() for param in module.parameters() if not param.requires_grad}


def trained_state(trainer) -> dict[str, torch.Tensor]:
    """The trained weights: every adapter and value head (the base is frozen)."""
    return {key: value.detach().clone() for key, value in trainer.loss_module.state_dict().items() if "lora_" in key or "value_head" in key}


@pytest.mark.parametrize(
    "objective",
    [
        pytest.param(("trainer=ppo",), id="ppo", marks=pytest.mark.slow),  # 5 s: every case is in the slow tier
        pytest.param(("trainer=grpo", "trainer.group_size=2"), id="grpo", marks=pytest.mark.slow),
        pytest.param(("trainer=dpo", "trainer.group_size=2", "trainer.minibatch_size=4"), id="dpo", marks=pytest.mark.slow),
        # Recomputation in the backward pass (gradient checkpointing, micro-batches of at most two 172-token sequences).
        pytest.param(
            ("trainer=ppo", "scenario.default_agent.gradient_checkpointing=true", "scenario.default_agent.max_tokens_per_micro_batch=400"),
            id="ppo-recompute",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_agents_on_one_base_hold_it_once_and_train_like_two_copies(chat_model, tmp_path, objective):
    folder = chat_model("qwen2")
    runs = {}
    for shared in (True, False):
        overrides = (*objective, "trainer.num_iterations=2", "logger=csv")
        if "gradient_checkpointing=true" in " ".join(objective):  # the verifier's entry is its whole config
            overrides += ("+scenario.agents.verifier.gradient_checkpointing=true", "+scenario.agents.verifier.max_tokens_per_micro_batch=400")
        config = game(folder, tmp_path / str(shared), shared, *overrides)
        trainer = experiment.build_trainer(config, tmp_path / str(shared) / "run")
        prover, verifier = trainer.policy.policy("prover"), trainer.policy.policy("verifier")
        common = frozen_pointers(prover.model) & frozen_pointers(verifier.model)
        if shared:
            # Every frozen weight of the verifier is the prover's tensor; the adapters and value heads are their own.
            assert verifier.base_owner == "prover" and common == frozen_pointers(verifier.model)
            trained = [{p.data_ptr() for p in policy.parameters() if p.requires_grad} for policy in (prover, verifier)]
            assert trained[0] and trained[1] and not trained[0] & trained[1]
            # Each agent's tokenizer is its own, over the base's one backend (no deep copy of the vocabulary).
            assert verifier.tokenizer is not prover.tokenizer and verifier.tokenizer._tokenizer is prover.tokenizer._tokenizer
        else:
            assert not common and verifier.base_owner is None
        # The reference is each agent's model with its adapters off: the base, no copy.
        batch = next(trainer._collector_iterator)
        assert not any(True for _ in trainer.reference_policy.parameters())
        torch.testing.assert_close(trainer.reference_policy.scores(batch).token_log_probs, batch["agents", "token_log_probs"], atol=1e-5, rtol=1e-5)
        metrics = trainer.train()
        runs[shared] = (trained_state(trainer), metrics, trainer)
    (shared_state, shared_metrics, shared_run), (copies_state, copies_metrics, copies_run) = runs[True], runs[False]
    assert shared_state.keys() == copies_state.keys() and any("verifier" in key for key in shared_state)
    for key in shared_state:
        torch.testing.assert_close(shared_state[key], copies_state[key], rtol=1e-5, atol=1e-6, msg=key)
    assert shared_metrics.keys() == copies_metrics.keys()
    for key, value in copies_metrics.items():
        assert shared_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    # Every logged metric (losses, rewards, accuracies) at every step, timers and memory aside.
    scalars = [run.run_dir / "metrics" / "scalars" for run in (shared_run, copies_run)]
    files = [sorted(str(path.relative_to(root)) for path in root.rglob("*.csv")) for root in scalars]
    assert files[0] == files[1] and "train/reward.csv" in files[0]
    for name in files[0]:
        if name.startswith(("timers/", "lm/memory/", "SPS")) or "second" in name:  # wall-clock figures
            continue
        metric = name.removesuffix(".csv")
        logged = [read_csv_metric(run.run_dir, metric) for run in (shared_run, copies_run)]
        assert [step for step, _ in logged[0]] == [step for step, _ in logged[1]], metric
        assert [value for _, value in logged[0]] == pytest.approx([value for _, value in logged[1]], rel=1e-4, abs=1e-6), metric


@pytest.mark.slow
def test_each_agent_of_a_shared_base_saves_the_adapter_folder_of_a_separate_copy(chat_model, tmp_path):
    folder = chat_model("qwen2")
    config = game(folder, tmp_path, True, "trainer.num_iterations=2")
    trainer = experiment.build_trainer(config, tmp_path / "run")
    trainer.train()
    trainer.save_checkpoint("last")
    ids = torch.randint(300, 900, (2, 9))
    for name in ("prover", "verifier"):
        saved = trainer.checkpoint_dir / "last" / name
        assert (saved / "adapter_config.json").is_file() and not (saved / "model.safetensors").exists()
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, local_files_only=True), saved)
        live = trainer.policy.policy(name).model
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, live(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    # The two agents differ (each its own adapters), and export merges each into a standalone folder.
    assert export_main([str(tmp_path / "run"), "--out", str(tmp_path / "exported")]) == 0
    merged = {name: AutoModelForCausalLM.from_pretrained(tmp_path / "exported" / name, local_files_only=True) for name in ("prover", "verifier")}
    with torch.no_grad():
        for name, model in merged.items():
            torch.testing.assert_close(model(input_ids=ids).logits, trainer.policy.policy(name).model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(merged["prover"](input_ids=ids).logits, merged["verifier"](input_ids=ids).logits)


@pytest.mark.slow
def test_a_shared_base_run_resumes_exactly_and_evaluates(chat_model, tmp_path, monkeypatch):
    folder = chat_model("qwen2")
    overrides = ("trainer.num_iterations=4", "run.checkpoint_every=1", "logger=csv")
    reference = run_experiment(game(folder, tmp_path / "a", True, *overrides), tmp_path / "reference")
    assert stopped_and_resumed(monkeypatch, game(folder, tmp_path / "a", True, *overrides), tmp_path / "resumed", 2) == reference
    assert read_csv_metric(tmp_path / "resumed", "loss/policy") == read_csv_metric(tmp_path / "reference", "loss/policy")
    assert evaluate_main([str(tmp_path / "resumed"), "--checkpoint", "last", "--out", str(tmp_path / "evaluated.json")]) == 0
    assert (tmp_path / "evaluated.json").is_file()


def test_a_sharing_copy_holds_no_weight_of_its_own():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    copy = sharing_copy(model)
    assert copy is not model and copy[0] is not model[0]
    assert all(a is b for a, b in zip(model.parameters(), copy.parameters()))
    assert all(a is b for a, b in zip(model.buffers(), copy.buffers()))
    copy[0] = torch.nn.Identity()  # changing the copy's modules leaves the original's alone
    assert isinstance(model[0], torch.nn.Linear)


def _agent(**fields) -> dict:
    return {"pretrained_path": "/models/a", "lora": {"r": 4, "warm_start": "lora"}, "dtype": "float32", **fields}


@pytest.mark.parametrize(
    "verifier,prover,message",
    [
        (_agent(share_base_with="verifier"), _agent(), r"an agent cannot share with itself; name another agent of the game: \['prover'\]$"),
        (_agent(share_base_with="judge"), _agent(), r"share_base_with=judge is not an agent of this game; allowed: \['prover'\]$"),
        (_agent(share_base_with="prover"), _agent(share_base_with="verifier"), r"(verifier shares with prover|prover shares with verifier) itself \(share_base_with\); name (prover|verifier) instead$"),
        (_agent(share_base_with="prover", lora={"r": 0}), _agent(), r"agent verifier needs LoRA adapters: set scenario.agents.verifier.lora.r >= 1$"),
        (_agent(share_base_with="prover"), _agent(lora={"r": 0}), r"agent prover needs LoRA adapters: set scenario.default_agent.lora.r >= 1$"),
        (_agent(share_base_with="prover", lora={"r": 4, "warm_start": "full"}), _agent(), r"the agents of a shared base add their adapters at the same time: set lora.warm_start to the same value"),
        (_agent(share_base_with="prover", pretrained_path="/models/b"), _agent(), r"bases differ \(pretrained_path /models/b against /models/a\)"),
        (_agent(share_base_with="prover", dtype="bfloat16"), _agent(), r"bases differ \(dtype bfloat16 against float32\)"),
        (
            _agent(share_base_with="prover", pretrained_path=None, architecture="qwen2", hidden_size=64),
            _agent(pretrained_path=None, architecture="qwen2", hidden_size=128),
            r"bases differ \(hidden_size 64 against 128\)",
        ),
        (
            _agent(share_base_with="prover", lora={"r": 4, "warm_start": "full"}, gradient_checkpointing=True),
            _agent(lora={"r": 4, "warm_start": "full"}),
            r"a base fitted whole first is one model until the adapters come, so gradient_checkpointing must be the same",
        ),
        (_agent(share_policy_with="prover", lora={"r": 8}), _agent(), r"share_policy_with=prover: the agents' model settings differ \(lora .*'r': 8.* against .*'r': 4.*\); one model plays both roles"),
        (_agent(share_policy_with="prover", gradient_checkpointing=True), _agent(), r"model settings differ \(gradient_checkpointing True against False\)"),
        (_agent(share_policy_with="prover", share_base_with="prover"), _agent(), r"share_base_with and share_policy_with do not go together"),
        (_agent(share_policy_with="prover"), _agent(frozen_from="/runs/a", lora={"r": 0}), r"agent prover is a frozen co-player \(frozen_from\), which shares nothing"),
    ],
    ids=["itself", "unknown", "chain", "no-lora", "owner-no-lora", "full-warm-start", "other-folder", "dtype", "sizes",
         "full-checkpointing", "policy-lora", "policy-checkpointing", "both", "frozen"],
)
def test_sharing_that_cannot_hold_one_frozen_base_is_refused_in_one_line(verifier, prover, message):
    agents = {"prover": ("scenario.default_agent", prover), "verifier": ("scenario.agents.verifier", verifier)}
    with pytest.raises(ConfigError, match=message) as raised:
        check_shared_models(agents)
    assert "\n" not in str(raised.value)


@pytest.mark.slow
def test_a_refused_sharing_stops_the_run_before_its_folder(chat_model, tmp_path):
    from tests.conftest import run_cli

    folder = chat_model("qwen2")
    config_overrides = ["preset=none", "scenario=duplicates", "protocol=nip", "scenario.view=chat", f"scenario.default_agent.pretrained_path={folder}",
                        f"scenario.cache_dir={tmp_path / 'cache'}",
                        f"+scenario.agents.verifier={{pretrained_path: {folder}, share_base_with: prover, lora: {{r: 4}}}}"]
    result = run_cli([*config_overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode != 0
    assert "share_base_with=prover: a shared base stays frozen, so agent prover needs LoRA adapters" in result.stderr
    assert not (tmp_path / "run").exists()


def test_the_memory_preflight_counts_a_shared_base_once(chat_model):
    from nip_like.lm.lora import LoraOptions
    from nip_like.lm.memory import shape_of_agent, size
    from nip_like.lm.models import LMAgentConfig

    folder = str(chat_model("qwen2"))

    def refusal(shared: bool) -> str:
        owner = LMAgentConfig(pretrained_path=folder, lora=LoraOptions(r=4), max_tokens_per_micro_batch=64)
        other = LMAgentConfig(
            pretrained_path=folder, lora=LoraOptions(r=4), max_tokens_per_micro_batch=64, share_base_with="prover" if shared else None
        )
        agents = {"prover": ("scenario.default_agent", owner, 0), "verifier": ("scenario.agents.verifier", other, 0)}
        with pytest.raises(ConfigError, match="cannot fit in memory") as raised:
            check_lm_memory(agents, 4, 4, "cpu", limit_gib=1e-6)
        return str(raised.value)

    weights = shape_of_agent(LMAgentConfig(pretrained_path=folder), 0).parameters * 4
    assert f"weights of the agents {size(2 * weights)}," in refusal(False)
    assert f"weights of the agents {size(weights)}," in refusal(True)


@pytest.mark.slow
def test_a_warm_start_restart_of_one_agent_leaves_the_base_it_shares_alone(tmp_path, monkeypatch):
    import nip_like.warm_start as pretrain
    from tests.test_checkpoint import lm_overrides

    seen = []  # the prover's frozen base as each of the verifier's fits starts
    fit = pretrain._fit

    def recording(config, scenario, agents, agent, *args):
        prover = pretrain.policy_network(agents, "prover").model
        seen.append({name: param.detach().clone() for name, param in prover.named_parameters() if not param.requires_grad})
        return fit(config, scenario, agents, agent, *args)

    monkeypatch.setattr(pretrain, "_fit", recording)
    small = ("hidden_size=32", "num_layers=1", "num_heads=2", "intermediate_size=32")
    config = smoke_config(
        *lm_overrides(tmp_path), "scenario.default_agent.lora.r=4", *(f"scenario.default_agent.{size}" for size in small),
        "+scenario.agents.verifier={lora: {r: 4}, share_base_with: prover, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 32}",
        'trainer.pretrain.agents=["verifier"]', "trainer.pretrain.epochs=1", "+trainer.pretrain.agent_restarts.verifier=2",
        f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
    )
    trainer = experiment.build_trainer(config, tmp_path / "run")
    assert len(seen) == 2 and seen[0]
    final = dict(trainer.policy.policy("prover").model.named_parameters())
    for name, value in seen[0].items():
        torch.testing.assert_close(seen[1][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(final[name].detach(), value, rtol=0, atol=0, msg=name)


def warm_started_on_both_roles(folder: Path, tmp_path: Path, monkeypatch, setting: str):
    """The tiny chat game, both agents with adapters after a full warm start and the verifier's ``setting: prover``.

    Checks that the warm start made one fit, of the prover's model, on both
    roles' demonstrations; returns the trainer.
    """
    import nip_like.warm_start as pretrain

    fitted = []
    fit = pretrain._fit
    monkeypatch.setattr(pretrain, "_fit", lambda config, scenario, agents, agent, train, *rest: fitted.append((agent, train)) or fit(config, scenario, agents, agent, train, *rest))
    config = chat_config(
        folder, tmp_path, "scenario.default_agent.lora.r=4", "scenario.default_agent.lora.warm_start=full",
        f"+scenario.agents.verifier={{pretrained_path: {folder}, max_new_tokens: 12, lora: {{r: 4, warm_start: full}}, {setting}: prover}}",
        'trainer.pretrain.agents=["*"]', "trainer.pretrain.epochs=1", f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
    )
    trainer = experiment.build_trainer(config, tmp_path / "run")
    # Each role's prompt opens with its system prompt: one model learns both.
    demonstrations = pretrain.split_data(trainer.scenario, "train", 0, torch.device("cpu"))
    assert [agent for agent, _ in fitted] == ["prover"]
    assert fitted[0][1].batch_size[0] == demonstrations["prover"].batch_size[0] + demonstrations["verifier"].batch_size[0]
    assert "pretrain/prover/train_accuracy" in trainer.pretrain_metrics and not any("verifier" in key for key in trainer.pretrain_metrics)
    return trainer


@pytest.mark.slow
def test_a_base_fitted_whole_first_is_fitted_on_every_role_then_shared_under_an_adapter_per_agent(chat_model, tmp_path, monkeypatch):
    from nip_like.lm.lora import has_lora

    folder = chat_model("qwen2")
    trainer = warm_started_on_both_roles(folder, tmp_path, monkeypatch, "share_base_with")
    prover, verifier = trainer.policy.policy("prover"), trainer.policy.policy("verifier")
    # After the warm start: a tree per agent over the fitted base's tensors, frozen, each with its own adapters.
    assert prover.model is not verifier.model and has_lora(prover.model) and has_lora(verifier.model)
    assert frozen_pointers(prover.model) == frozen_pointers(verifier.model)
    initial = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    ids = torch.randint(300, 900, (2, 9))
    with torch.no_grad(), prover.model.disable_adapter():
        assert not torch.allclose(prover.model(input_ids=ids).logits, initial(input_ids=ids).logits)  # the base was fitted
    trained = [{p.data_ptr() for p in policy.parameters() if p.requires_grad} for policy in (prover, verifier)]
    assert trained[0] and trained[1] and not trained[0] & trained[1]
    assert not any(True for _ in trainer.reference_policy.parameters())  # the fitted base, adapters off: no copy
    trainer.train()
