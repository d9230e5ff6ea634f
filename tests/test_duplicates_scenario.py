"""The duplicates scenario with language-model agents: environment rules, prompts, agents, demonstrations, training."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from torchrl.envs.utils import ExplorationType, check_env_specs, set_exploration_type

from nip_like import keys
from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer, run_experiment
from nip_like.objectives.action_scores import score_actions
from nip_like.protocols.proof import ProofProtocol
from nip_like.registry import PROTOCOLS, TRAINERS
from nip_like.trainers.rl import TensorDictRlTrainer
from nip_like.scenarios.duplicates.data import certificate_holds
from nip_like.scenarios.duplicates.scenario import DuplicatesConfig, DuplicatesScenario
from tests.conftest import fast_trainers, smoke_config, tiered

TINY_AGENT = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32, "max_new_tokens": 3}


def scenario_for(protocol_name: str, tmp_path, verifier_view: str = "cells", **protocol_options) -> DuplicatesScenario:
    config = OmegaConf.structured(
        DuplicatesConfig(num_lists=200, cache_dir=str(tmp_path), verifier_view=verifier_view)
    )
    config.default_agent = OmegaConf.merge(config.default_agent, TINY_AGENT)
    protocol = PROTOCOLS.get(protocol_name)(protocol_name, **protocol_options)
    return DuplicatesScenario(config, protocol)


def tokens_of(scenario: DuplicatesScenario, text: str, width: int = 3) -> torch.Tensor:
    """A message as the action row of one agent: ``text``'s symbols, then <eos>, then <pad>."""
    tokenizer = scenario.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids += [tokenizer.pad_token_id] * (width - len(ids))
    return torch.tensor(ids[:width])


@pytest.mark.parametrize("protocol", PROTOCOLS.names(subclass_of=ProofProtocol))
@pytest.mark.parametrize("view", ["cells", "full"])
def test_every_proof_protocol_gives_clean_specs(tmp_path, protocol, view):
    scenario = scenario_for(protocol, tmp_path, view)
    env = scenario.make_env(4, "train", 0, "cpu")
    check_env_specs(env)
    rollout = env.rollout(env.protocol.num_rounds, scenario.make_agents().policy, break_when_any_done=False)
    assert rollout.get(keys.ACTION_KEY).shape == (4, env.protocol.num_rounds, env.num_agents, env.message_tokens)
    assert rollout.get(keys.PROMPT_IDS_KEY).shape[-1] == env.prompt_length


def play(scenario, env, messages: dict[str, str]) -> TensorDict:
    """One step of ``env`` (reset first) with the given agents' messages; returns the step's output."""
    td = env.reset()
    action = torch.full((env.num_envs, env.num_agents, env.message_tokens), scenario.tokenizer.pad_token_id)
    for name, text in messages.items():
        action[:, scenario.agent_names.index(name)] = tokens_of(scenario, text, env.message_tokens)
    td.set(keys.ACTION_KEY, action)
    return env.step(td)


def prompt_text(scenario, td, agent: str) -> list[str]:
    index = scenario.agent_names.index(agent)
    ids, mask = td.get(keys.PROMPT_IDS_KEY)[0, index], td.get(keys.PROMPT_MASK_KEY)[0, index]
    return scenario.tokenizer.convert_ids_to_tokens(ids[mask].tolist())


def test_a_prover_naming_two_cells_reveals_them_to_the_verifier_only_in_cells_view(tmp_path):
    scenario = scenario_for("nip", tmp_path, first_speaker="prover", max_rounds=2)
    env = scenario.make_env(1, "train", 3, "cpu")
    values = env.reset()["state", "values"][0]
    env.rng.manual_seed(3)  # play() resets again: the same list
    step = play(scenario, env, {"prover": "c2 c5"})["next"]
    seen = prompt_text(scenario, step, "verifier")
    hidden = [seen[2 + 2 * cell] for cell in range(8) if cell not in (2, 5)]
    assert hidden == ["?"] * 6
    assert seen[2 + 2 * 2] == f"v{int(values[2])}" and seen[2 + 2 * 5] == f"v{int(values[5])}"
    assert seen[-4:] == ["prover:", "c2", "c5", "<eos>"]
    # The prover sees the whole list.
    assert "?" not in prompt_text(scenario, step, "prover")
    full = scenario_for("nip", tmp_path, "full", first_speaker="prover", max_rounds=2).make_env(1, "train", 3, "cpu")
    assert "?" not in prompt_text(scenario, full.reset(), "verifier")


@pytest.mark.parametrize("decision", ["accept", "reject", "c0 c1"])
def test_the_verifier_decides_or_is_wrong_when_it_does_not(tmp_path, decision):
    scenario = scenario_for("solo_verifier", tmp_path, verifier_incorrect_penalty=0.5)
    env = scenario.make_env(16, "train", 0, "cpu")
    step = play(scenario, env, {"verifier": decision})["next"]
    label = step["state", "label"]
    reward = step.get(keys.REWARD_KEY)[:, 0, 0]
    assert step["done"].all()
    if decision == "c0 c1":
        assert (step["state", "decision"] == -1).all() and (reward == -0.5).all()
    else:
        right = label if decision == "accept" else ~label
        assert torch.equal(reward, torch.where(right, 1.0, -0.5))
        assert (step["state", "decision"] == int(decision == "accept")).all()


def test_the_episode_metrics_count_certificates_and_undecided_episodes(tmp_path):
    scenario = scenario_for("nip", tmp_path, first_speaker="prover", max_rounds=2)
    env = scenario.make_env(32, "train", 0, "cpu")
    td = env.reset()
    certificate = td["state", "certificate"].clamp(min=0)
    action = torch.full((32, 2, 3), scenario.tokenizer.pad_token_id)
    action[:, 0, :2] = env.ids["cell0"] + certificate
    action[:, 0, 2] = scenario.tokenizer.eos_token_id
    td.set(keys.ACTION_KEY, action)
    td = env.step(td)["next"]
    action = torch.full((32, 2, 3), scenario.tokenizer.pad_token_id)
    action[:, 1] = tokens_of(scenario, "c0 c1")  # the verifier never decides
    td.set(keys.ACTION_KEY, action)
    final = env.step(td)["next"]
    metrics = scenario.episode_metrics(final)
    label = final["state", "label"]
    assert metrics["decided"] == 0.0 and metrics["accuracy"] == 0.0
    # The honest prover named the duplicate pair of every positive list.
    assert metrics["agents/prover/certificates"] == 1.0 and bool(label.any())


def test_lm_actor_stores_what_a_teacher_forced_pass_recomputes(tmp_path):
    scenario = scenario_for("debate", tmp_path, first_speaker="prover", max_rounds=2)
    env, agents = scenario.make_env(6, "train", 0, "cpu"), scenario.make_agents()
    rollout = env.rollout(2, agents.policy, break_when_any_done=False)
    scores = score_actions(agents.policy, rollout)
    stored = rollout.get(keys.TOKEN_LOG_PROBS_KEY)
    assert torch.equal(scores.token_mask, rollout.get(keys.TOKEN_MASK_KEY) & rollout.get(keys.ACTIVE_KEY).unsqueeze(-1))
    torch.testing.assert_close(scores.token_log_probs, stored, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.token_entropy, rollout.get(keys.TOKEN_ENTROPY_KEY), atol=1e-5, rtol=0)
    # Pad is never sampled, so the action alone gives the token mask; waiting agents send nothing.
    assert torch.equal(rollout.get(keys.ACTION_KEY) != scenario.tokenizer.pad_token_id, rollout.get(keys.TOKEN_MASK_KEY))
    idle = ~rollout.get(keys.ACTIVE_KEY)
    assert not rollout.get(keys.TOKEN_MASK_KEY)[idle].any()
    scores.token_log_probs.sum().backward()
    assert all(p.grad is not None for p in agents.policy.policy("verifier").model.parameters() if p.requires_grad)


def test_deterministic_exploration_decodes_greedily(tmp_path):
    scenario = scenario_for("nip", tmp_path, first_speaker="prover", max_rounds=2)
    agents = scenario.make_agents()
    td = scenario.make_env(8, "train", 0, "cpu").reset()
    with set_exploration_type(ExplorationType.DETERMINISTIC):
        first = agents.policy(td.clone()).get(keys.ACTION_KEY)
        torch.manual_seed(123)
        second = agents.policy(td.clone()).get(keys.ACTION_KEY)
    assert torch.equal(first, second)


@pytest.mark.parametrize("view", ["cells", "full"])
def test_demonstrations_are_honest_play(tmp_path, view):
    scenario = scenario_for("debate", tmp_path, verifier_view=view, first_speaker="prover", max_rounds=2)
    demos = scenario.demonstrations("train")
    lists = scenario.splits()["train"]
    assert set(demos) == {"prover0", "verifier"}  # the reject side has no certificate to give
    prover = demos["prover0"]
    assert prover.batch_size[0] == int(lists.label.sum())
    # Each prover message names a certificate that holds on its own list: read the list off the prompt.
    ids = scenario.symbols.ids(scenario.tokenizer)
    values = prover["prompt_ids"][:, 2 : 2 + 16 : 2] - ids["value0"]
    named = prover["tokens"][:, :2] - ids["cell0"]
    assert certificate_holds(values, named).all()
    verifier = demos["verifier"]
    assert verifier.batch_size[0] == len(lists)
    accept = verifier["tokens"][:, 0] == scenario.tokenizer.convert_tokens_to_ids("accept")
    if view == "full":
        assert torch.equal(accept, lists.label)
        return
    # A sound verifier: it accepts exactly when two cells it was shown hold equal values.
    shown = verifier["prompt_ids"][:, 2 : 2 + 16 : 2]
    seen = shown != ids["hidden"]
    equal = (shown.unsqueeze(-1) == shown.unsqueeze(-2)) & seen.unsqueeze(-1) & seen.unsqueeze(-2)
    proven = (equal & ~torch.eye(8, dtype=torch.bool)).flatten(1).any(-1)
    assert torch.equal(accept, proven)
    assert torch.equal(accept, lists.label)  # with an honest prover, proven exactly when positive
    lone = verifier["prompt_ids"][:, 2 : 2 + 16 : 2] == ids["hidden"]
    assert bool((lone.sum(-1) >= 7).any())  # decoys of one cell (or one cell twice) were played too


def lm_smoke_config(tmp_path, *overrides: str):
    return smoke_config(
        "scenario=duplicates",
        "protocol=nip",
        "protocol.first_speaker=prover",
        "protocol.max_rounds=2",
        f"scenario.cache_dir={tmp_path / 'data'}",
        "scenario.num_lists=200",
        *[f"scenario.default_agent.{key}={value}" for key, value in TINY_AGENT.items()],
        *overrides,
    )


#: The evaluation of the checkpoint and transcript tests.
DEV_EVAL = ("trainer.eval.num_episodes=32", "trainer.eval.metric=eval/reward")


#: The built-in RL trainers (other test modules register trainers of their own).
RL_TRAINERS = [
    name
    for name in TRAINERS.names()
    if issubclass(TRAINERS.get(name), TensorDictRlTrainer) and TRAINERS.get(name).__module__.startswith("nip_like.")
]


#: The fast tier trains two standard objectives (test_gi_scenario trains each of them fast on graph agents); the full
#: run trains them all, the learning-aware trainers too.
@pytest.mark.parametrize("trainer", tiered(RL_TRAINERS, fast=fast_trainers(RL_TRAINERS, learning_aware=0)[:2]))
def test_every_objective_trains_lm_agents(tmp_path, trainer):
    group = ["trainer.group_size=4"]  # for the objectives that compare episodes; the others do not mind
    config = lm_smoke_config(
        tmp_path,
        f"trainer={trainer}",
        "trainer.num_iterations=2",
        "trainer.eval.every=1",
        "trainer.eval.num_episodes=16",
        "trainer.eval.metric=eval/accuracy",
        *group,
    )
    trainer_object = build_trainer(config, tmp_path / "run")
    before = {name: p.detach().clone() for name, p in trainer_object.policy.named_parameters()}
    metrics = trainer_object.train()
    assert 0.0 <= metrics["test/accuracy"] <= 1.0 and metrics["test/episodes"] == 64
    changed = [name for name, p in trainer_object.policy.named_parameters() if not torch.equal(p, before[name])]
    assert any(".prover." in name for name in changed) and any(".verifier." in name for name in changed)
    assert math.isfinite(trainer_object.state.best_metric)


@pytest.mark.slow
def test_best_agents_reload_with_from_pretrained_and_reproduce_the_dev_metric(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = build_trainer(lm_smoke_config(tmp_path, "trainer.eval.every=1", *DEV_EVAL), tmp_path / "run")
    trainer.train()
    best = tmp_path / "run" / "checkpoints" / "best"
    for name in trainer.agent_names:
        model = AutoModelForCausalLM.from_pretrained(best / name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(best / name)
        assert model.config.vocab_size >= len(tokenizer) and (best / name / "value_head.pt").is_file()
    paths = [f"+scenario.agents.{name}.pretrained_path={best / name}" for name in trainer.agent_names]
    reloaded = build_trainer(lm_smoke_config(tmp_path, "trainer.eval.every=1", *DEV_EVAL, *paths), tmp_path / "again")
    from contextlib import ExitStack

    with ExitStack() as stack:
        reloaded._build_test_context(stack)
        metrics = reloaded.evaluate()
    assert metrics["eval/reward"] == pytest.approx(trainer.state.best_metric, abs=1e-6)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_evaluations_and_the_test_write_readable_transcripts(tmp_path):
    import json

    run_experiment(lm_smoke_config(tmp_path, "trainer.eval.every=2", "trainer.eval.transcripts=5", *DEV_EVAL), tmp_path / "run")
    folder = tmp_path / "run" / "transcripts"
    names = sorted(path.name for path in folder.glob("*.jsonl"))
    assert names == ["eval_000000.jsonl", "eval_000002.jsonl", "eval_000003.jsonl", "test.jsonl"]
    records = [json.loads(line) for line in (folder / "test.jsonl").read_text().splitlines()]
    assert len(records) == 5
    for record in records:
        assert record["decision"] in ("accept", "reject", "none")
        assert record["correct"] == (record["decision"] == ("accept" if record["label"] else "reject"))
        assert set(record["rewards"]) == {"prover", "verifier"}
        for turn in record["turns"]:
            assert turn["agent"] in ("prover", "verifier") and turn["message"]
            for cell, value in turn["revealed"]:
                assert record["values"][cell] == value


@pytest.mark.parametrize("protocol", PROTOCOLS.names(subclass_of=ProofProtocol))
def test_every_agent_with_demonstrations_is_what_a_star_pretrains(tmp_path, protocol):
    from nip_like.warm_start import ALL_AGENTS, pretrained_agent_names

    scenario = scenario_for(protocol, tmp_path)
    assert pretrained_agent_names(scenario, [ALL_AGENTS]) == sorted(
        scenario.demonstrations("train"), key=scenario.agent_names.index
    )


def test_per_agent_pretraining_epochs_are_checked_and_used(tmp_path):
    from nip_like.warm_start import _epochs

    config = lm_smoke_config(tmp_path, "trainer.pretrain.epochs=3", "+trainer.pretrain.agent_epochs={verifier: 1}")
    assert len(_epochs(config, "verifier")) == 1 and len(_epochs(config, "prover")) == 3
    bad = lm_smoke_config(tmp_path, "trainer.pretrain.agents=[verifier]", "+trainer.pretrain.agent_epochs={judge: 2}")
    with pytest.raises(ConfigError, match="trainer.pretrain.agent_epochs names judge; the protocol's agents are"):
        build_trainer(bad, tmp_path / "run")


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_per_agent_restarts_fit_that_agent_again_and_leave_the_others_cache_keys(tmp_path):
    from nip_like.checkpoint import load_checked
    from nip_like.warm_start import pretrain_key

    warm = tmp_path / "warm"
    common = ("trainer.pretrain.agents=[verifier,prover]", "trainer.pretrain.epochs=1", f"trainer.pretrain.cache_dir={warm}")
    plain = lm_smoke_config(tmp_path, *common)
    config = lm_smoke_config(tmp_path, *common, "+trainer.pretrain.agent_restarts={verifier: 3}")
    assert pretrain_key(config, "prover") == pretrain_key(plain, "prover")  # the prover's cached fit still serves
    assert pretrain_key(config, "verifier") != pretrain_key(plain, "verifier")
    build_trainer(config, tmp_path / "run")
    fits = {path.name.split("_")[0]: load_checked(path, path.stem.split("_")[-1], what="cache") for path in warm.glob("*.pt")}
    assert len(fits["verifier"]["restart_scores"]) == 3 and len(fits["prover"]["restart_scores"]) == 1
    bad = lm_smoke_config(tmp_path, *common, "+trainer.pretrain.agent_restarts={judge: 2}")
    with pytest.raises(ConfigError, match="trainer.pretrain.agent_restarts names judge; the protocol's agents are"):
        build_trainer(bad, tmp_path / "run2")


def test_decoys_name_cells_in_a_certificates_order(tmp_path):
    from nip_like.scenarios.duplicates.scenario import decoy_messages

    cells = decoy_messages(3000, 8, torch.Generator().manual_seed(0))
    pairs = cells[(cells[:, 1] >= 0) & (cells[:, 0] != cells[:, 1])]
    assert len(pairs) > 800 and bool((pairs[:, 0] > pairs[:, 1]).all())
    assert 800 < int((cells[:, 1] < 0).sum()) < 1200 and 800 < int((cells[:, 0] == cells[:, 1]).sum()) < 1200



def test_decoy_weights_set_the_mix_of_decoy_kinds():
    from nip_like.scenarios.duplicates.scenario import decoy_messages

    cells = decoy_messages(4000, 4, torch.Generator().manual_seed(0), (8.0, 1.0, 1.0))
    kinds = [int(((cells[:, 1] >= 0) & (cells[:, 0] != cells[:, 1])).sum()), int((cells[:, 1] < 0).sum()), int((cells[:, 0] == cells[:, 1]).sum())]
    assert 3050 < kinds[0] < 3350 and 300 < kinds[1] < 500 and 300 < kinds[2] < 500, kinds
    only_pairs = decoy_messages(500, 4, torch.Generator().manual_seed(0), (1.0, 0.0, 0.0))
    assert bool((only_pairs[:, 0] > only_pairs[:, 1]).all())
    with pytest.raises(ConfigError, match=r"^scenario.decoys: the weights \(pair, alone, twice\) must be >= 0 with one > 0, got \(0.0, 0.0, 0.0\)$"):
        decoy_messages(5, 4, torch.Generator(), (0.0, 0.0, 0.0))


def test_keep_best_pretraining_reports_the_held_out_accuracy_of_the_kept_weights(tmp_path):
    from nip_like.lm.demonstration_fit import held_out_scores

    config = lm_smoke_config(
        tmp_path, "trainer.pretrain.agents=[verifier]", "trainer.pretrain.epochs=3", "trainer.pretrain.keep_best=true",
        f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
    )
    trainer = build_trainer(config, tmp_path / "run")
    kept = trainer.pretrain_metrics["pretrain/verifier/val_accuracy"]
    network = trainer.policy.policy("verifier")
    network.eval()
    held_out = trainer.scenario.demonstrations("val", seed=0)["verifier"]
    assert held_out_scores(network, held_out)[1] == pytest.approx(kept)
    again = build_trainer(config, tmp_path / "again")  # from the cache, with the same figure
    assert again.pretrain_metrics["pretrain/verifier/from_cache"] == 1.0
    assert again.pretrain_metrics["pretrain/verifier/val_accuracy"] == kept


def test_adapters_added_after_the_warm_start_share_it_with_full_fine_tuning(tmp_path):
    from nip_like.warm_start import pretrain_key

    full = lm_smoke_config(tmp_path)
    later = lm_smoke_config(tmp_path, "scenario.default_agent.lora.r=8", "scenario.default_agent.lora.warm_start=full")
    during = lm_smoke_config(tmp_path, "scenario.default_agent.lora.r=8")
    assert pretrain_key(later, "prover") == pretrain_key(full, "prover")
    assert pretrain_key(during, "prover") != pretrain_key(full, "prover")  # the warm start then trains the adapters


def test_per_agent_pretraining_learning_rates_are_checked_and_keep_other_agents_cached(tmp_path):
    from nip_like.warm_start import pretrain_key

    base = lm_smoke_config(tmp_path)
    faster = lm_smoke_config(tmp_path, "+trainer.pretrain.agent_lr={verifier: 0.01}")
    assert pretrain_key(base, "prover") == pretrain_key(faster, "prover")
    assert pretrain_key(faster, "verifier")["pretrain"]["lr"] == 0.01
    bad = lm_smoke_config(tmp_path, "trainer.pretrain.agents=[verifier]", "+trainer.pretrain.agent_lr={verifier: 0}")
    with pytest.raises(ConfigError, match="trainer.pretrain.agent_lr must be all > 0"):
        build_trainer(bad, tmp_path / "run")


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_early_stopping_on_the_dev_metric_stops_an_lm_run_and_tests_the_best_agents(tmp_path):
    config = lm_smoke_config(
        tmp_path, "trainer.num_iterations=20", "trainer.eval.every=1", "trainer.eval.early_stopping_patience=1",
        "trainer.eval.metric=eval/episodes", "trainer.eval.num_episodes=16", "trainer.eval.test_checkpoint=best",
    )
    trainer = build_trainer(config, tmp_path / "run")
    metrics = trainer.train()
    # eval/episodes never improves after the first evaluation: stop after the second, test the first's agents.
    assert trainer.state.stopped_early and trainer.state.iteration == 2 and trainer.state.best_iteration == 1
    assert all((tmp_path / "run" / "checkpoints" / "best" / name / "config.json").is_file() for name in trainer.agent_names)
    assert metrics["test/episodes"] == 64


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_the_solo_agent_trainer_fine_tunes_an_lm_agent_on_its_demonstrations(tmp_path):
    from nip_like.lm.demonstration_fit import held_out_scores

    config = smoke_config(
        "scenario=duplicates", "protocol=solo_verifier", "trainer=solo_agent", "trainer.num_iterations=2",
        f"scenario.cache_dir={tmp_path / 'data'}", "scenario.num_lists=200",
        *[f"scenario.default_agent.{key}={value}" for key, value in TINY_AGENT.items()],
    )
    trainer = build_trainer(config, tmp_path / "run")
    metrics = trainer.train()
    network = trainer.agents.policy.policy("verifier")
    test = trainer.scenario.demonstrations("test", seed=0)["verifier"]
    assert metrics["test/accuracy"] == pytest.approx(held_out_scores(network, test)[1])
    assert 0.0 <= metrics["test/accuracy"] <= 1.0 and trainer.state.gradient_steps > 0
    with pytest.raises(ConfigError, match="trainer.objective.agent: 'prover1' has no demonstrations"):
        build_trainer(lm_smoke_config(tmp_path, "trainer=solo_agent", "trainer.objective.agent=prover1",
                                      "protocol=debate"), tmp_path / "bad").train()


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_transcripts_also_go_to_the_loggers_text_channel(tmp_path):
    run_experiment(
        lm_smoke_config(tmp_path, "logger=csv", "trainer.eval.every=2", "trainer.eval.transcripts=3", *DEV_EVAL),
        tmp_path / "run",
    )
    texts = tmp_path / "run" / "metrics" / "texts" / "transcripts"
    names = sorted(path.name for path in texts.iterdir())
    assert names == ["eval0.txt", "eval2.txt", "eval3.txt", "test3.txt"]
    text = (texts / "test3.txt").read_text()
    assert text.count("decision: ") == 3 and "  prover: " in text and "  verifier: " in text
