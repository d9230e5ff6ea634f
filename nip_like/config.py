"""Structured-config schemas, registered in Hydra's ConfigStore.

Every field has a type, a default and a one-line comment. The YAML files under
``configs/`` select and adjust these schemas. Fields fall in two kinds:

* hyper-parameters (``seed``, ``trainer``, ``scenario``, ``protocol``) change
  results and identify a run (see :func:`run_id`);
* run settings (``run``, ``logger``) do not change results: device, loggers,
  output folder, progress bars, test-run mode, checkpoint frequency.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from nip_like.errors import ConfigError

#: Top-level keys whose values change results and so identify a run.
HYPER_PARAMETER_KEYS = ("seed", "trainer", "scenario", "protocol")


@dataclass
class OptimizerConfig:
    """Optimiser, learning-rate schedule and gradient handling."""

    name: str = "adam"  # adam | adamw | sgd | rmsprop | adagrad
    lr: float = 3e-4  # learning rate of every agent without an entry in agent_lr
    agent_lr: dict[str, float] = field(default_factory=dict)  # per-agent learning rates, by agent name
    weight_decay: float = 0.0  # L2 penalty (decoupled for adamw)
    momentum: float = 0.0  # momentum for sgd and rmsprop
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam/AdamW betas
    eps: float = 1e-8  # numerical epsilon of adaptive optimisers
    max_grad_norm: Optional[float] = 1.0  # clip each agent's gradient norm to this; null disables
    grad_accumulation_steps: int = 1  # minibatches whose gradients are summed before one optimiser step
    lr_schedule: str = "constant"  # constant | linear | cosine, over the training iterations
    lr_final_factor: float = 0.0  # linear/cosine: final lr as a fraction of the initial lr
    warmup_iterations: int = 0  # iterations of linear warm-up from 0 before the schedule


@dataclass
class AgentUpdateConfig:
    """When one agent is trained; on other iterations its parameters stay fixed."""

    start: int = 0  # first iteration (0-based) on which the agent is trained
    stop: Optional[int] = None  # iteration from which it is no longer trained; null = never stops
    every: int = 1  # train on every k-th iteration counted from start


@dataclass
class PPOConfig:
    """Options of the PPO objective."""

    variant: str = "clip"  # clip (clipped surrogate) | kl (adaptive KL penalty)
    clip_epsilon: float = 0.2  # clip range of the probability ratio (clip variant)
    kl_beta: float = 1.0  # initial KL-penalty coefficient (kl variant)
    kl_target: float = 0.01  # target KL per update; beta adapts towards it (kl variant)
    kl_adaptive: bool = True  # adapt beta after each minibatch (kl variant)
    normalize_advantage: bool = True  # standardise advantages per agent over its active steps
    loss_critic_type: str = "smooth_l1"  # l1 | l2 | smooth_l1


@dataclass
class GRPOConfig:
    """Options of the GRPO objective."""

    clip_epsilon: float = 0.2  # clip range of the probability ratio
    kl_coeff: float = 0.0  # weight of the KL(pi || initial policy) penalty; 0 disables it


@dataclass
class ReinforceConfig:
    """Options of the REINFORCE objective."""

    baseline: bool = True  # subtract a learned value baseline (the agents' value networks)
    normalize_advantage: bool = True  # standardise advantages per agent over its active steps


@dataclass
class DPOConfig:
    """Options of the preference objectives (DPO, IPO, hinge) on episode pairs."""

    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge
    beta: float = 0.3  # inverse temperature (sigmoid, hinge) or regularisation strength (ipo)
    margin: float = 0.0  # drop pairs whose return gap is below this (a zero gap is always dropped)
    length_normalize: bool = False  # mean instead of summed log-probs over the agent's steps
    label_smoothing: float = 0.0  # assumed preference-flip probability, conservative DPO (sigmoid only)
    ref_sync_every: int = 0  # move the reference towards the policy every N iterations; 0 keeps the initial policy
    ref_mixup_alpha: float = 1.0  # weight of the policy in that move: 1 copies it, below 1 is an EMA step


@dataclass
class SoloAgentConfig:
    """Options of the supervised solo-agent trainer."""

    agent: str = "verifier"  # the agent trained on the labels


@dataclass
class PretrainConfig:
    """Supervised pretraining of agents on the labels before RL (scenarios with labelled data)."""

    agents: list[str] = field(default_factory=list)  # agents whose policy networks are first fitted to the labels
    epochs: int = 10  # passes over the train split
    lr: float = 0.001  # Adam learning rate of the pretraining
    minibatch_size: int = 64  # datapoints per pretraining minibatch
    cache_dir: str = "~/.cache/nip_like/pretrained"  # where pretrained agents are cached, keyed by what determines them


@dataclass
class EvalConfig:
    """Periodic evaluation during training, best checkpoint and early stopping."""

    every: int = 10  # evaluate every N iterations (and after the last); 0 disables
    num_episodes: int = 256  # episodes per evaluation
    deterministic: bool = True  # take the most likely action instead of sampling
    metric: str = "eval/reward"  # metric that picks the best checkpoint
    mode: str = "max"  # max | min: whether a larger or smaller metric is better
    early_stopping_patience: int = 0  # stop after this many evaluations without improvement; 0 disables
    test_checkpoint: str = "final"  # final | best: which agents the test loop evaluates


@dataclass
class TrainerConfig:
    """The trainer and its RL loop."""

    trainer_type: str = "ppo"  # registered trainer name, or dotted path module.Class
    num_iterations: int = 100  # collect-then-optimise iterations
    num_envs: int = 64  # parallel environments in the vectorised train env
    frames_per_batch: int = 1024  # environment steps per iteration (a multiple of num_envs)
    num_epochs: int = 4  # passes over each collected batch
    group_size: int = 1  # episodes played on the same datapoint, side by side (grouped rollouts; num_envs must be a multiple)
    minibatch_size: int = 256  # items per minibatch (transitions, pairs or groups, as the loss lays them out)
    gamma: float = 0.99  # discount factor
    lmbda: float = 0.95  # GAE lambda
    entropy_coeff: float = 0.01  # weight of the entropy bonus
    critic_coeff: float = 0.5  # weight of the value loss
    num_test_episodes: int = 1024  # episodes in the final test loop
    test_batch_episodes: int = 256  # episodes per test-loop iteration
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # optimiser settings
    agent_updates: dict[str, Any] = field(default_factory=dict)  # per-agent AgentUpdateConfig entries: +trainer.agent_updates.prover={start:10}
    ppo: PPOConfig = field(default_factory=PPOConfig)  # PPO options
    grpo: GRPOConfig = field(default_factory=GRPOConfig)  # GRPO options
    reinforce: ReinforceConfig = field(default_factory=ReinforceConfig)  # REINFORCE options
    dpo: DPOConfig = field(default_factory=DPOConfig)  # DPO / IPO / hinge options
    solo_agent: SoloAgentConfig = field(default_factory=SoloAgentConfig)  # supervised solo-agent options
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)  # supervised pretraining before RL
    eval: EvalConfig = field(default_factory=EvalConfig)  # evaluation, best checkpoint, early stopping
    extra: dict[str, Any] = field(default_factory=dict)  # free-form options for user-defined trainers


@dataclass
class ScenarioConfig:
    """Base of the scenario schemas; ``name`` selects the registered scenario."""

    name: str = MISSING  # registered scenario name, or dotted path module.Class


@dataclass
class AgentNetConfig:
    """Size of one agent's networks."""

    hidden_size: int = 64  # width of each hidden layer
    num_layers: int = 2  # hidden layers in the policy and value networks


@dataclass
class HiddenBitsConfig(ScenarioConfig):
    """The built-in hidden-bits scenario (see :mod:`nip_like.scenarios.hidden_bits`)."""

    name: str = "hidden_bits"  # scenario name
    num_bits: int = 2  # length of the hidden bit string the verifier must output
    message_vocab: int = 4  # number of distinct messages a prover can send per round
    agents: dict[str, Any] = field(default_factory=dict)  # per-agent AgentNetConfig entries; others use default_agent
    default_agent: AgentNetConfig = field(default_factory=AgentNetConfig)  # network size of agents not in agents


@dataclass
class GraphAgentConfig:
    """Size of one graph-isomorphism agent's networks."""

    hidden_size: int = 32  # width of the node embeddings
    gin_layers: int = 2  # rounds of GIN message passing
    gin_mlp_size: int = 0  # hidden width of each GIN layer's two-layer MLP; 0 means hidden_size
    attention_heads: int = 2  # heads of the cross-graph transformer layer; 0 leaves the layer out
    transformer_mlp_size: int = 0  # hidden width of the transformer's feed-forward block; 0 means 4 * hidden_size
    message_encoding: str = "exchanges"  # node inputs: "exchanges" (a query and its answers share a channel) or "steps"
    shared_body: bool = False  # the policy and value heads share one body


@dataclass
class GraphIsomorphismConfig(ScenarioConfig):
    """The graph-isomorphism scenario (see :mod:`nip_like.scenarios.graph_isomorphism`)."""

    name: str = "graph_isomorphism"  # scenario name
    num_pairs: int = 2000  # graph pairs in the dataset, before the splits
    dataset_seed: int = 0  # seed of the dataset generator (the run's seed does not change the data)
    min_nodes: int = 7  # fewest nodes of a graph
    max_nodes: int = 11  # most nodes of a graph
    edge_probabilities: list[float] = field(default_factory=lambda: [0.2, 0.4, 0.6, 0.8])  # Erdos-Renyi edge probabilities
    wl_fractions: list[float] = field(default_factory=lambda: [0.1, 0.2, 0.7])  # non-isomorphic pairs told apart by 1-WL in 1, 2, >2 rounds
    val_fraction: float = 0.1  # share of pairs in the validation split (periodic evaluation)
    test_fraction: float = 0.2  # share of pairs in the held-out test split
    cache_dir: str = "~/.cache/nip_like/datasets"  # where generated datasets are cached
    prover_answers_other_graph: bool = True  # a prover's node must lie in the graph the verifier's last node is not in
    agents: dict[str, Any] = field(default_factory=dict)  # per-agent GraphAgentConfig entries; others use default_agent
    default_agent: GraphAgentConfig = field(default_factory=GraphAgentConfig)  # network size of agents not in agents


@dataclass
class ProtocolConfig:
    """Base of the protocol schemas; ``name`` selects the registered protocol."""

    name: str = MISSING  # registered protocol name, or dotted path module.Class


@dataclass
class ProverVerifierConfig(ProtocolConfig):
    """A prover sends messages for some rounds, then the verifier decides."""

    name: str = "prover_verifier"  # protocol name
    message_rounds: int = 2  # rounds in which the prover speaks before the verifier decides
    shared_reward: bool = True  # the prover is rewarded when the verifier is right (cooperative)


@dataclass
class ProofProtocolConfig(ProtocolConfig):
    """Turns, decisions and rewards of the interactive-proof protocols (nip, adp, debate, mnip, ...)."""

    name: str = "nip"  # protocol name
    min_rounds: int = 1  # the verifier may decide from this step on (1-based)
    max_rounds: int = 8  # the verifier must decide on its last turn within this many steps
    first_speaker: str = "verifier"  # verifier | prover: who opens (nip, debate, mnip)
    shared_reward: bool = False  # every agent gets the verifier's reward (cooperative)
    verifier_reward: float = 1.0  # the verifier's reward for a correct decision
    verifier_incorrect_penalty: float = 0.0  # subtracted from the verifier's reward for a wrong decision
    verifier_continue_reward: float = 0.0  # the verifier's reward for each turn it lets pass (small; negative = a cost)
    prover_reward: float = 1.0  # a prover's reward when the verifier decides its side


@dataclass
class SoloVerifierConfig(ProofProtocolConfig):
    """No prover: the verifier decides at once. A baseline."""

    name: str = "solo_verifier"  # protocol name
    max_rounds: int = 1  # one step: the decision


@dataclass
class LoggerConfig:
    """Where metrics go (a run setting: does not change results)."""

    backends: list[str] = field(default_factory=lambda: ["csv"])  # any of csv, tensorboard, wandb, mlflow
    wandb_project: str = "nip_like"  # W&B project name
    wandb_mode: str = "offline"  # W&B mode: offline | online | disabled
    mlflow_tracking_uri: Optional[str] = None  # MLflow URI; null = a folder inside the run folder
    print_metrics: bool = True  # print the final test metrics to standard output
    diagnostics_every: int = 1  # measure objective/kl and objective/entropy every N iterations; 0 = never


@dataclass
class RunSettings:
    """Settings that do not change results and do not identify a run."""

    device: str = "cpu"  # torch device: cpu, cuda, cuda:1, ...
    test_run: bool = False  # run every loop for a single iteration (smoke test of a config)
    progress_bar: bool = True  # show tqdm progress bars
    checkpoint_every: int = 10  # save the whole state every N iterations (and at the end); 0 = only at the end
    num_threads: Optional[int] = None  # torch CPU threads; null leaves torch's default
    autocast_dtype: Optional[str] = None  # run loops under torch.autocast with this dtype (bfloat16, float16); null = off


@dataclass
class ExperimentConfig:
    """The whole experiment: hyper-parameters and run settings."""

    name: str = "experiment"  # a label for the run folder
    seed: int = 0  # seed of every random number generator
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the trainer and its loop
    scenario: Any = MISSING  # a scenario schema (config group "scenario")
    protocol: Any = MISSING  # a protocol schema (config group "protocol")
    logger: LoggerConfig = field(default_factory=LoggerConfig)  # metric loggers (run setting)
    run: RunSettings = field(default_factory=RunSettings)  # run settings


#: Schema of each built-in scenario and protocol, for the unknown-key check.
SCENARIO_SCHEMAS: dict[str, type] = {"hidden_bits": HiddenBitsConfig, "graph_isomorphism": GraphIsomorphismConfig}
PROTOCOL_SCHEMAS: dict[str, type] = {
    "prover_verifier": ProverVerifierConfig,
    "solo_verifier": SoloVerifierConfig,
    **{name: ProofProtocolConfig for name in ("nip", "adp", "debate", "mnip", "merlin_arthur")},
}


def _unknown_keys(node: Any, schema: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(schema)
    unknown = []
    for key in node.keys():
        if key not in hints:
            unknown.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(hints[key]) and isinstance(node[key], DictConfig):
            unknown += _unknown_keys(node[key], hints[key], f"{prefix}{key}.")
    return unknown


def check_known_keys(config: DictConfig) -> None:
    """Fail on keys that no schema declares (Hydra's ``+key=value`` adds them silently).

    Parameters
    ----------
    config : DictConfig
        The whole experiment config. Scenario and protocol sections are checked
        against their schemas when they are built in; free-form dicts
        (``trainer.extra``, ``trainer.agent_updates``, ...) are not checked here.

    Raises
    ------
    ConfigError
        Naming the unknown keys.
    """
    unknown = _unknown_keys(config, ExperimentConfig, "")
    for section, schemas in (("scenario", SCENARIO_SCHEMAS), ("protocol", PROTOCOL_SCHEMAS)):
        schema = schemas.get(config[section].get("name"))
        if schema is not None:
            unknown += _unknown_keys(config[section], schema, f"{section}.")
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}; check the spelling (see docs: configuration)")


def typed_entry(schema: type, value: Any, where: str) -> DictConfig:
    """Check a free-form config entry against a dataclass schema.

    Hydra cannot add an entry to a dict of dataclasses from the command line,
    so such dicts are typed ``dict[str, Any]`` and their entries are checked
    here, with a one-line error naming the field.
    """
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), value)
    except Exception as error:  # OmegaConf raises several error types
        first = str(error).splitlines()[0]
        raise ConfigError(f"{where}: {first}") from error


@functools.cache
def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (once per process; later calls do nothing).

    The YAML files under ``configs/`` extend these nodes through their defaults
    lists (``- hidden_bits_schema``), so every value they set is type-checked.
    """
    store = ConfigStore.instance()
    store.store(name="experiment_schema", node=ExperimentConfig)
    store.store(group="scenario", name="hidden_bits_schema", node=HiddenBitsConfig)
    store.store(group="scenario", name="graph_isomorphism_schema", node=GraphIsomorphismConfig)
    store.store(group="protocol", name="prover_verifier_schema", node=ProverVerifierConfig)
    store.store(group="protocol", name="solo_verifier_schema", node=SoloVerifierConfig)
    store.store(group="protocol", name="proof_schema", node=ProofProtocolConfig)
    store.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    store.store(group="logger", name="logger_schema", node=LoggerConfig)


def hyper_parameters(config: DictConfig) -> dict[str, Any]:
    """Return the part of ``config`` that changes results, as plain containers."""
    return {key: OmegaConf.to_container(config, resolve=True)[key] for key in HYPER_PARAMETER_KEYS}


def run_id(config: DictConfig) -> str:
    """Return a short stable hash of the hyper-parameters of ``config``.

    Two configs that differ only in run settings (device, loggers, output
    folder, test-run mode) share a run id.
    """
    text = json.dumps(hyper_parameters(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
