"""The RL trainer: loops, progress accounting, schedules, evaluation, errors."""

import re
import json
import math

import pytest
import torch

from nip_like.checkpoint import load_checked
from nip_like.errors import ConfigError, TrainingError
from nip_like.experiment import build_trainer, run_experiment
from nip_like.logging import read_csv_metric
from nip_like.registry import TRAINERS
from nip_like.trainers import PpoTrainer
from tests.conftest import hidden_bits_correct, smoke_config


def test_total_iterations_sum_the_decorated_loops(tmp_path):
    trainer = build_trainer(smoke_config("trainer.num_test_episodes=100", "trainer.test_batch_episodes=30"), tmp_path)
    assert trainer.get_total_num_iterations() == 3 + 4


def test_smoke_run_writes_summary_metrics_and_checkpoints(tmp_path, run_probe):
    config = smoke_config("logger=csv")
    metrics = run_experiment(config, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test_metrics"] == metrics
    assert summary["iterations"] == 3 and summary["frames"] == 3 * 96
    # Each iteration: 2 epochs of 96 / 32 = 3 minibatches, one optimiser step each.
    assert summary["gradient_steps"] == 3 * 2 * 3
    assert summary["seed"] == 0 and summary["run_id"]
    assert run_probe.changed() == {"prover", "verifier"}
    losses = [value for _, value in read_csv_metric(tmp_path, "loss/policy")]
    assert len(losses) == 3 and all(math.isfinite(value) and value != 0 for value in losses)
    # Test accuracy, counted by hand from the test loop's actions: 64 episodes (2 batches of 32).
    decisions = run_probe.test_decisions(64)
    assert metrics["test/episodes"] == len(decisions) == 64
    correct = hidden_bits_correct(decisions, run_probe.trainer.agent_names.index("verifier"))
    assert metrics["test/accuracy"] == pytest.approx(correct.float().mean().item())
    assert (tmp_path / "checkpoints" / "last.pt").is_file()
    assert (tmp_path / "checkpoints" / "best.pt").is_file()
    assert (tmp_path / "config.yaml").is_file()
    for name in ("loss/policy", "loss/value", "objective/entropy", "objective/kl", "policy/entropy",
                 "policy/clipfrac", "policy/approxkl", "SPS",
                 "timers/collect", "eval/reward", "train/agents/prover/reward", "agents/verifier/loss/policy"):
        assert (tmp_path / "metrics" / "scalars" / f"{name}.csv").is_file(), name


def test_test_run_mode_runs_each_loop_once(tmp_path):
    trainer = build_trainer(smoke_config("run.test_run=true", "trainer.num_iterations=50"), tmp_path)
    assert trainer.get_total_num_iterations() == 2
    trainer.train()
    assert trainer.state.iteration == 1


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    # 96 frames / 32 per minibatch = 3 minibatches; accumulate all 3 -> 1 step per epoch.
    trainer = build_trainer(smoke_config("trainer.optimizer.grad_accumulation_steps=3"), tmp_path)
    trainer.train()
    assert trainer.state.gradient_steps == 3 * 2


@pytest.mark.parametrize(
    "items, steps_per_epoch",
    # 3 minibatches: a window of 2, then one of 1; 2 minibatches (a remainder of 16 is dropped): one
    # window; fewer items than a minibatch: one minibatch of all of them.
    [(96, 2), (80, 1), (20, 1)],
)
def test_layouts_of_any_size_make_whole_accumulation_windows(tmp_path, items, steps_per_epoch):
    # Preference pairs and complete episodes vary in number from batch to batch.
    trainer = build_trainer(smoke_config("trainer.optimizer.grad_accumulation_steps=2", "trainer.eval.every=0"), tmp_path)
    trainer.loss_module.layout_rollouts = lambda batch: batch.reshape(-1)[:items]
    metrics = trainer.train_iteration()
    assert metrics["train/layout_items"] == items
    assert trainer.state.gradient_steps == 2 * steps_per_epoch
    assert trainer.buffer.batch_size == min(items, 32)
    assert all(param.grad is None for param in trainer.policy.parameters())  # nothing left over


def test_agent_update_schedule_freezes_an_agent(tmp_path):
    trainer = build_trainer(smoke_config("+trainer.agent_updates.prover={start:100}"), tmp_path)
    prover = [p.detach().clone() for p in trainer.agent_modules.agent_parameters("prover")]
    verifier = [p.detach().clone() for p in trainer.agent_modules.agent_parameters("verifier")]
    trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(prover, trainer.agent_modules.agent_parameters("prover")))
    assert not all(torch.equal(a, b) for a, b in zip(verifier, trainer.agent_modules.agent_parameters("verifier")))


def test_per_agent_learning_rate_and_schedule(tmp_path):
    trainer = build_trainer(
        smoke_config("+trainer.optimizer.agent_lr.verifier=0.01", "trainer.optimizer.lr_schedule=linear"), tmp_path
    )
    lrs = {g["agent"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert lrs == {"prover": pytest.approx(0.001), "verifier": pytest.approx(0.01)}
    trainer.train()
    assert all(g["lr"] == pytest.approx(0.0) for g in trainer.optimizer.param_groups)


def test_early_stopping_stops_training(tmp_path):
    trainer = build_trainer(
        smoke_config(
            "trainer.num_iterations=20", "trainer.eval.every=1", "trainer.eval.early_stopping_patience=1",
            "trainer.eval.metric=eval/episodes",
        ),
        tmp_path,
    )
    trainer.train()
    # eval/episodes never improves after the first evaluation.
    assert trainer.state.stopped_early and trainer.state.iteration == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.minibatch_size=200", "larger than the batch"),
        ("trainer.frames_per_batch=100", "multiple of trainer.num_envs"),
        ("trainer.optimizer.grad_accumulation_steps=0", "grad_accumulation_steps must be >= 1, got 0"),
        ("trainer.num_epochs=0", "trainer.num_epochs must be >= 1, got 0"),
        ("trainer.eval.mode=best", "trainer.eval.mode must be one of ['max', 'min'], got 'best'"),
        ("trainer.eval.metric=train/reward", "eval/..."),
        ("trainer.objective.variant=trust", "variant"),
        ("trainer.optimizer.name=lion", "optimizer.name"),
    ],
)
def test_impossible_settings_fail_at_start(tmp_path, override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_trainer(smoke_config(override), tmp_path)


def test_unknown_eval_metric_is_reported_before_any_step(tmp_path):
    trainer = build_trainer(smoke_config("trainer.eval.metric=eval/acuracy"), tmp_path)
    with pytest.raises(ConfigError, match=r"'eval/acuracy' is not among the evaluation metrics \[.*'eval/accuracy'"):
        trainer.train()
    assert trainer.state.frames == 0 and trainer.state.gradient_steps == 0  # refused before collecting
    assert not (tmp_path / "checkpoints").exists()


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ConfigError, match=re.escape(f"choose one of {TRAINERS.names()}")) as error:
        TRAINERS.get("dpoo")
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="cannot import"):
        TRAINERS.get("no_such_module.Trainer")


class NanPpoTrainer(PpoTrainer):
    """PPO whose loss turns NaN on the second iteration."""

    def _get_loss_module_and_gae(self):
        loss, gae = super()._get_loss_module_and_gae()
        forward = loss.forward
        trainer = self

        def poisoned(batch):
            out = forward(batch)
            if trainer.state.iteration >= 1:
                out["loss_objective"] = out["loss_objective"] * float("nan")
            return out

        loss.forward = poisoned
        return loss, gae


def test_nan_loss_stops_with_one_line_and_keeps_the_checkpoint(tmp_path):
    config = smoke_config("trainer.trainer_type=tests.test_trainer.NanPpoTrainer")
    trainer = build_trainer(config, tmp_path)
    with pytest.raises(TrainingError, match="loss became nan at iteration 2") as error:
        trainer.train()
    assert "\n" not in str(error.value)
    checkpoint = tmp_path / "checkpoints" / "last.pt"
    assert checkpoint.is_file()
    assert load_checked(checkpoint)["trainer"]["train_state"]["iteration"] == 1


class SegmentLoss(PpoTrainer.loss_class):
    def layout_rollouts(self, batch):
        return batch  # one item per environment row of (time) steps


class SegmentTrainer(PpoTrainer):
    loss_class = SegmentLoss


def test_loss_module_decides_the_buffer_layout(tmp_path):
    config = smoke_config("trainer.trainer_type=tests.test_trainer.SegmentTrainer", "trainer.minibatch_size=8")
    trainer = build_trainer(config, tmp_path)
    trainer.train()
    assert len(trainer.buffer) == 16  # num_envs segments, not 96 transitions
    assert trainer.buffer.sample().batch_size == (8, 6)
    assert trainer.state.gradient_steps == 3 * 2 * (16 // 8)


@pytest.mark.parametrize(
    "backend, folder",
    [pytest.param("tensorboard", "tensorboard", marks=pytest.mark.slow), pytest.param("wandb", "wandb", marks=pytest.mark.slow), pytest.param("mlflow", "mlruns", marks=pytest.mark.slow)],
)
def test_optional_logger_backends_write_metrics(tmp_path, monkeypatch, backend, folder):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_experiment(smoke_config(f"logger={backend}"), tmp_path)
    written = [path for path in (tmp_path / folder).rglob("*") if path.is_file()]
    assert written, f"{backend} wrote nothing"
    # CSV stays on beside the optional backend.
    assert (tmp_path / "metrics" / "scalars" / "loss" / "policy.csv").is_file()


def test_missing_logger_package_is_a_config_error(tmp_path, monkeypatch):
    import importlib.util

    from nip_like.logging import MetricLogger

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the 'wandb' package: pip install 'nip_like\[wandb\]'"):
        MetricLogger(smoke_config("logger=wandb").logger, tmp_path, "x")
    with pytest.raises(ConfigError, match="unknown logger backend 'neptune'"):
        MetricLogger(smoke_config("logger.backends=[neptune]").logger, tmp_path, "x")


def test_kl_from_the_initial_policy_starts_at_zero_and_grows(tmp_path):
    run_experiment(smoke_config("logger=csv", "trainer.num_iterations=4"), tmp_path)
    kl = [value for _, value in read_csv_metric(tmp_path, "objective/kl")]
    assert kl[0] == pytest.approx(0.0, abs=1e-7)  # the first batch is collected by the initial policy
    assert kl[-1] > 0
    entropy = [value for _, value in read_csv_metric(tmp_path, "objective/entropy")]
    assert 0 < entropy[0] <= torch.log(torch.tensor(4.0)).item() + 1e-6


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_exploding_losses_and_parameters_stop_with_the_last_checkpoint_intact(tmp_path):
    # A bound below the loss's magnitude: the first minibatch is already "divergent".
    trainer = build_trainer(smoke_config("trainer.divergence_bound=1e-9", "logger=none"), tmp_path / "a")
    with pytest.raises(TrainingError, match=r"the loss exploded to .* beyond trainer.divergence_bound=1e-09"):
        trainer.train()
    assert not (tmp_path / "a" / "checkpoints" / "last.pt").exists()  # no checkpoint of the divergent state
    # Parameters pushed past the bound after a good iteration: the checkpoint of that iteration stays as it was.
    trainer = build_trainer(smoke_config("trainer.divergence_bound=50", "run.checkpoint_every=1"), tmp_path / "b")
    trainer.train_iteration()
    trainer.state.iteration = 1
    trainer.save_checkpoint("last")
    saved = (tmp_path / "b" / "checkpoints" / "last.pt").read_bytes()
    with torch.no_grad():
        next(trainer.agent_modules.agent_parameters("verifier")).add_(100.0)
    with pytest.raises(TrainingError, match=r"parameters of agent verifier reached magnitude 1\d\d"):
        trainer.train_iteration()
    assert (tmp_path / "b" / "checkpoints" / "last.pt").read_bytes() == saved
    # null switches the bound off (the non-finite check stays).
    assert build_trainer(smoke_config("trainer.divergence_bound=null"), tmp_path / "c").update_settings.divergence_bound == math.inf


def test_the_buffer_takes_items_whose_own_dimensions_change_between_iterations():
    from tensordict import TensorDict

    from nip_like.trainers.update import fill_buffer

    # Whole episodes, padded to the batch's longest: 5 steps in one iteration, 3 in the next (a learning-aware
    # trainer's layout failed on exactly this, mid-run).
    long = TensorDict({"reward": torch.ones(299, 5)}, batch_size=[299, 5])
    short = TensorDict({"reward": torch.full((299, 3), 2.0)}, batch_size=[299, 3])
    buffer = fill_buffer(None, long, 128, torch.device("cpu"))
    buffer = fill_buffer(buffer, short, 128, torch.device("cpu"))
    assert buffer.sample().batch_size == torch.Size([128, 3]) and bool((buffer.sample()["reward"] == 2).all())
    kept = fill_buffer(buffer, short.clone(), 128, torch.device("cpu"))
    assert kept is buffer  # the same item shape reuses the storage
