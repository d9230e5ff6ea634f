"""What ``run.test_run=true`` shrinks, in one table: a config small enough to smoke-test in under a minute.

A test run (``run.test_run=true``) runs every loop of a config once: one
training iteration, one evaluation, one test batch, a one-epoch warm start.
It should also be quick, so :func:`shrink` rewrites the config before the
trainer is built (:func:`nip_like.experiment.build_trainer`): each entry of
:data:`RULES` names one option and what a test run keeps of it. A rule only
ever lowers a value, and skips an option the config does not have (another
loop's, another scenario's), so that any scenario, preset or trainer goes
through the same table. What each rule keeps:

================================================  ===============================================
option                                            in a test run
================================================  ===============================================
``trainer.num_envs``                              at most 4, a multiple of ``group_size`` x ranks
``trainer.frames_per_batch``                      the new ``num_envs`` x the steps of one episode (at most)
``trainer.minibatch_size``                        at most the new ``frames_per_batch`` (one minibatch)
``trainer.num_epochs``                            1
``trainer.eval.num_episodes``                     8 (what the evaluation plays in a test run)
``trainer.num_test_episodes``                     one test batch of 8 (a multiple of ``test_rollouts``)
``trainer.test_batch_episodes``                   the same
``trainer.pretrain.epochs``                       1, and no ``agent_epochs``
``trainer.pretrain.restarts``                     1, and no ``agent_restarts``
text trainers' ``trainer.num_iterations``         2: the first fine-tunes, the second samples from it
``trainer.episodes``                              8
``trainer.test_episodes``                         8 (a multiple of ``test_rollouts``)
``trainer.warm_start_episodes``                   at most 16 (0 stays 0)
``trainer.warm_start_epochs``                     1
``trainer.fine_tune.epochs``                      1
``scenario.num_lists``                            at most 200 lists (duplicates)
``scenario.num_pairs``                            at most 100 graph pairs (graph isomorphism)
``scenario.num_problems``                         at most 10 problems (code validation's family)
``scenario.tests_per_problem``                    at most 4 hidden tests a program
``scenario.max_images``                           at most 200 images (0, all of them, included)
``max_new_tokens`` of every language model        at most 16 tokens a reply (the stress test's target too;
                                                  not the RL agents' with a warm start: scripted replies fit)
``scenario.response_tokens``                      at most 16 (the stress test's responses read back)
================================================  ===============================================

The RL trainers run one iteration in a test run whatever
``trainer.num_iterations`` says, and the evaluation and the test loop play 8
episodes (:mod:`nip_like.trainers.evaluation`); the rules above say the same
of the config, so that what a test run logs as its config is what it ran.
The run id and the run folder's ``config.yaml`` stay those of the config as
given: a test run of a config is that config's, and resuming it shrinks the
same way again. Generated data a test run reads (fewer lists, pairs or
problems) are cached under their own keys; a test run's warm start is never
cached (:mod:`nip_like.warm_start`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf, open_dict

from nip_like import distributed
from nip_like.errors import ConfigError
from nip_like.validation import build_protocol

__all__ = ["RULES", "Rule", "shrink"]

#: Environments a test run steps side by side (before rounding to a multiple of the group size times the ranks).
TEST_ENVS = 4
#: Episodes a test run's evaluation and test batch play (as :mod:`nip_like.trainers.evaluation` does in a test run).
TEST_EPISODES = 8
#: Longest reply of a language model in a test run, in tokens.
TEST_REPLY_TOKENS = 16


def _multiple_at_most(limit: int, unit: int) -> int:
    """The largest multiple of ``unit`` at most ``limit``, but at least ``unit``."""
    return max(unit, limit // unit * unit)


def _num_envs(value: int, given: DictConfig) -> int:
    unit = int(given.trainer.get("group_size", 1)) * distributed.current().world_size
    return min(value, _multiple_at_most(TEST_ENVS, unit))


def _episode_steps(given: DictConfig) -> int | None:
    """The most steps an episode of ``given``'s protocol takes (its rounds); None when the protocol cannot be built.

    A protocol that cannot be built is left to the config's checks, which report it with every other problem.
    """
    try:
        return int(build_protocol(given).num_rounds)
    except (ConfigError, TypeError, ValueError):
        return None


def _frames_per_batch(value: int, given: DictConfig) -> int:
    steps = max(1, value // int(given.trainer.num_envs))  # each environment's steps
    rounds = _episode_steps(given)
    if rounds is not None:  # one whole episode in each environment is enough
        steps = min(steps, rounds)
    return _num_envs(int(given.trainer.num_envs), given) * steps


def _reply_tokens(value: int, given: DictConfig) -> int:
    """At most :data:`TEST_REPLY_TOKENS`, unless a warm start fits the agents to scripted replies (as long as they are)."""
    if OmegaConf.select(given, "trainer.pretrain.agents", default=None):
        return value
    return min(value, TEST_REPLY_TOKENS)


def _minibatch_size(value: int, given: DictConfig) -> int:
    return min(value, _frames_per_batch(int(given.trainer.frames_per_batch), given))


def _episodes_in_rollouts(value: int, given: DictConfig) -> int:
    rollouts = int(given.trainer.get("test_rollouts", 1))
    return min(value, rollouts * max(1, TEST_EPISODES // rollouts))


@dataclass(frozen=True)
class Rule:
    """One option a test run shrinks.

    Parameters
    ----------
    key : str
        The option's dotted key; ``*`` stands for every entry of a mapping
        (``scenario.agents.*.max_new_tokens``).
    value : callable
        ``value(current, given) -> new``: the option's value in a test run,
        from its current value and the whole config as given. The new value
        is taken only when it is lower.
    loop : str or None
        ``"rl"`` or ``"text"``: the rule applies only to that trainer loop
        (the RL loop has ``trainer.frames_per_batch``, the text loop
        ``trainer.episodes``); ``None``: to both.
    """

    key: str
    value: Callable[[Any, DictConfig], Any]
    loop: str | None = None


def _at_most(limit: int) -> Callable[[Any, DictConfig], int]:
    return lambda value, given: min(int(value), limit)


def _nonzero_at_most(limit: int) -> Callable[[Any, DictConfig], int]:
    """At most ``limit``, where 0 (all of them) counts as more than any limit."""
    return lambda value, given: limit if int(value) == 0 else min(int(value), limit)


#: The table of :func:`shrink` (see the module docstring for what each keeps).
RULES: tuple[Rule, ...] = (
    # the RL loop
    Rule("trainer.num_envs", _num_envs, "rl"),
    Rule("trainer.frames_per_batch", _frames_per_batch, "rl"),
    Rule("trainer.minibatch_size", _minibatch_size, "rl"),
    Rule("trainer.num_epochs", _at_most(1), "rl"),
    Rule("trainer.eval.num_episodes", _at_most(TEST_EPISODES), "rl"),
    Rule("trainer.num_test_episodes", _episodes_in_rollouts, "rl"),
    Rule("trainer.test_batch_episodes", _episodes_in_rollouts, "rl"),
    Rule("trainer.pretrain.epochs", _at_most(1), "rl"),
    Rule("trainer.pretrain.agent_epochs", lambda value, given: {}, "rl"),
    Rule("trainer.pretrain.restarts", _at_most(1), "rl"),
    Rule("trainer.pretrain.agent_restarts", lambda value, given: {}, "rl"),
    # the text trainers' loop of stages
    Rule("trainer.num_iterations", _at_most(2), "text"),
    Rule("trainer.episodes", _at_most(TEST_EPISODES), "text"),
    Rule("trainer.test_episodes", _episodes_in_rollouts, "text"),
    Rule("trainer.warm_start_episodes", _at_most(2 * TEST_EPISODES), "text"),
    Rule("trainer.warm_start_epochs", _at_most(1), "text"),
    Rule("trainer.fine_tune.epochs", _at_most(1), "text"),
    # the data a scenario generates
    Rule("scenario.num_lists", _at_most(200)),
    Rule("scenario.num_pairs", _at_most(100)),
    Rule("scenario.num_problems", _at_most(10)),
    Rule("scenario.tests_per_problem", _at_most(4)),
    Rule("scenario.max_images", _nonzero_at_most(200)),
    # language models' replies (the RL trainers' LM agents, the text trainers' models)
    Rule("scenario.default_agent.max_new_tokens", _reply_tokens),
    Rule("scenario.agents.*.max_new_tokens", _reply_tokens),
    Rule("scenario.default_model.max_new_tokens", _at_most(TEST_REPLY_TOKENS)),
    Rule("scenario.models.*.max_new_tokens", _at_most(TEST_REPLY_TOKENS)),
    Rule("scenario.target.max_new_tokens", _at_most(TEST_REPLY_TOKENS)),
    Rule("scenario.response_tokens", _at_most(TEST_REPLY_TOKENS)),
)


def _loop(config: DictConfig) -> str:
    """``"text"`` for the text trainers' loop, ``"rl"`` for the RL loop's."""
    return "text" if "episodes" in config.trainer else "rl"


def _keys(config: DictConfig, key: str) -> list[str]:
    """The dotted keys ``key`` names in ``config`` (``*`` expanded over a mapping's entries), those present only."""
    head, star, tail = key.partition(".*.")
    if not star:
        return [key] if OmegaConf.select(config, key, default=None) is not None else []
    mapping = OmegaConf.select(config, head, default=None)
    if not isinstance(mapping, DictConfig):
        return []
    return [
        f"{head}.{name}.{tail}"
        for name in mapping
        if isinstance(mapping[name], DictConfig) and OmegaConf.select(config, f"{head}.{name}.{tail}", default=None) is not None
    ]


def _lower(new: Any, current: Any) -> bool:
    """Whether ``new`` is smaller than ``current`` (a mapping: has fewer entries)."""
    if isinstance(current, DictConfig):
        return len(new) < len(current)
    return new < current


def shrink(config: DictConfig) -> DictConfig:
    """Return the config a test run runs: ``config`` itself unless ``run.test_run``, else a copy shrunk by :data:`RULES`.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config (not changed).

    Returns
    -------
    DictConfig
        ``config``, or its shrunk copy.
    """
    if not OmegaConf.select(config, "run.test_run", default=False):
        return config
    small = copy.deepcopy(config)
    loop = _loop(config)
    with open_dict(small):
        for rule in RULES:
            if rule.loop not in (None, loop):
                continue
            for key in _keys(config, rule.key):
                current = OmegaConf.select(config, key)
                new = rule.value(current, config)
                if _lower(new, current):
                    OmegaConf.update(small, key, new, merge=False)
    return small
