"""The graph-isomorphism scenario end to end: every protocol under PPO, the solo-agent trainer, metrics."""

import dataclasses
import json
import math

import pytest
import torch
from tensordict import TensorDict

from nip_like.config import run_id
from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer, run_experiment
from nip_like.logging import read_csv_metric
from nip_like.protocols.proof import FixedTurnsProofProtocol, ProofProtocol
from nip_like.registry import PROTOCOLS as REGISTERED_PROTOCOLS
from nip_like.registry import TRAINERS
from nip_like.scenarios.graph_isomorphism.isomorphism import are_isomorphic
from nip_like.trainers import TensorDictRlTrainer
from tests.conftest import fast_trainers, make_config, smoke_config, tiered

#: Every registered interactive-proof protocol, from the registry (no list of names here).
PROTOCOLS = REGISTERED_PROTOCOLS.names(subclass_of=ProofProtocol)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gi_cache")


def gi_config(cache_dir, *overrides):
    """A tiny graph-isomorphism dataset (80 pairs of 7-8 nodes) and small agents."""
    return smoke_config(
        "scenario=graph_isomorphism",
        "scenario.num_pairs=80",
        "scenario.min_nodes=7",
        "scenario.max_nodes=8",
        f"scenario.cache_dir={cache_dir}",
        "scenario.default_agent.hidden_size=16",
        *overrides,
    )


def decided_correctly(probe, num_episodes: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recount the test loop's episodes by hand: whether each was accepted, whether rightly, its length.

    Whether a pair is isomorphic is decided afresh from the graphs the episode
    showed (not read from the dataset's labels); the decision is the verifier's
    action at the step that ended the episode.
    """
    trainer = probe.trainer
    decisions = probe.test_decisions(num_episodes)
    assert len(decisions) == num_episodes
    action = decisions["agents", "action"][:, trainer.agent_names.index("verifier")]
    accept, reject = 2 * trainer.train_env.max_nodes + 1, 2 * trainer.train_env.max_nodes
    assert ((action == accept) | (action == reject)).all()  # every test episode ended by a decision
    isomorphic = []
    for adjacency, nodes in zip(decisions["state", "adjacency"], decisions["state", "node_mask"]):
        graphs = [adjacency[g][nodes[g]][:, nodes[g]].numpy() for g in (0, 1)]
        isomorphic.append(are_isomorphic(*graphs))
    accepted = action == accept
    return accepted, accepted == torch.tensor(isomorphic), decisions["state", "round"] + 1


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_test_rollouts_play_each_datapoint_side_by_side(tmp_path, cache_dir):
    trainer = build_trainer(gi_config(cache_dir, "protocol=nip", "trainer.test_rollouts=4"), tmp_path)
    episodes = trainer.play_test_episodes()
    assert episodes.batch_size == (64,)
    pairs = episodes["state", "pair_index"].view(16, 4)
    assert (pairs == pairs[:, :1]).all()  # four episodes of each drawn pair, side by side
    metrics = trainer.test()
    assert metrics["test/episodes_per_datapoint"] >= 4 and 0 <= metrics["test/always_wrong"] <= 1


@pytest.mark.parametrize("protocol", tiered(PROTOCOLS, fast=PROTOCOLS[:1]))  # the first registered in the fast tier
def test_every_protocol_trains_end_to_end_under_ppo(tmp_path, cache_dir, protocol, run_probe):
    # Protocols whose schema limits the rounds get four (the others have fixed turns or their own count).
    takes_turns = "max_rounds" in {field.name for field in dataclasses.fields(REGISTERED_PROTOCOLS.entry(protocol).schema)}
    rounds = ["protocol.max_rounds=4"] if takes_turns else []
    metrics = run_experiment(gi_config(cache_dir, f"protocol={protocol}", *rounds, "logger=csv"), tmp_path)
    assert run_probe.changed() == set(run_probe.trainer.agent_names)  # PPO updated every agent
    # The test metrics agree with a count by hand of the 64 test episodes.
    accepted, correct, length = decided_correctly(run_probe)
    isomorphic = accepted == correct
    assert metrics["test/episodes"] == 64
    assert metrics["test/accuracy"] == pytest.approx(correct.float().mean().item())
    assert metrics["test/episode_length"] == pytest.approx(length.float().mean().item())
    true_accepts = int((accepted & isomorphic).sum())
    assert metrics["test/precision"] == pytest.approx(true_accepts / max(int(accepted.sum()), 1))
    assert metrics["test/recall"] == pytest.approx(true_accepts / int(isomorphic.sum()))
    assert 0.0 <= metrics["test/accuracy_worst_datapoint"] <= metrics["test/accuracy"]
    # Periodic evaluation (every 2 iterations and at the last) played the validation split.
    assert [step for step, _ in read_csv_metric(tmp_path, "eval/accuracy")] == [2, 3]
    assert read_csv_metric(tmp_path, "agents/verifier/policy/decision_entropy")


def test_splits_are_disjoint_and_evaluation_uses_validation(tmp_path, cache_dir):
    trainer = build_trainer(gi_config(cache_dir, "protocol=nip", "protocol.max_rounds=4"), tmp_path)
    splits = trainer.scenario.splits()
    assert sum(len(part) for part in splits.values()) == 80
    keys = {name: {part.adjacency[i].numpy().tobytes() for i in range(len(part))} for name, part in splits.items()}
    assert keys["train"].isdisjoint(keys["test"]) and keys["val"].isdisjoint(keys["test"])
    assert trainer.scenario.eval_split == "val"
    with pytest.raises(ConfigError, match="splits are"):
        trainer.scenario.make_env(4, "dev", 0, "cpu")


@pytest.mark.parametrize("setting", ["protocol.max_rounds=4", "protocol.min_rounds=1", "protocol.first_speaker=verifier"])
def test_fixed_turn_protocols_refuse_turn_settings(cache_dir, setting):
    """adp and merlin_arthur have no round limits or first speaker: setting one is an error, not ignored."""
    fixed = REGISTERED_PROTOCOLS.names(subclass_of=FixedTurnsProofProtocol)
    assert "adp" in fixed and "nip" not in fixed
    for protocol in fixed:
        with pytest.raises(Exception, match=f"unknown config key {setting.split('=')[0]}:"):
            gi_config(cache_dir, f"protocol={protocol}", setting)
    # And so two runs that play the same game have the same run id, whatever the preset's turn limits.
    quick = make_config("preset=quick", "protocol=adp")
    assert run_id(quick) == run_id(make_config("preset=quick", "protocol=adp", "protocol.prover_reward=1.0"))
    assert "max_rounds" not in quick.protocol and make_config("preset=quick").protocol.max_rounds == 6


def test_gi_needs_a_proof_protocol(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match="interactive-proof protocol"):
        build_trainer(gi_config(cache_dir, "protocol=prover_verifier"), tmp_path)


def test_episode_metrics_closed_form(tmp_path, cache_dir):
    trainer = build_trainer(gi_config(cache_dir, "protocol=nip", "protocol.max_rounds=4"), tmp_path)
    # Five episodes: pair 0 twice (right, wrong), pairs 1-3 once; decisions 1 = accept, 0 = reject.
    label = torch.tensor([True, True, False, True, False])
    decision = torch.tensor([1, 0, 0, 1, 1])
    episodes = TensorDict(
        {
            "state": {
                "label": label,
                "decision": decision,
                "pair_index": torch.tensor([0, 0, 1, 2, 3]),
                "round": torch.tensor([3, 1, 3, 3, 1]),
                "sent": torch.full((5, 4, 2), -1),  # no node sent: no answers to judge
                "adjacency": torch.zeros(5, 2, 8, 8, dtype=torch.bool),
                "node_mask": torch.ones(5, 2, 8, dtype=torch.bool),
            },
            "agents": {"episode_return": torch.zeros(5, 2, 1)},
        },
        batch_size=[5],
    )
    metrics = trainer.scenario.episode_metrics(episodes)
    assert metrics["accuracy"] == pytest.approx(3 / 5)
    assert metrics["accuracy_per_datapoint"] == pytest.approx((0.5 + 1 + 1 + 0) / 4)
    assert metrics["accuracy_worst_datapoint"] == 0.0
    assert metrics["always_wrong"] == pytest.approx(1 / 4)  # pair 3, wrong in its one episode; pair 0 was right once
    assert metrics["episodes_per_datapoint"] == pytest.approx(5 / 4)
    assert metrics["precision"] == pytest.approx(2 / 3)  # accepted 3, 2 of them isomorphic
    assert metrics["recall"] == pytest.approx(2 / 3)  # 3 isomorphic, 2 accepted
    assert metrics["episode_length"] == pytest.approx(11 / 5)
    assert "agents/prover/faithful_answers" not in metrics


def test_solo_agent_trainer_fits_the_labels_and_resumes(tmp_path, cache_dir, run_probe):
    overrides = ("trainer=solo_agent", "protocol=solo_verifier", "trainer.num_iterations=4", "trainer.eval.every=2")
    metrics = run_experiment(gi_config(cache_dir, *overrides, "logger=csv"), tmp_path / "a")
    assert {"test/accuracy", "test/precision", "test/recall"} <= set(metrics)
    assert run_probe.changed() == {"verifier"}
    assert len(read_csv_metric(tmp_path / "a", "loss/policy")) == 4
    assert len(read_csv_metric(tmp_path / "a", "eval/accuracy")) == 2
    # Resuming the finished run restores the agent from its checkpoint: the same test metrics.
    resumed = run_experiment(gi_config(cache_dir, *overrides, "logger=csv"), tmp_path / "a", resume=True)
    assert resumed == metrics
    with pytest.raises(ConfigError, match="not an agent of the protocol"):
        build_trainer(gi_config(cache_dir, *overrides, "trainer.objective.agent=prover"), tmp_path / "c")


def test_solo_agent_needs_labelled_data(tmp_path):
    with pytest.raises(ConfigError, match="needs a scenario with demonstrations or labelled data"):
        build_trainer(smoke_config("trainer=solo_agent"), tmp_path)


@pytest.mark.slow
def test_pretraining_fits_once_then_loads_from_the_cache(tmp_path, cache_dir):
    overrides = (
        "protocol=nip",
        "protocol.max_rounds=4",
        "trainer.pretrain.agents=[verifier]",
        "trainer.pretrain.epochs=2",
        f"trainer.pretrain.cache_dir={tmp_path / 'pretrained'}",
    )
    first = build_trainer(gi_config(cache_dir, *overrides), tmp_path / "a")
    assert first.pretrain_metrics["pretrain/verifier/from_cache"] == 0.0
    # Pretraining moved the verifier, and only the verifier, away from the seed's initialisation.
    plain = build_trainer(gi_config(cache_dir, *overrides[:2]), tmp_path / "plain")
    network = lambda trainer, agent: trainer.agent_modules.policy.module[0].module.networks[agent]  # noqa: E731
    verifier = lambda trainer: network(trainer, "verifier")  # noqa: E731
    assert not all(torch.equal(a, b) for a, b in zip(verifier(first).parameters(), verifier(plain).parameters()))
    for a, b in zip(network(first, "prover").parameters(), network(plain, "prover").parameters()):
        torch.testing.assert_close(a, b)
    second = build_trainer(gi_config(cache_dir, *overrides), tmp_path / "b")
    assert second.pretrain_metrics["pretrain/verifier/from_cache"] == 1.0
    assert (
        second.pretrain_metrics["pretrain/verifier/train_accuracy"]
        == first.pretrain_metrics["pretrain/verifier/train_accuracy"]
    )
    for a, b in zip(verifier(first).parameters(), verifier(second).parameters()):
        torch.testing.assert_close(a, b)
    # The value body starts from the pretrained policy body; the reference is the pretrained policy.
    value = second.agent_modules.value.module.networks["verifier"]
    for a, b in zip(value.body.parameters(), verifier(second).body.parameters()):
        torch.testing.assert_close(a, b)
    for a, b in zip(second.reference_policy.policy.parameters(), second.policy.parameters()):
        torch.testing.assert_close(a, b)
    # A different setting is a different cache entry; a corrupt entry is rebuilt with a warning.
    other = build_trainer(gi_config(cache_dir, *overrides, "trainer.pretrain.epochs=1"), tmp_path / "c")
    assert other.pretrain_metrics["pretrain/verifier/from_cache"] == 0.0
    for path in (tmp_path / "pretrained").iterdir():
        path.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="rebuilding the pretrained verifier"):
        rebuilt = build_trainer(gi_config(cache_dir, *overrides), tmp_path / "d")
    assert rebuilt.pretrain_metrics["pretrain/verifier/from_cache"] == 0.0


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_keep_best_pretraining_keeps_the_weights_of_its_reported_validation_accuracy(tmp_path, cache_dir):
    from nip_like.warm_start import agent_data, held_out_accuracy, split_data

    config = gi_config(
        cache_dir, "protocol=nip", "protocol.max_rounds=4", "trainer.pretrain.agents=[verifier]",
        "trainer.pretrain.epochs=3", "trainer.pretrain.keep_best=true", f"trainer.pretrain.cache_dir={tmp_path / 'p'}",
    )
    trainer = build_trainer(config, tmp_path / "run")
    val = agent_data(trainer.scenario, split_data(trainer.scenario, "val", 0, "cpu"), "verifier", "test")
    kept = trainer.pretrain_metrics["pretrain/verifier/val_accuracy"]
    assert held_out_accuracy(trainer.scenario, trainer.agent_modules, "verifier", val) == pytest.approx(kept)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_pretraining_restarts_keep_the_best_fit_and_leave_the_global_generators_alone(tmp_path, cache_dir):
    from nip_like.checkpoint import load_checked

    base = (
        "protocol=nip", "protocol.max_rounds=4", "trainer.pretrain.agents=[verifier]", "trainer.pretrain.epochs=1",
        f"trainer.pretrain.cache_dir={tmp_path / 'p'}",
    )
    single = build_trainer(gi_config(cache_dir, *base), tmp_path / "one")
    state_after_one = torch.get_rng_state()
    assert "pretrain/verifier/restart" not in single.pretrain_metrics
    several = build_trainer(gi_config(cache_dir, *base, "trainer.pretrain.restarts=3"), tmp_path / "three")
    # The restarts draw their weights and data order from their own generators.
    assert torch.equal(torch.get_rng_state(), state_after_one)
    entries = [load_checked(path) for path in (tmp_path / "p").glob("verifier_*.pt")]
    entry = next(entry for entry in entries if entry["key"]["pretrain"]["restarts"] == 3)
    scores = entry["restart_scores"]
    assert len(scores) == 3 and len(set(scores)) > 1  # fresh weights and data order: different fits
    # The first fit is the single fit; the kept one is the best.
    assert scores[0] == pytest.approx(single.pretrain_metrics["pretrain/verifier/train_accuracy"])
    metrics = several.pretrain_metrics
    assert metrics["pretrain/verifier/train_accuracy"] == pytest.approx(max(scores))
    assert metrics["pretrain/verifier/worst_restart_score"] == pytest.approx(min(scores))
    assert scores[int(metrics["pretrain/verifier/restart"])] == max(scores)
    with pytest.raises(ConfigError, match="restarts"):
        build_trainer(gi_config(cache_dir, *base, "trainer.pretrain.restarts=0"), tmp_path / "zero")


def test_pretraining_errors(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match="pretrain.agents names \\['judge'\\]"):
        build_trainer(gi_config(cache_dir, "protocol=nip", "trainer.pretrain.agents=[judge]"), tmp_path / "a")
    with pytest.raises(ConfigError, match="needs a scenario with demonstrations or labelled data"):
        build_trainer(smoke_config("trainer.pretrain.agents=[verifier]"), tmp_path / "b")


def test_decision_and_message_entropies_closed_form(tmp_path, cache_dir):
    trainer = build_trainer(gi_config(cache_dir, "protocol=nip", "protocol.max_rounds=4"), tmp_path)
    n = trainer.train_env.max_nodes
    actions = 2 * n + 2
    # One step, two agents (prover, verifier); uniform logits.
    mask = torch.zeros(1, 2, actions, dtype=torch.bool)
    mask[0, 0, :4] = True  # the prover may send 4 nodes
    mask[0, 1, :2] = True  # the verifier may send 2 nodes, or decide
    mask[0, 1, 2 * n :] = True
    batch = TensorDict(
        {"agents": {"logits": torch.zeros(1, 2, actions), "action_mask": mask, "active": torch.tensor([[True, True]])}},
        batch_size=[1],
    )
    metrics = trainer.scenario.policy_metrics(batch)
    assert metrics["agents/prover/policy/message_entropy"] == pytest.approx(math.log(4))
    assert metrics["agents/verifier/policy/message_entropy"] == pytest.approx(math.log(2))
    # Reject 1/4, accept 1/4, continue 2/4.
    expected = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5))
    assert metrics["agents/verifier/policy/decision_entropy"] == pytest.approx(expected)


#: Every registered RL objective but PPO (which every other test of this file trains).
OBJECTIVES = [name for name in TRAINERS.names(subclass_of=TensorDictRlTrainer) if name != "ppo"]


#: The fast tier trains the standard objectives (test_learning_aware and test_device_guard train a learning-aware trainer fast); the full run trains them all.
@pytest.mark.parametrize("trainer", tiered(OBJECTIVES, fast=fast_trainers(OBJECTIVES, learning_aware=0)))
def test_every_objective_trains_end_to_end_on_graph_isomorphism(tmp_path, cache_dir, trainer, run_probe):
    config = gi_config(cache_dir, f"trainer={trainer}", "protocol=nip", "protocol.max_rounds=4", "logger=csv")
    metrics = run_experiment(config, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trainer_type"] == trainer
    assert summary["iterations"] == 3 and summary["frames"] == 3 * 96  # num_iterations x frames_per_batch
    # The objective updated both agents, through its own loss terms and no others.
    assert run_probe.changed() == {"prover", "verifier"}
    scalars = tmp_path / "metrics" / "scalars"
    logged = {f"loss/{path.stem}" for path in (scalars / "loss").glob("*.csv")}
    trainer_ = run_probe.trainer
    own_terms = trainer_.loss_module(trainer_.buffer.sample()).keys()
    assert logged == {trainer_.loss_contract.metric_name(key) for key in own_terms if key.startswith("loss_")}
    # Only a loss with a critic (REINFORCE's baseline) has a value term.
    assert ("loss/value" in logged) == (getattr(trainer_.loss_module, "critic_network", None) is not None)
    policy_loss = [value for _, value in read_csv_metric(tmp_path, "loss/policy")]
    assert policy_loss and all(math.isfinite(value) for value in policy_loss) and any(policy_loss)
    # The shared diagnostics, whatever the objective: zero KL on the first batch (the initial policy), then more.
    kl = [value for _, value in read_csv_metric(tmp_path, "objective/kl")]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 0
    # The test accuracy is the share of the 64 test episodes decided correctly.
    _, correct, _ = decided_correctly(run_probe)
    assert metrics["test/accuracy"] == pytest.approx(correct.float().mean().item())


def test_agent_options_are_checked_in_one_line(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match=r"scenario.default_agent.hidden_size \(16\) must be a multiple of"):
        build_trainer(gi_config(cache_dir, "protocol=nip", "scenario.default_agent.attention_heads=3"), tmp_path)
    with pytest.raises(ConfigError, match=r"scenario.agents.verifier.message_encoding must be one of"):
        build_trainer(
            gi_config(cache_dir, "protocol=nip", "+scenario.agents.verifier={message_encoding: rounds}"), tmp_path
        )
    # Without the transformer layer the agents still build.
    config = gi_config(cache_dir, "protocol=nip", "scenario.default_agent.attention_heads=0")
    assert build_trainer(config, tmp_path / "plain").agent_names == ("prover", "verifier")


def load_results_script():
    import importlib.util
    from pathlib import Path

    location = Path(__file__).resolve().parents[1] / "scripts" / "gi_protocol_results.py"
    spec = importlib.util.spec_from_file_location("gi_protocol_results", location)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_protocol_results_table_from_run_summaries():
    script = load_results_script()

    def run(accuracy, faithful=None, length=3.0):
        metrics = {"test/accuracy": accuracy, "test/episode_length": length, "test/always_wrong": 1 - accuracy}
        if faithful is not None:
            metrics["test/agents/prover0/faithful_answers"] = faithful
        return {"test_metrics": metrics, "train_seconds": 120.0, "frames": 1024}

    results = {
        "mnip": [run(0.8, 0.5), run(0.9, 0.7, length=5.0)],
        "solo_verifier": [run(0.6, length=1.0)],
        "adp": [{"error": "boom"}],
    }
    rows = script.table(results).splitlines()
    assert rows[2] == "| mnip | 0.850 ± 0.071 | 0.800 | 0.900 | 0.15 | 0.60 | 4.00 | 2 | 1,024 | 2.0 min | 0.67 |"
    assert rows[3] == "| solo_verifier | 0.600 ± 0.000 | 0.600 | 0.600 | 0.40 |  | 1.00 | 1 | 1,024 | 2.0 min |  |"
    assert rows[4] == "| adp | failed | | | | | | 0 | | | 0.61 |"


def test_protocol_results_time_to_target_and_claims(tmp_path):
    script = load_results_script()
    folder = tmp_path / "nip_seed0"
    for name, rows in {
        "eval/accuracy": [(10, 0.8), (20, 0.91), (30, 0.95)],
        "timers/iteration": [(step, 2.0) for step in range(1, 31)],
        "timers/pretrain": [(1, 30.0)],
    }.items():
        path = folder / "metrics" / "scalars" / f"{name}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{step},{value}\n" for step, value in rows))
    assert script.seconds_to_target(folder, 0.9) == 30.0 + 20 * 2.0  # warm start, then 20 iterations
    assert script.seconds_to_target(folder, 0.99) is None

    def run(seed, accuracy):
        return {"seed": seed, "test_metrics": {"test/accuracy": accuracy}, "train_seconds": 60.0, "frames": 1,
                "pretrain_seconds": 30.0, "seconds_to_target": 90.0 if accuracy >= 0.9 else None}

    results = {"nip": [run(0, 0.95), run(1, 0.84)], "solo_verifier": [run(0, 0.7), run(1, 0.72)]}
    assert script.check_claims(results, {"nip": 0.85}, {"nip": 0.10}) == ["nip: every seed must reach 0.85; seed 1: 0.840"]
    assert script.check_claims(results, {"nip": 0.80}, {"nip": 0.20}) == [
        "nip: mean 0.895 is not 0.2 above solo_verifier's 0.710"
    ]
    assert script.check_claims(results, {"nip": 0.80}, {"nip": 0.10}) == []
    # Per seed: seed 1's 0.84 is 0.12 above its solo run's 0.72, not 0.2.
    assert script.check_claims(results, {}, {}, {"nip": 0.2}) == [
        "nip: every seed must be 0.2 above solo_verifier's same seed; seed 1: 0.840 against 0.720"
    ]
    assert script.check_claims(results, {}, {}, {"nip": 0.1}) == []
    assert script.table(results, paper=False).splitlines()[2].endswith("| 1.5 min |  |")  # no NIP-paper figure
    row = script.table(results, target=0.9).splitlines()[2]
    assert row.endswith("| 1.5 min | 1.5 (max 1.5) min; 1 never | 0.945 |")  # 60 s of training + 30 s warm start
    with pytest.raises(SystemExit):
        script.main(["--require", "nip:0.85", "--out", str(tmp_path / "none")])


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_protocol_results_plots_the_curves_each_protocol_logs(tmp_path):
    import json

    import yaml

    script = load_results_script()
    for protocol, metrics in (("nip", ("eval/accuracy", "eval/agents/prover/faithful_answers")), ("solo_verifier", ("eval/accuracy",))):
        for seed in (0, 1):
            folder = tmp_path / f"{protocol}_seed{seed}"
            (folder / "metrics" / "scalars").mkdir(parents=True)
            (folder / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "protocol": {"name": protocol}}))
            (folder / "summary.json").write_text(json.dumps({"seed": seed, "frames": 300, "test_metrics": {}}))
            for name in ("train/frames", *metrics):
                path = folder / "metrics" / "scalars" / f"{name}.csv"
                path.parent.mkdir(parents=True, exist_ok=True)
                values = [100, 200, 300] if name == "train/frames" else [0.5, 0.6 + 0.1 * seed, 0.9]
                path.write_text("".join(f"{step},{value}\n" for step, value in zip((1, 2, 3), values)))
    written = script.plot(tmp_path, ["nip", "solo_verifier"], [0, 1, 2])  # seed 2 never ran
    assert [path.name for path in written] == ["curves_accuracy.png", "curves_faithful_prover.png"]
    assert all(path.stat().st_size > 0 for path in written)


@pytest.mark.parametrize("preset", ["quick", "paper", "paper_fast"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_gi_presets_build_agents_for_every_protocol(preset, protocol):
    # Built without the data (which the agents do not need): the presets must name
    # only agents every protocol has, and the provers must be the larger agents.
    from nip_like.validation import build_scenario
    from tests.conftest import make_config

    scenario = build_scenario(make_config(f"preset={preset}", f"protocol={protocol}"))
    sizes = scenario.agent_sizes()
    assert scenario.make_agents().agent_names == scenario.agent_names
    if preset != "quick":
        assert sizes["verifier"].gin_layers == 2
        assert all(sizes[name].gin_layers == 5 for name in scenario.agent_names if name != "verifier")
