"""Learning-aware trainers (SPG, LOLA, SOS and their PPO-clipped forms) on games with known answers.

Fast: the LOLA shaping and look-ahead terms and the SPG correction against
their closed forms on a one-shot 2x2 game with sigmoid policies (one
parameter per player, a batch holding each joint action in proportion to its
probability, so the estimators are exact); one iteration of each trainer on
the matrix game and on hidden bits; bad inputs. Slow: matching pennies
(simultaneous gradient play leaves the mixed equilibrium, LOLA and SOS
converge to it) and a Stackelberg game (SPG reaches the leader's payoff).
"""

from __future__ import annotations

import math

import pytest
import torch

from nip_like import keys
from nip_like.cli import report_errors
from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer
from nip_like.objectives.learning_aware import conjugate_gradient, low_rank_inverse
from nip_like.objectives.learning_aware.second_order import _dot, _flat, _unflat
from nip_like.registry import TRAINERS
from nip_like.scenarios.matrix_game.scenario import LogitTable
from nip_like.trainers.learning_aware import LearningAwareTrainer
from tests.conftest import make_config, smoke_config

#: The learning-aware trainers, from the registry.
LEARNING_AWARE = TRAINERS.names(subclass_of=LearningAwareTrainer)
QUIET = ("run.progress_bar=false", "logger=none", "run.num_threads=1")
MATRIX = ("scenario=matrix_game", "protocol=matrix_game")
#: A prisoner's dilemma, payoffs[row action][column action] = [row, column]: not zero-sum, every term non-zero.
DILEMMA = [[[3.0, 3.0], [0.0, 5.0]], [[5.0, 0.0], [1.0, 1.0]]]


def sigmoid_prime(x: float) -> float:
    s = 1 / (1 + math.exp(-x))
    return s * (1 - s)


def sigmoid_second(x: float) -> float:
    s = 1 / (1 + math.exp(-x))
    return s * (1 - s) * (1 - 2 * s)


def exact_batch(trainer, counts: dict[tuple[int, int], int]):
    """One-step episodes holding each joint action ``(row, column)`` ``counts`` times, laid out by the loss.

    The advantage is the reward itself (no baseline), so the loss's
    estimators equal the expectations when the counts are proportional to
    the joint probabilities.
    """
    actions = torch.tensor([pair for pair, count in counts.items() for _ in range(count)])
    env = trainer.scenario.make_env(len(actions), "train", 0, "cpu")
    td = env.reset()
    with torch.no_grad():
        td = trainer.policy(td)
        td.set(keys.ACTION_KEY, actions)
        td.set(keys.LOG_PROB_KEY, trainer.policy.get_dist(td).log_prob(actions))
    td = env.step(td)
    reward = td.get(("next", *keys.REWARD_KEY))
    td.set(keys.ADVANTAGE_KEY, reward.clone())
    td.set(keys.VALUE_TARGET_KEY, reward.clone())
    return trainer.loss_module.layout_rollouts(td.unsqueeze(1))


def bimatrix_terms(payoffs, x: float, y: float) -> dict[str, float]:
    """Closed-form derivatives of V_k(x, y) for sigmoid policies p = s(x), q = s(y) (first actions)."""
    p, q = 1 / (1 + math.exp(-x)), 1 / (1 + math.exp(-y))
    a = torch.tensor(payoffs)
    terms = {}
    for k, name in enumerate(("row", "column")):
        A = a[..., k]
        c = float(A[0, 0] - A[0, 1] - A[1, 0] + A[1, 1])
        terms[f"dV{name}/dx"] = sigmoid_prime(x) * (float(A[0, 1] - A[1, 1]) + q * c)
        terms[f"dV{name}/dy"] = sigmoid_prime(y) * (float(A[1, 0] - A[1, 1]) + p * c)
        terms[f"dV{name}/dxdy"] = sigmoid_prime(x) * sigmoid_prime(y) * c
        terms[f"dV{name}/dydy"] = sigmoid_second(y) * (float(A[1, 0] - A[1, 1]) + p * c)
    return terms


def shaping_gradients(trainer, batch, term: str = "loss_shaping") -> dict[str, float]:
    """The gradient of one loss term on each player's parameter."""
    trainer.loss_module.zero_grad(set_to_none=True)
    losses = trainer.loss_module(batch)
    losses.get(term).backward()
    return {
        name: float(params[0].grad) if params[0].grad is not None else 0.0
        for name, params in trainer.loss_module.parameters_of.items()
    }


def matrix_trainer(tmp_path, trainer: str, *overrides: str):
    config = make_config(
        f"trainer={trainer}",
        *MATRIX,
        f"scenario.payoffs={DILEMMA}",
        "trainer.objective.entropy_coeff=0",
        "trainer.optimizer.lr=0.1",
        *QUIET,
        *overrides,
    )
    return build_trainer(config, tmp_path)


def test_lola_shaping_and_lookahead_terms_equal_their_closed_forms(tmp_path):
    # p = 3/4, q = 1/2: 8 episodes hold the joint actions in exact proportion.
    x, y = math.log(3), 0.0
    trainer = matrix_trainer(
        tmp_path,
        "lola",
        "scenario.initial_logits.row=[1.0986122886681098]",
        "trainer.objective.lookahead_lr=0.7",
        "trainer.objective.lookahead_term=true",
        "+trainer.optimizer.agent_lr.column=0.2",  # the column player learns twice as fast: alpha_column = 1.4
    )
    batch = exact_batch(trainer, {(0, 0): 3, (0, 1): 3, (1, 0): 1, (1, 1): 1})
    t = bimatrix_terms(DILEMMA, x, y)
    alpha = {"row": 0.7, "column": 1.4}
    # Loss L_k = -V_k; the update is xi - (H_o xi) - chi, so loss_shaping's gradient is -(H_o xi) - chi with
    # chi_row = alpha_col (d_x d_y L_col)(d_y L_row) and (H_o xi)_row = alpha_col (d_x d_y L_row)(d_y L_col).
    chi = {
        "row": alpha["column"] * t["dVcolumn/dxdy"] * t["dVrow/dy"],
        "column": alpha["row"] * t["dVrow/dxdy"] * t["dVcolumn/dx"],
    }
    lookahead = {
        "row": alpha["column"] * t["dVrow/dxdy"] * t["dVcolumn/dy"],
        "column": alpha["row"] * t["dVcolumn/dxdy"] * t["dVrow/dx"],
    }
    gradients = shaping_gradients(trainer, batch)
    for name in ("row", "column"):
        assert gradients[name] == pytest.approx(-chi[name] - lookahead[name], rel=1e-5, abs=1e-7)
        assert chi[name] != 0 and lookahead[name] != 0
    # Without the look-ahead term (Foerster et al.'s LOLA) only the shaping term is left.
    trainer.loss_module.lookahead_term = False
    gradients = shaping_gradients(trainer, batch)
    for name in ("row", "column"):
        assert gradients[name] == pytest.approx(-chi[name], rel=1e-5, abs=1e-7)
    # The own term is the simultaneous gradient, xi = grad_k L_k = -dV_k.
    own = shaping_gradients(trainer, batch, "loss_objective")
    assert own["row"] == pytest.approx(-t["dVrow/dx"], rel=1e-5)
    assert own["column"] == pytest.approx(-t["dVcolumn/dy"], rel=1e-5)
    # The shaping norm is logged through the loss contract.
    losses = trainer.loss_module(batch)
    assert losses["shaping_norm"].item() == pytest.approx(math.hypot(chi["row"], chi["column"]), rel=1e-5)
    assert trainer.loss_contract.metric_name("shaping_norm") == "learning_aware/shaping_norm"


@pytest.mark.parametrize("method", ["cg", "low_rank"])
def test_spg_leader_correction_equals_the_implicit_gradient(tmp_path, method):
    # p = 3/4, q = 1/4 (x = log 3, y = -log 3): 16 episodes in exact proportion; the row player leads.
    x, y = math.log(3), -math.log(3)
    damping = 0.05
    trainer = matrix_trainer(
        tmp_path,
        "spg",
        "protocol.leader=row",
        "scenario.initial_logits.row=[1.0986122886681098]",
        "scenario.initial_logits.column=[-1.0986122886681098]",
        f"trainer.objective.ihvp_method={method}",
        f"trainer.objective.ihvp_damping={damping}",
    )
    batch = exact_batch(trainer, {(0, 0): 3, (0, 1): 9, (1, 0): 1, (1, 1): 3})
    t = bimatrix_terms(DILEMMA, x, y)
    hessian = -t["dVcolumn/dydy"] + damping  # d_y d_y L_column + damping, positive here
    assert hessian > 0
    # Leader update: xi_row - (d_x d_y L_col) (d_y d_y L_col + damping)^-1 d_y L_row.
    expected = -(-t["dVcolumn/dxdy"]) * (-t["dVrow/dy"]) / hessian
    gradients = shaping_gradients(trainer, batch)
    assert gradients["row"] == pytest.approx(expected, rel=1e-5)
    assert gradients["column"] == 0.0  # the follower takes its own gradient


def test_inverse_hessian_vector_products_solve_a_known_system():
    torch.manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))
    eigenvalues = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.25, 0.1], dtype=torch.float64)
    hessian = basis @ torch.diag(eigenvalues) @ basis.T
    b = torch.randn(6, dtype=torch.float64)
    exact = torch.linalg.solve(hessian + 0.01 * torch.eye(6, dtype=torch.float64), b)
    x, residual = conjugate_gradient(lambda v: hessian @ v, b, iterations=6, damping=0.01)
    assert torch.allclose(x, exact, atol=1e-8) and residual < 1e-6
    x, residual = low_rank_inverse(lambda v: hessian @ v, b, rank=6, damping=0.01)
    assert torch.allclose(x, exact, atol=1e-8) and residual < 1e-6
    # A smaller rank keeps the largest curvatures: the residual is that of the approximation, not zero.
    _, residual = low_rank_inverse(lambda v: hessian @ v, b, rank=3, damping=0.01)
    assert 0 < residual < 1


@pytest.mark.parametrize("trainer", LEARNING_AWARE)
def test_each_trainer_updates_both_players_of_the_matrix_game(tmp_path, trainer):
    leads = ["protocol.leader=column"] if trainer.endswith("spg") else []
    config = smoke_config(
        f"trainer={trainer}", *MATRIX, *leads, "scenario.initial_logits.row=[0.5]", "trainer.optimizer.name=sgd"
    )
    trainer_object = build_trainer(config, tmp_path)
    before = [p.detach().clone() for p in trainer_object.policy.parameters()]
    metrics = trainer_object.train_iteration()
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer_object.policy.parameters()))
    assert metrics["train/layout_items"] == 96  # one-step episodes
    assert "learning_aware/shaping_norm" in metrics and "agents/row/learning_aware/shaping_norm" in metrics
    assert math.isfinite(metrics["loss/policy"])


@pytest.mark.parametrize("trainer", LEARNING_AWARE)
def test_each_trainer_runs_on_hidden_bits(tmp_path, trainer):
    # Per-agent MLP networks over three-step episodes (the prover twice, then the verifier).
    trainer_object = build_trainer(smoke_config(f"trainer={trainer}", "trainer.optimizer.lr=0.01"), tmp_path)
    before = {name: [p.detach().clone() for p in ps] for name, ps in trainer_object.loss_module.parameters_of.items()}
    metrics = trainer_object.train_iteration()
    for name, params in trainer_object.loss_module.parameters_of.items():
        assert any(not torch.equal(a, b) for a, b in zip(before[name], params)), name
    assert metrics["train/episode_length"] == 3.0
    # The verifier leads: under SPG it alone is shaped; LOLA and SOS shape both (anticipate=all).
    shaped = metrics["agents/prover/learning_aware/shaping_norm"]
    assert (shaped == 0) == trainer.endswith("spg") and metrics["agents/verifier/learning_aware/shaping_norm"] > 0


def test_update_schedules_and_learning_rates_reach_the_loss(tmp_path):
    # The prover is trained only from iteration 1: on iteration 0 nobody anticipates its step.
    trainer = build_trainer(
        smoke_config("trainer=lola", "+trainer.agent_updates.prover={start:1}", "+trainer.optimizer.agent_lr.prover=0.004"),
        tmp_path,
    )
    loss = trainer.loss_module
    assert loss.learning_rates == {"prover": pytest.approx(0.004), "verifier": pytest.approx(0.001)}
    metrics = trainer.train_iteration()
    assert loss.learning_agents == ("verifier",) and metrics["agents/verifier/learning_aware/shaping_norm"] == 0
    trainer.state.iteration += 1
    metrics = trainer.train_iteration()
    assert loss.learning_agents == ("prover", "verifier") and metrics["agents/verifier/learning_aware/shaping_norm"] > 0


class _OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (("trainer=spg", *MATRIX), "trainer spg needs a protocol with leaders and followers"),
        (("trainer=pspg", "protocol=solo_verifier"), "protocol solo_verifier declares none"),
        (("trainer=lola", *MATRIX, "trainer.objective.anticipate=followers"), "anticipate=followers"),
        (("trainer=spg", *MATRIX, "trainer.objective.ihvp_iterations=0"), "trainer.objective.ihvp_iterations must be in [1, 1000]"),
        (("trainer=pspg", *MATRIX, "trainer.objective.ihvp_rank=0"), "trainer.objective.ihvp_rank must be in [1, 1000]"),
        (("trainer=spg", *MATRIX, "trainer.objective.ihvp_damping=-1"), "trainer.objective.ihvp_damping must be >= 0"),
        (
            ("trainer=spg", *MATRIX, "protocol.leader=row", "trainer.objective.ihvp_method=low_rank", "trainer.objective.ihvp_damping=0"),
            "ihvp_damping must be > 0 with ihvp_method=low_rank",
        ),
        (("trainer=spg", *MATRIX, "trainer.objective.ihvp_method=newton"), "trainer.objective.ihvp_method must be one of"),
        (("trainer=sos", *MATRIX, "trainer.objective.sos_a=1"), "trainer.objective.sos_a must be in (0, 1)"),
        (("trainer=lola", *MATRIX, "trainer.objective.lookahead_lr=0"), "trainer.objective.lookahead_lr must be > 0"),
        (("trainer=pola", *MATRIX, "trainer.objective.clip_epsilon=0"), "trainer.objective.clip_epsilon must be > 0"),
    ],
)
def test_bad_inputs_fail_in_one_line_with_status_2_before_any_work(tmp_path, capsys, monkeypatch, overrides, fragment):
    built = []
    monkeypatch.setattr(LogitTable, "__init__", _recording(LogitTable.__init__, built))
    with pytest.raises(SystemExit) as exit_info, report_errors():
        build_trainer(smoke_config(*overrides), tmp_path / "run")
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: ") and fragment in error, error
    assert not built  # refused before any agent was built


def _recording(init, built):
    def wrapped(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    return wrapped


def test_agents_without_second_derivatives_are_refused_in_one_line(tmp_path, monkeypatch, capsys):
    def first_order_only(self, observation):
        logits = torch.cat([_OnceDifferentiable.apply(self.theta), self.theta.new_zeros(self.width - 1)])
        return logits.expand(*observation.shape[:-1], self.width)

    monkeypatch.setattr(LogitTable, "forward", first_order_only)
    with pytest.raises(SystemExit) as exit_info, report_errors():
        build_trainer(smoke_config("trainer=sos", *MATRIX), tmp_path / "run")
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.count("\n") == 1
    assert "trainer sos needs second derivatives of the policies, but agent row's policy cannot give them" in error
    # A first-order trainer trains the same agents.
    build_trainer(smoke_config("trainer=ppo", *MATRIX), tmp_path / "ppo")
    # A module may also declare it.
    monkeypatch.undo()
    monkeypatch.setattr(LogitTable, "supports_second_order", False, raising=False)
    with pytest.raises(ConfigError, match="LogitTable declares it cannot give"):
        build_trainer(smoke_config("trainer=lola", *MATRIX), tmp_path / "declared")


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_protocols_declare_who_leads():
    assert len(LEARNING_AWARE) == 6  # SPG, LOLA, SOS and their PPO-clipped forms
    from nip_like.validation import build_protocol

    assert build_protocol(make_config("protocol=nip")).leader_order == (("verifier",), ("prover",))
    assert build_protocol(make_config("protocol=debate")).leader_order == (("verifier",), ("prover0", "prover1"))
    assert build_protocol(make_config("protocol=solo_verifier")).leader_order is None
    assert build_protocol(make_config()).leader_order == (("verifier",), ("prover",))  # prover_verifier
    assert build_protocol(make_config("protocol=matrix_game")).leader_order is None
    assert build_protocol(make_config("protocol=matrix_game", "protocol.leader=column")).leader_order == (
        ("column",),
        ("row",),
    )


# ----------------------------------------------------------------- slow: known results
def _play(tmp_path, trainer: str, iterations: int, *overrides: str) -> list[tuple[float, float]]:
    """Train on the matrix game through the normal loop; each iteration's (row, column) first-action probabilities."""
    config = make_config(
        f"trainer={trainer}",
        *MATRIX,
        "trainer.num_envs=512",
        "trainer.frames_per_batch=512",
        "trainer.minibatch_size=512",
        "trainer.num_epochs=1",
        f"trainer.num_iterations={iterations}",
        "trainer.eval.every=0",
        "trainer.optimizer.name=sgd",
        "trainer.optimizer.max_grad_norm=null",
        "trainer.num_test_episodes=64",
        "trainer.test_batch_episodes=64",
        "seed=0",
        *QUIET,
        *overrides,
    )
    trainer_object = build_trainer(config, tmp_path)
    path = []
    for _ in range(iterations):
        metrics = trainer_object.train_iteration()
        trainer_object.state.iteration += 1
        path.append((metrics["agents/row/policy/prob_0"], metrics["agents/column/policy/prob_0"]))
    return path


PENNIES = (
    "scenario.initial_logits.row=[1.0]",
    "scenario.initial_logits.column=[1.0]",
    "trainer.optimizer.lr=1.0",
    "trainer.objective.entropy_coeff=0",
)


def _distance(point: tuple[float, float]) -> float:
    return max(abs(point[0] - 0.5), abs(point[1] - 0.5))


@pytest.mark.slow
def test_matching_pennies_simultaneous_gradient_cycles_away_from_the_mixed_equilibrium(tmp_path):
    # Plain simultaneous policy gradient (REINFORCE, no baseline, no normalisation, no entropy).
    plain = ("trainer.objective.baseline=false", "trainer.objective.normalize_advantage=false")
    path = _play(tmp_path, "reinforce", 200, *PENNIES, *plain)
    assert _distance(path[0]) == pytest.approx(0.23, abs=0.01)
    assert min(_distance(point) for point in path[100:]) > 0.4  # pushed out towards the pure strategies
    # ... and around them: the row player's strategy swings from one side of 1/2 to the other.
    sides = [point[0] > 0.5 for point in path]
    assert sum(a != b for a, b in zip(sides, sides[1:])) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["lola", "sos"])
def test_matching_pennies_lola_and_sos_converge_to_the_mixed_equilibrium(tmp_path, trainer):
    path = _play(tmp_path, trainer, 200, *PENNIES, "trainer.objective.lookahead_lr=4")
    assert _distance(path[0]) == pytest.approx(0.23, abs=0.01)
    assert max(_distance(point) for point in path[100:]) < 0.06


#: Row leads. Nash: U dominates D, so (U, L) pays the row player 2. Committing to play U with
#: probability p < 2/3 makes R the column player's best response, which pays the row player 3 + p.
STACKELBERG = [[[2.0, 1.0], [4.0, 0.0]], [[1.0, 0.0], [3.0, 2.0]]]
TEMPERATURE = 0.3  # both players' entropy bonus: the follower's best response is smooth (a logit response)


def stackelberg_optimum(temperature: float) -> tuple[float, float]:
    """The leader's best commitment p and its payoff in the entropy-regularised game, by a fine grid.

    The follower answers p with q(p) = sigmoid((3p - 2) / temperature) (its regularised best
    response); the leader maximises 3 + p - 2 q(p) + temperature H(p) and is paid 3 + p - 2 q(p).
    """
    p = torch.linspace(1e-5, 1 - 1e-5, 200_001, dtype=torch.float64)
    q = torch.sigmoid((3 * p - 2) / temperature)
    entropy = -(p * p.log() + (1 - p) * (1 - p).log())
    payoff = 3 + p - 2 * q
    best = (payoff + temperature * entropy).argmax()
    return p[best].item(), payoff[best].item()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["cg", "low_rank"])
def test_stackelberg_game_spg_reaches_the_leaders_payoff(tmp_path, method):
    p_star, payoff_star = stackelberg_optimum(TEMPERATURE)
    assert 3.2 < payoff_star < 11 / 3  # below the unregularised 11/3, far above the Nash payoff 2
    game = (f"scenario.payoffs={STACKELBERG}", f"trainer.objective.entropy_coeff={TEMPERATURE}")
    rates = ("trainer.optimizer.lr=0.5", "+trainer.optimizer.agent_lr.column=2.5")  # the follower learns faster
    spg = ("protocol.leader=row", "trainer.objective.critic_coeff=0.2", f"trainer.objective.ihvp_method={method}")
    path = _play(tmp_path / "spg", "spg", 300, *game, *rates, *spg)
    late = path[200:]
    # The leader's expected payoff 2pq + 4p(1-q) + (1-p)q + 3(1-p)(1-q) = 3 + p - 2q.
    payoff = sum(3 + p - 2 * q for p, q in late) / len(late)
    assert payoff == pytest.approx(payoff_star, abs=0.08)
    assert sum(p for p, _ in late) / len(late) == pytest.approx(p_star, abs=0.05)


@pytest.mark.slow
def test_stackelberg_game_simultaneous_gradient_play_ends_near_nash(tmp_path):
    # The same game and rates as SPG's test above, without a leader: the simultaneous gradient play that SPG's
    # result is compared with. Its own test, run once, instead of once in each IHVP method's test (the run does
    # not depend on the method): it took 112 of the 532 wall seconds of the three tests side by side (2026-12-02,
    # one process, load 12), so the two SPG tests lose about a sixth of their 29 CI seconds.
    game = (f"scenario.payoffs={STACKELBERG}", f"trainer.objective.entropy_coeff={TEMPERATURE}")
    rates = ("trainer.optimizer.lr=0.5", "+trainer.optimizer.agent_lr.column=2.5")
    plain = ("trainer.objective.baseline=false", "trainer.objective.normalize_advantage=false")
    path = _play(tmp_path, "reinforce", 300, *game, *rates, *plain)
    assert sum(3 + p - 2 * q for p, q in path[200:]) / 100 < 2.3  # near the Nash equilibrium (U, L), which pays 2


def test_the_ranks_padded_episodes_are_padded_to_the_longest_when_joined():
    from tensordict import TensorDict

    from nip_like.objectives.episodes import lengthened
    from nip_like.objectives.learning_aware import VALID_KEY, joined_episodes

    def episodes(count: int, length: int) -> TensorDict:
        valid = torch.ones(count, length, dtype=torch.bool)
        active = torch.ones(count, length, 2, dtype=torch.bool)
        step = torch.arange(length).expand(count, length) + 10 * torch.arange(count).unsqueeze(-1)
        return TensorDict({VALID_KEY: valid, keys.ACTIVE_KEY: active, "step": step}, [count, length])

    short, long = episodes(2, 2), episodes(1, 4)
    padded = lengthened(short, 4, 0, (VALID_KEY, keys.ACTIVE_KEY))
    assert padded.batch_size == (2, 4) and lengthened(long, 4, 0, (VALID_KEY,)) is long
    assert padded[:, :2].get("step").tolist() == short.get("step").tolist()
    assert padded[:, 2:].get("step").tolist() == [[0, 0], [10, 10]]  # each episode's first step, repeated
    assert not padded[:, 2:].get(VALID_KEY).any() and not padded[:, 2:].get(keys.ACTIVE_KEY).any()
    joined = joined_episodes([short, episodes(0, 3), long])  # rank order; an empty part too
    assert joined.batch_size == (3, 4) and joined.get(VALID_KEY).sum(-1).tolist() == [2, 2, 4]
    last = lengthened(short, 3, -1, (keys.ACTIVE_KEY,))  # DPO's padding repeats an episode's last step
    assert last.get("step").tolist() == [[0, 1, 1], [10, 11, 11]] and last.get(VALID_KEY).all()
    assert not last.get(keys.ACTIVE_KEY)[:, 2].any()


# ------------------------------------------------------- what the speed-ups keep
def _double_backward_terms(loss, joint_losses) -> dict[str, dict[str, list[torch.Tensor]]]:
    """The second-order terms by double backward passes through the whole graph (the losses' first implementation)."""
    index = {name: k for k, name in enumerate(loss.agent_names)}

    def grad(value, agent, create_graph=False):
        params = loss.parameters_of[agent]
        if not value.requires_grad:
            return [torch.zeros_like(p) for p in params]
        grads = torch.autograd.grad(
            value, params, retain_graph=True, create_graph=create_graph, allow_unused=True, materialize_grads=True
        )
        return list(grads)

    terms, own = {}, {}
    if hasattr(loss, "anticipated"):  # LOLA, SOS
        lookahead = getattr(loss, "lookahead_term", True)
        for agent in loss._trained():
            shaping = looking = joint_losses.new_zeros(())
            for other in loss.anticipated(agent):
                if other not in own:
                    own[other] = grad(joint_losses[index[other]], other, create_graph=True)
                cross = grad(joint_losses[index[agent]], other, create_graph=lookahead)
                alpha = loss.learning_rates[other]
                shaping = shaping + alpha * _dot(own[other], [c.detach() for c in cross])
                if lookahead:
                    looking = looking + alpha * _dot(cross, [g.detach() for g in own[other]])
            terms[agent] = {"shaping": grad(shaping, agent), "lookahead": grad(looking, agent) if lookahead else None}
        return terms
    for leader in loss._trained():  # SPG
        total = joint_losses.new_zeros(())
        for follower in [name for name in loss.followers(leader) if loss.parameters_of[name]]:
            if follower not in own:
                own[follower] = grad(joint_losses[index[follower]], follower, create_graph=True)
            params = loss.parameters_of[follower]
            hvp = lambda flat: _flat(grad(_dot(own[follower], _unflat(flat, params)), follower)).detach()  # noqa: E731
            b = _flat(grad(joint_losses[index[leader]], follower)).detach()
            if loss.ihvp_method == "cg":
                x, _ = conjugate_gradient(hvp, b, loss.ihvp_iterations, loss.ihvp_damping)
            else:
                x, _ = low_rank_inverse(hvp, b, loss.ihvp_rank, loss.ihvp_damping)
            total = total + _dot(own[follower], _unflat(x, params))
        if total.requires_grad:
            terms[leader] = {"correction": [-c for c in grad(total, leader)]}
    return terms


@pytest.mark.parametrize(
    "trainer, overrides, agents",
    [
        ("pola", (), "mlp"),
        ("lola", ("trainer.objective.lookahead_term=true",), "mlp"),
        ("pspg", (), "mlp"),
        ("spg", ("trainer.objective.ihvp_method=low_rank",), "mlp"),
        ("pola", (), "lm"),
        ("pspg", (), "lm"),
    ],
)
def test_the_factored_second_order_terms_equal_double_backward_passes(tmp_path, monkeypatch, trainer, overrides, agents):
    # Hidden bits' per-agent MLPs (three-step episodes in which the agents act at different steps) and tiny language
    # models; after one update, so that the ratios are not 1. The losses factor every cross-agent second derivative
    # through the log-ratios.
    options = (f"trainer={trainer}", "trainer.optimizer.lr=0.01", *overrides)
    if agents == "lm":
        from tests.test_duplicates_scenario import lm_smoke_config

        config = lm_smoke_config(tmp_path, *options)
    else:
        config = smoke_config(*options)
    trainer_object = build_trainer(config, tmp_path / "run")
    trainer_object.train_iteration()
    loss = trainer_object.loss_module
    seen = {}
    corrections = loss._corrections

    def recording(joint_losses, own_losses, log_ratio):
        seen["joint"], seen["log_ratio"] = joint_losses, log_ratio
        seen["corrections"] = corrections(joint_losses, own_losses, log_ratio)[0]
        return seen["corrections"]

    monkeypatch.setattr(loss, "_corrections", lambda *args: (recording(*args), {}))
    loss(trainer_object.buffer.sample())
    expected = _double_backward_terms(loss, seen["joint"])
    assert expected
    for agent, terms in expected.items():
        if "correction" in terms:
            found = {"correction": seen["corrections"][agent]}
        else:
            shaping, looking = loss._shaping_terms(seen["joint"], seen["log_ratio"], terms["lookahead"] is not None)
            found = {"shaping": shaping[agent], "lookahead": looking.get(agent)}
        for term, vector in terms.items():
            if vector is not None:
                assert _flat(vector).norm() > 0, (agent, term)
                torch.testing.assert_close(_flat(found[term]), _flat(vector), rtol=1e-4, atol=1e-8, msg=f"{agent} {term}")


def test_minibatches_cover_every_episode_in_every_epoch():
    from tensordict import TensorDict

    from nip_like.trainers.update import CoveringSampler, covering, fill_buffer, minibatches_per_epoch

    for size, count in [(268, 2), (269, 2), (255, 2), (100, 1), (320, 3), (330, 3), (1, 1)]:
        data = TensorDict({"item": torch.arange(size)}, [size])
        buffer = covering(fill_buffer(None, data, 128, torch.device("cpu")))
        assert isinstance(buffer.sampler, CoveringSampler) and minibatches_per_epoch(buffer) == count
        for _ in range(3):  # epochs: each a permutation of every item, in minibatches one item apart at most
            drawn = [buffer.sample().get("item") for _ in range(count)]
            assert sorted(torch.cat(drawn).tolist()) == list(range(size))
            assert max(len(d) for d in drawn) - min(len(d) for d in drawn) <= 1
        assert covering(buffer) is buffer
    # Without covering: whole minibatches of 128, the rest left out of each epoch.
    plain = fill_buffer(None, TensorDict({"item": torch.arange(268)}, [268]), 128, torch.device("cpu"))
    assert minibatches_per_epoch(plain) == 2 and len(plain.sample().get("item")) == 128


@pytest.mark.parametrize("cover", [True, False])
def test_truncated_episodes_and_the_frames_used_are_counted(tmp_path, cover):
    # Hidden bits' episodes take 3 steps; 8 steps per environment leave 2 of the first batch's steps in an episode
    # that ends in the next batch (and 1 of each later batch's steps in one that started in the batch before).
    def run(truncated: bool) -> list[dict[str, float]]:
        trainer_object = build_trainer(
            smoke_config(
                "trainer=pola",
                "trainer.frames_per_batch=128",
                f"trainer.objective.truncated_episodes={str(truncated).lower()}",
                f"trainer.objective.cover_episodes={str(cover).lower()}",
            ),
            tmp_path / str(truncated),
        )
        found = []
        for _ in range(2):
            found.append(trainer_object.train_iteration())
            trainer_object.state.iteration += 1
        return found

    complete, truncated = run(False), run(True)
    assert [m["train/frames_laid_out"] for m in complete] == [0.75, 0.75]
    assert [m["train/frames_laid_out"] for m in truncated] == [1.0, 0.875]
    assert [m["train/episodes"] for m in truncated] == [48, 48]  # 32 complete and 16 cut by the batch's end
    for metrics in complete + truncated:
        used, laid_out = metrics["train/frames_used"], metrics["train/frames_laid_out"]
        if cover or metrics["train/episodes"] == 32:  # every episode in every epoch (32 episodes: one whole minibatch)
            assert used == pytest.approx(laid_out)
        else:  # one minibatch of 32 of the 48 episodes
            assert 0 < used < laid_out


def test_the_critic_is_fitted_on_the_valid_steps_as_on_the_padded_ones(tmp_path):
    from nip_like.objectives.learning_aware import VALID_KEY
    from nip_like.objectives.masking import per_agent_mean

    trainer_object = build_trainer(
        smoke_config("trainer=pola", "trainer.frames_per_batch=128", "trainer.objective.truncated_episodes=true"), tmp_path
    )
    trainer_object.train_iteration()
    loss = trainer_object.loss_module
    batch = trainer_object.buffer.sample()
    assert not batch.get(VALID_KEY).all()  # episodes cut by the batch's end are padded
    with torch.no_grad():
        found = loss(batch).get(("agents", "prover", "loss_critic"))
        value = loss.critic_network(batch.select(*loss.critic_network.in_keys).clone(False)).get(keys.VALUE_KEY)
        squared = (value - batch.get(keys.VALUE_TARGET_KEY)).pow(2).squeeze(-1)
        expected = per_agent_mean(squared, batch.get(VALID_KEY).unsqueeze(-1).expand_as(squared))
    torch.testing.assert_close(found, expected[0])


def test_agents_sharing_parameters_are_refused():
    from nip_like.agent_modules import PerAgent
    from nip_like.objectives.learning_aware import actor_parameters

    shared = torch.nn.Linear(2, 2)
    actor = torch.nn.Sequential(PerAgent({"prover": shared, "verifier": shared}))
    with pytest.raises(ValueError, match="agents prover and verifier share parameters"):
        actor_parameters(actor, ("prover", "verifier"))
