"""The global structured-config schemas, registered in Hydra's ConfigStore.

This module holds only what is global: the experiment, the trainers' loops (RL and text), the
optimiser, evaluation, pretraining, loggers and run settings. Each component
(objective, protocol, scenario, agent kind) declares its own schema in the
module that defines it, and the registries (:mod:`nip_like.registry`) store
those in the ConfigStore. Every field has a type, a default and a one-line
comment; the schema's default is the value in effect unless a preset or an
override says otherwise. The YAML files under ``nip_like/configs/`` select
the components and adjust the defaults. Fields fall in two kinds:

* hyper-parameters (``seed``, ``trainer``, ``scenario``, ``protocol``) change
  results and identify a run (see :func:`run_id`);
* run settings (``run``, ``logger``) do not change results: device, loggers,
  output folder, progress bars, test-run mode, checkpoint frequency, where
  the caches live (``run.fresh_cache``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from nip_like.allowed import Allowed, checked
from nip_like.registry import REGISTRIES
from nip_like.optimizers import LR_SCHEDULES, OPTIMIZERS
from nip_like.text.fine_tune_options import FineTuneOptions
from nip_like.text.jobs import JobsConfig

#: The Hydra config folder, shipped inside the package (``nip_like/configs/``; the
#: repository's top-level ``configs`` is a link to it), so that an installed wheel runs.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"

#: Top-level keys whose values change results and so identify a run.
HYPER_PARAMETER_KEYS = ("seed", "trainer", "scenario", "protocol")

#: Field names, at any depth of the hyper-parameter sections, that say where
#: things are kept or run, not what they are: caches are keyed by their contents, so
#: moving one changes no result (``scenario.cache_dir``, ``trainer.pretrain.cache_dir``),
#: and a fine-tune job trains the same on any executor (``trainer.jobs``).
LOCATION_KEYS = ("cache_dir", "jobs")


@dataclass
class OptimizerConfig:
    """Optimiser, learning-rate schedule and gradient handling."""

    name: str = checked("adam", choices=tuple(OPTIMIZERS))  # adam | adamw | sgd | rmsprop | adagrad
    lr: float = checked(1e-3, gt=0)  # learning rate of every agent without an entry in agent_lr
    agent_lr: dict[str, float] = checked(factory=dict, each=Allowed(gt=0))  # per-agent learning rates, by agent name
    weight_decay: float = checked(0.0, ge=0)  # L2 penalty (decoupled for adamw)
    momentum: float = checked(0.0, ge=0, lt=1)  # momentum for sgd and rmsprop
    betas: list[float] = checked(factory=lambda: [0.9, 0.999], length=2, each=Allowed(ge=0, lt=1))  # Adam/AdamW betas
    eps: float = checked(1e-8, gt=0)  # numerical epsilon of adaptive optimisers
    max_grad_norm: Optional[float] = checked(1.0, gt=0)  # clip each agent's gradient norm to this; null disables
    grad_accumulation_steps: Optional[int] = checked(None, ge=1)  # minibatches whose gradients are summed before one optimiser step; null = one per rank (1 in one process, N under torchrun)
    lr_schedule: str = checked("constant", choices=LR_SCHEDULES)  # constant | linear | cosine, over the training iterations
    lr_final_factor: float = checked(0.0, ge=0, le=1)  # linear/cosine: final lr as a fraction of the initial lr
    warmup_iterations: int = checked(0, ge=0)  # iterations of linear warm-up from 0 before the schedule


@dataclass
class AgentUpdateConfig:
    """When one agent is trained; on other iterations its parameters stay fixed."""

    start: int = checked(0, ge=0)  # first iteration (0-based) on which the agent is trained
    stop: Optional[int] = checked(None, ge=1)  # iteration from which it is no longer trained; null = never stops
    every: int = checked(1, ge=1)  # train on every k-th iteration counted from start


@dataclass
class PretrainConfig:
    """Supervised pretraining of agents on the labels before RL (scenarios with labelled data)."""

    agents: list[str] = field(default_factory=list)  # agents first fitted to the labels or demonstrations; "*" = every agent that has some
    epochs: int = checked(10, ge=1)  # passes over the train split
    agent_epochs: dict[str, int] = checked(factory=dict, each=Allowed(ge=1))  # per-agent passes, overriding epochs: {prover: 12}
    agent_lr: dict[str, float] = checked(factory=dict, each=Allowed(gt=0))  # per-agent learning rates, overriding lr: {verifier: 0.0005}
    lr: float = checked(0.001, gt=0)  # Adam learning rate of the pretraining
    minibatch_size: int = checked(64, ge=1)  # datapoints per pretraining minibatch
    warmup_steps: int = checked(0, ge=0)  # linear learning-rate warm-up over this many optimiser steps; 0 = none
    max_grad_norm: Optional[float] = checked(None, gt=0)  # clip each step's gradient norm to this; null = no clipping
    keep_best: bool = False  # after each epoch score the agent on the validation split; keep the best epoch's weights
    restarts: int = checked(1, ge=1)  # fit each agent this many times from fresh weights; keep the best fit (held-out accuracy with keep_best, else train accuracy)
    agent_restarts: dict[str, int] = checked(factory=dict, each=Allowed(ge=1))  # per-agent restarts, overriding restarts: {verifier: 3}
    cache_dir: str = "~/.cache/nip_like/pretrained"  # where pretrained agents are cached, keyed by what determines them


@dataclass
class EvalConfig:
    """Periodic evaluation during training, best checkpoint and early stopping."""

    every: int = checked(10, ge=0)  # evaluate every N iterations (and after the last); 0 disables
    num_episodes: int = checked(256, ge=1)  # episodes per evaluation
    deterministic: bool = True  # take the most likely action instead of sampling
    metric: str = "eval/reward"  # metric that picks the best checkpoint
    mode: str = checked("max", choices=("max", "min"))  # max | min: whether a larger or smaller metric is better
    early_stopping_patience: int = checked(0, ge=0)  # stop after this many evaluations without improvement; 0 disables
    transcripts: int = checked(16, ge=0)  # dialogues written to transcripts/ per evaluation and for the test (scenarios whose agents talk)
    test_checkpoint: str = checked("final", choices=("final", "best"))  # final | best: which agents the test loop evaluates


#: How an opponent pool picks the snapshot an episode meets.
POOL_DRAWS = ("latest", "uniform", "win_rate")


@dataclass
class OpponentPoolConfig:
    """Earlier versions of one agent, played instead of the agent itself in some training episodes (nip_like.trainers.opponent_pool)."""

    agent: Optional[str] = None  # the agent whose snapshots form the pool (a language-model agent); null = no pool
    size: int = checked(4, ge=1)  # snapshots kept; the oldest leaves first (the initial weights are the first)
    every: int = checked(1, ge=1)  # a snapshot of the agent enters the pool after every this many iterations' updates
    draw: str = checked("uniform", choices=POOL_DRAWS)  # latest | uniform | win_rate (the snapshots the learner beats least, drawn most)
    per: str = checked("episode", choices=("episode", "iteration"))  # draw a snapshot for each new episode, or one for all episodes an iteration starts
    live_fraction: float = checked(0.8, ge=0, le=1)  # share of draws in which the agent plays itself, live (it trains on those episodes only)
    learner: Optional[str] = None  # the agent whose score against each snapshot is kept (win 1, tie 0.5, by episode return); null = the first other agent


@dataclass
class TrainerConfig:
    """The trainer and its RL loop."""

    trainer_type: str = "ppo"  # registered trainer name, or dotted path module.Class
    objective: Any = None  # the objective's options (the schema the trainer is registered with; group trainer/objective)
    num_iterations: int = checked(40, ge=1)  # collect-then-optimise iterations
    num_envs: int = checked(64, ge=1)  # parallel environments in the vectorised train env
    frames_per_batch: int = checked(1536, ge=1)  # environment steps per iteration (a multiple of num_envs)
    num_epochs: int = checked(4, ge=1)  # passes over each collected batch
    group_size: int = checked(1, ge=1)  # episodes played on the same datapoint, side by side (grouped rollouts; num_envs must be a multiple)
    minibatch_size: int = checked(256, ge=1)  # items per minibatch (transitions, pairs or groups, as the loss lays them out)
    num_test_episodes: int = checked(1024, ge=1)  # episodes in the final test loop
    test_batch_episodes: int = checked(256, ge=1)  # episodes per test-loop iteration
    test_rollouts: int = checked(1, ge=1)  # episodes of each test datapoint, side by side: test/always_wrong is the share of datapoints the verifier decides wrong in every one (num_test_episodes and test_batch_episodes must be multiples)
    divergence_bound: Optional[float] = checked(1e6, gt=0)  # stop when the loss or a parameter exceeds this in magnitude; null disables (non-finite losses always stop)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # optimiser settings
    agent_updates: dict[str, Any] = field(default_factory=dict)  # per-agent AgentUpdateConfig entries: +trainer.agent_updates.prover={start:10}
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)  # supervised pretraining before RL
    opponent_pool: OpponentPoolConfig = field(default_factory=OpponentPoolConfig)  # play an agent's earlier versions in some training episodes
    eval: EvalConfig = field(default_factory=EvalConfig)  # evaluation, best checkpoint, early stopping
    extra: dict[str, Any] = field(default_factory=dict)  # free-form options for user-defined trainers
    jobs: JobsConfig = field(default_factory=JobsConfig)  # not read by the RL trainers (the text trainers' fine-tune jobs); kept so that earlier run folders resume; a run setting, not in the run id


#: When the text trainers' test stage runs.
TEST_SCHEMES = ("none", "all", "last", "first_and_last")


@dataclass
class TextTrainerConfig:
    """The text trainers and their loop of stages (``trainer=expert_iteration``, ``trainer=malt``).

    The RL loop's fields (``num_envs``, ``frames_per_batch``, ``optimizer``,
    ...) are not here: a text trainer does not read them, and they are refused.
    """

    trainer_type: str = "expert_iteration"  # registered text trainer name, or dotted path module.Class
    objective: Any = None  # the algorithm's own options (the schema the trainer is registered with; group trainer/objective)
    num_iterations: int = checked(4, ge=1)  # iterations of the stages (sample, test, fine-tune)
    episodes: int = checked(256, ge=1)  # episodes sampled per iteration (train split)
    test_scheme: str = checked("last", choices=TEST_SCHEMES)  # iterations that run the test stage
    test_episodes: int = checked(512, ge=1)  # episodes of a test (test split, same lists every time)
    test_greedy: bool = True  # tests decode greedily (temperature 0)
    test_rollouts: int = checked(1, ge=1)  # episodes of each test datapoint, side by side: test/always_wrong is the share of datapoints the verifier decides wrong in every one (above 1: test_greedy false, test_episodes a multiple)
    warm_start_episodes: int = checked(0, ge=0)  # honest-play demonstrations for an SFT job before the first iteration; 0 = none
    warm_start_epochs: int = checked(2, ge=1)  # passes of the warm start's SFT
    warm_start_lr: float = checked(1e-3, gt=0)  # learning rate of the warm start's SFT
    fine_tune: FineTuneOptions = field(default_factory=FineTuneOptions)  # how the jobs train
    jobs: JobsConfig = field(default_factory=JobsConfig)  # where the fine-tune jobs run (submitit: local | slurm); a run setting, not in the run id
    extra: dict[str, Any] = field(default_factory=dict)  # free-form options for user-defined trainers


@dataclass
class LoggerConfig:
    """Where metrics go (a run setting: does not change results)."""

    backends: list[str] = field(default_factory=lambda: ["csv"])  # any of csv, tensorboard, wandb, mlflow
    wandb_project: str = "nip_like"  # W&B project name
    wandb_mode: str = checked("offline", choices=("offline", "online", "disabled"))  # W&B mode: offline | online | disabled
    mlflow_tracking_uri: Optional[str] = None  # MLflow URI; null = a folder inside the run folder
    print_metrics: bool = True  # print the final test metrics to standard output
    diagnostics_every: int = checked(1, ge=0)  # measure objective/kl and objective/entropy every N iterations; 0 = never
    log_every: int = checked(10, ge=0)  # write a summary line to the job log every N iterations (to the console too when it has no progress bar); 0 = never


@dataclass
class RunSettings:
    """Settings that do not change results and do not identify a run."""

    device: str = "cpu"  # torch device: cpu, cuda, cuda:1, ...
    test_run: bool = False  # run every loop for a single iteration (smoke test of a config)
    progress_bar: bool = True  # show tqdm progress bars
    checkpoint_every: int = checked(10, ge=0)  # save the whole state every N iterations (and at the end); 0 = only at the end
    num_threads: Optional[int] = checked(None, ge=1)  # torch CPU threads; null leaves torch's default
    autocast_dtype: Optional[str] = checked(None, choices=(None, "bfloat16", "float16"))  # run loops under torch.autocast with this dtype (bfloat16, float16); null = off
    memory_limit_gib: Optional[float] = checked(None, gt=0)  # memory the run may use on its device (GiB), for the LM memory preflight and automatic token budgets; null = what the device has free
    fsdp: bool = False  # under torchrun, shard each LM agent's weights, gradients and optimiser state over the ranks (FSDP2's fully_shard)
    fresh_cache: bool = False  # build every cache the run uses (datasets, warm starts, model conversions) afresh in <run folder>/cache/, not reading or writing the shared ones (cache_dir fields, ~/.cache/nip_like); for cold-start timings and isolated reproductions


#: The trainers' loop schemas: the RL loop's and the text trainers'. A trainer class names its own
#: (:attr:`nip_like.trainers.base.Trainer.loop_schema`).
LOOP_SCHEMAS = (TrainerConfig, TextTrainerConfig)


@dataclass
class ExperimentConfig:
    """The whole experiment: hyper-parameters and run settings."""

    name: str = "experiment"  # a label for the run folder
    seed: int = checked(0, ge=0)  # seed of every random number generator
    trainer: Any = MISSING  # the trainer and its loop: TrainerConfig (the RL trainers) or TextTrainerConfig (the text trainers)
    scenario: Any = MISSING  # a scenario schema (config group "scenario")
    protocol: Any = MISSING  # a protocol schema (config group "protocol")
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # metric loggers (run setting)
    run: RunSettings = field(default_factory=RunSettings)  # run settings


@functools.cache
def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (once per process; later calls do nothing).

    The global schemas go in as ``experiment_schema``, ``trainer/trainer_schema``
    and ``logger/logger_schema``; every registry stores its components'
    schemas (``protocol/nip_schema``, ``scenario/hidden_bits_schema``,
    ``trainer/objective/ppo``, ...; see :meth:`nip_like.registry.Registry.store_configs`),
    and a component registered later (a user's module) is stored when it
    registers. The YAML files under ``nip_like/configs/`` extend these nodes
    through their defaults lists, so every value they set is type-checked.
    """
    store = ConfigStore.instance()
    store.store(name="experiment_schema", node=ExperimentConfig)
    store.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    store.store(group="trainer", name="text_trainer_schema", node=TextTrainerConfig)
    store.store(group="logger", name="logger_schema", node=LoggerConfig)
    for registry in REGISTRIES.values():
        registry.store_configs()


def hyper_parameters(config: DictConfig) -> dict[str, Any]:
    """Return the part of ``config`` that changes results, as plain containers.

    That is the sections of :data:`HYPER_PARAMETER_KEYS` without the fields of
    :data:`LOCATION_KEYS`, at any depth.
    """
    resolved = OmegaConf.to_container(config, resolve=True)
    return {key: without_locations(resolved[key]) for key in HYPER_PARAMETER_KEYS}


def without_entries(value: Any, drop: Callable[[str, Any], bool]) -> Any:
    """``value`` (plain containers) with every mapping entry ``key: item`` for which ``drop(key, item)`` left out, recursively."""
    if isinstance(value, dict):
        return {key: without_entries(item, drop) for key, item in value.items() if not drop(key, item)}
    if isinstance(value, list):
        return [without_entries(item, drop) for item in value]
    return value


def without_locations(value: Any) -> Any:
    """``value`` (plain containers) with every mapping's :data:`LOCATION_KEYS` entries left out, recursively.

    For anything keyed by what determines results: the run id, the cache key
    of a pretrained agent. The :data:`NEUTRAL_ENTRIES` at their neutral
    values are left out too, and the :data:`CHANGED_DEFAULTS` at their new
    default are written as the old one.
    """
    return _with_old_defaults(without_entries(value, lambda key, item: key in LOCATION_KEYS or _neutral(key, item)))


#: Options added after runs were keyed, at the value that behaves as before they existed: left out of run ids and
#: warm-start keys at that value, so that adding them changed no key (an LM agent's ``sampler`` of kind ``local``,
#: ``trainer.pretrain.agent_restarts`` empty, ``trainer.test_rollouts`` 1, an LM agent's ``decoding`` auto and
#: ``sampling_dtype`` model). Set otherwise, they are hyper-parameters like any other.
NEUTRAL_ENTRIES: dict[str, Callable[[Any], bool]] = {
    "sampler": lambda item: isinstance(item, dict) and item.get("kind") == "local",
    "agent_restarts": lambda item: item == {},
    "test_rollouts": lambda item: item == 1,
    "decoding": lambda item: item == "auto",
    "sampling_dtype": lambda item: item == "model",
}


#: Defaults changed after runs were keyed, to a value that runs as the old one did in one process: keyed as the old
#: value, so that the change changed no key (``trainer.optimizer.grad_accumulation_steps`` null, one minibatch per
#: rank and optimiser step, is 1 in one process). Old value of each, from the new one.
CHANGED_DEFAULTS: dict[str, Callable[[Any], Any]] = {
    "grad_accumulation_steps": lambda item: 1 if item is None else item,
}


def _with_old_defaults(value: Any) -> Any:
    """``value`` (plain containers) with every :data:`CHANGED_DEFAULTS` entry at its new default written as the old one."""
    if isinstance(value, dict):
        return {key: CHANGED_DEFAULTS.get(key, _with_old_defaults)(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_old_defaults(item) for item in value]
    return value


def _neutral(key: str, item: Any) -> bool:
    """Whether ``key: item`` is one of :data:`NEUTRAL_ENTRIES` at its neutral value."""
    test = NEUTRAL_ENTRIES.get(key)
    return test is not None and test(item)


def run_id(config: DictConfig) -> str:
    """Return a short stable hash of the hyper-parameters of ``config``.

    Two configs that differ only in run settings (device, loggers, output
    folder, test-run mode) or in where caches live (:data:`LOCATION_KEYS`)
    share a run id.
    """
    text = json.dumps(hyper_parameters(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
