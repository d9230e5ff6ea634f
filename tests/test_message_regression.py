"""Message regression: regressors that read the label off the provers' messages, and the command that runs them on a run."""

import json

import pytest
import torch
from torch import nn

from nip_like import analyse
from nip_like.analysis.message_regression import RegressionOptions, fit_and_score, pooled_inputs, regress_messages
from nip_like.errors import ConfigError
from nip_like.experiment import run_experiment
from nip_like.scenarios.messaging import MessageFeatures, one_hot_messages
from tests.conftest import smoke_config

FAST = RegressionOptions(epochs=20, batch_size=128, learning_rate=3e-3, hidden_size=16)


def _labels(episodes: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(episodes, generator=torch.Generator().manual_seed(seed)) < 0.4


def test_one_hot_messages_lay_out_each_provers_choices():
    sent = torch.tensor([[[3, 0, -1], [-1, 2, 1]]])  # one episode, two steps, three agents
    features = one_hot_messages(sent, ("prover0", "verifier", "prover1"), [0, 2], width=4)
    assert [item.who for item in features] == ["prover0", "prover1"]
    assert features[0].values.tolist() == [[0, 0, 0, 1, 0, 0, 0, 0]]  # node 3 at step 0, nothing at step 1
    assert features[1].values.tolist() == [[0, 0, 0, 0, 0, 1, 0, 0]]  # nothing at step 0, node 1 at step 1


def test_a_message_that_tells_the_label_is_read_and_noise_is_not():
    labels = _labels(400)
    noise = torch.randn(400, 12, generator=torch.Generator().manual_seed(1))
    telling = noise.clone()
    telling[:, 5] = labels.float()  # one entry announces the answer
    correct = torch.ones(400, dtype=torch.bool)
    told = fit_and_score("prover", "vector", telling, labels, correct, FAST)
    blind = fit_and_score("prover", "vector", noise, labels, correct, FAST)
    assert told.regressor == "mlp" and told.held_out == 80 and told.fitted == 320
    assert told.accuracy > 0.97
    assert blind.accuracy < blind.majority + 0.1  # nothing to read: about the majority baseline
    assert told.verifier == 1.0


def test_image_messages_get_a_cnn_and_token_messages_a_linear_probe():
    labels = _labels(300)
    images = torch.zeros(300, 1, 6, 6)
    images[labels, 0, 1, 4] = 1.0  # a pixel lit only when the answer is accept
    images[~labels, 0, 4, 1] = 1.0
    score = fit_and_score("prover", "image", images, labels, torch.zeros(300, dtype=torch.bool), FAST)
    assert score.regressor == "cnn" and score.accuracy > 0.95 and score.verifier == 0.0
    # Tokens: token 7 in accept episodes, token 3 otherwise, after padding of varying length.
    tokens = torch.where(labels.unsqueeze(-1), torch.tensor([7, 1, 1]), torch.tensor([3, 1, 1]))
    mask = torch.tensor([True, False, False]).expand(300, 3)
    embedding = nn.Embedding(10, 4)
    features = MessageFeatures("prover", "tokens", tokens, mask, embedding)
    pooled = pooled_inputs(features)
    assert torch.allclose(pooled, embedding(tokens[:, 0]).detach())  # the mean over the real tokens only
    [score] = regress_messages([features], labels, torch.ones(300, dtype=torch.bool), FAST)
    assert score.regressor == "linear probe" and score.inputs == 4 and score.accuracy > 0.95


def test_several_provers_are_also_read_together():
    labels = _labels(300)
    first = torch.randn(300, 3, generator=torch.Generator().manual_seed(2))
    second = first.clone()
    first[:, 0] += labels.float()  # each alone says part of it
    features = [MessageFeatures("prover0", "vector", first), MessageFeatures("prover1", "vector", second)]
    scores = regress_messages(features, labels, torch.ones(300, dtype=torch.bool), FAST)
    assert [score.who for score in scores] == ["prover0", "prover1", "provers"]
    assert scores[-1].inputs == 6


def test_bad_inputs_are_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"--held-out must be in \(0, 1\), got 1.0"):
        RegressionOptions(held_out=1.0)
    with pytest.raises(ConfigError, match="no prover"):
        regress_messages([], torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ConfigError, match="too few"):
        fit_and_score("p", "vector", torch.zeros(1, 2), torch.ones(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool), FAST)


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_the_command_regresses_a_graph_isomorphism_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = smoke_config(
        "scenario=graph_isomorphism", "protocol=nip", "scenario.num_pairs=200", f"scenario.cache_dir={tmp_path / 'cache'}"
    )
    run_experiment(config, run_dir, handle_signals=False)
    assert analyse.main(["message-regression", str(run_dir), "--episodes", "40", "--epochs", "5"]) == 0
    result = json.loads((run_dir / "evaluations" / "message-regression-last.json").read_text())
    assert result["episodes"] == 40 and [score["who"] for score in result["scores"]] == ["prover"]
    [score] = result["scores"]
    assert score["regressor"] == "mlp" and score["held_out"] == 8 and score["inputs"] % (2 * 11) == 0  # a node of 2 graphs per step
    assert 0 <= score["accuracy"] <= 1 and 0 <= score["verifier"] <= 1
    printed = capsys.readouterr().out
    assert "messages of" in printed and "prover" in printed
    # A scenario whose messages are not laid out for a regressor: one line, exit status 2.
    hidden = tmp_path / "hidden"
    run_experiment(smoke_config(), hidden, handle_signals=False)
    with pytest.raises(SystemExit) as exit_:
        analyse.main(["message-regression", str(hidden)])
    assert exit_.value.code == 2
    assert "does not lay out its messages" in capsys.readouterr().err


def test_image_classification_messages_are_read_by_a_cnn(tmp_path):
    from nip_like.analysis.message_regression import RegressionOptions as Options
    from tests.test_image_classification import ic_config

    run_dir = tmp_path / "run"
    run_experiment(ic_config(tmp_path / "cache", "trainer.num_test_episodes=32"), run_dir, handle_signals=False)
    result = analyse.message_regression(run_dir, episodes=32, options=Options(epochs=3, hidden_size=8))
    [score] = result["scores"]
    assert score["who"] == "prover" and score["kind"] == "image" and score["regressor"] == "cnn"
    assert score["inputs"] % (8 * 8) == 0 and score["held_out"] == 7  # one channel per step over the 8x8 pixel grid
