"""PureTextRlTrainer: staged, resumable training of text agents through fine-tune jobs.

The third trainer base, beside :class:`~nip_like.trainers.base.Trainer`'s
tensor subclasses. Its agents are text models reached through an interface
(:mod:`nip_like.text.models`), trained by fine-tune jobs
(:mod:`nip_like.text.jobs`), not by gradient steps in this process. Each
iteration runs five stages::

    sample_rollouts -> log_stats -> test (by test_scheme) -> create_fine_tune_jobs -> await_fine_tune_jobs

The last iteration stops after its test (nothing would use its fine-tunes),
and the run ends with the final test of the last models (reused if the scheme
already tested them). After every stage the experiment state (iteration, next
stage, each model group's current model, job id and job status) is written
atomically to ``checkpoints/last.pt`` and, readable, ``checkpoints/state.json``;
a resumed run starts at the stage where the last one stopped, reuses the
iteration's saved rollouts (``rollouts/iteration_<i>.jsonl``, also the
readable transcripts) and adopts jobs that finished, or are still running,
under their stable ids. A failed job stops the run with its error and log
path, and resuming retries the job stage with the same rollouts.

A subclass writes one method, :meth:`PureTextRlTrainer._stage_create_fine_tune_jobs`:
from the iteration's rollouts, the fine-tune jobs to run, at most one per model
group (agents that share a model form a group).
"""

from __future__ import annotations

import json
import os
import time
from abc import abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from tensordict import TensorDict

from nip_like.allowed import checked
from nip_like.checkpoint import derive_seed, write_text_atomic
from nip_like.errors import ConfigError, FineTuneError
from nip_like.scenarios.chat import ChatGame
from nip_like.scenarios.decisions import decision_metrics
from nip_like.text.fine_tune import FineTuneSpec
from nip_like.text.jobs import FineTuneBackend, JobsConfig, SubmititFineTuneBackend, check_executor
from nip_like.text.models import Sampling, TextModel, build_text_model, create_model_folder
from nip_like.text.remote import BASE_URL_ENV, check_text_model_server
from nip_like.text.rollouts import load_rollouts, play_episodes, rollout_records, save_rollouts
from nip_like.text.tokenizer import build_chat_tokenizer
from nip_like.trainers.base import IterationContext, Trainer, attach_progress_bar

#: The stages of an iteration, in order.
STAGES = ("sample_rollouts", "log_stats", "test", "create_fine_tune_jobs", "await_fine_tune_jobs")
#: When the test stage runs.
TEST_SCHEMES = ("none", "all", "last", "first_and_last")


@dataclass
class FineTuneOptions:
    """How each fine-tune job trains (:func:`~nip_like.text.worker.run_job`; where it runs is ``trainer.jobs``)."""

    epochs: int = checked(2, ge=1)  # passes over the job's dataset
    lr: float = checked(3e-4, gt=0)  # AdamW learning rate
    batch_size: int = checked(32, ge=1)  # examples per optimiser step
    max_grad_norm: Optional[float] = checked(1.0, gt=0)  # gradient clipping; null = none
    beta: float = checked(0.1, gt=0)  # DPO: inverse temperature (IPO: regularisation)
    loss_type: str = checked("sigmoid", choices=("sigmoid", "ipo", "hinge"))  # DPO loss
    rpo_alpha: Optional[float] = checked(None, ge=0)  # DPO: weight of the chosen replies' token NLL added to the loss (TRL's rpo_alpha); null = none
    timeout: Optional[float] = checked(None, gt=0)  # seconds to wait for a job; null = no limit


@dataclass
class TextTrainingConfig:
    """Options shared by the text trainers (``trainer.objective``)."""

    episodes: int = checked(256, ge=1)  # episodes sampled per iteration (train split)
    test_scheme: str = checked("last", choices=TEST_SCHEMES)  # iterations that run the test stage
    test_episodes: int = checked(512, ge=1)  # episodes of a test (test split, same lists every time)
    test_greedy: bool = True  # tests decode greedily (temperature 0)
    warm_start_episodes: int = checked(0, ge=0)  # honest-play demonstrations for an SFT job before the first iteration; 0 = none
    warm_start_epochs: int = checked(2, ge=1)  # passes of the warm start's SFT
    warm_start_lr: float = checked(1e-3, gt=0)  # learning rate of the warm start's SFT
    fine_tune: FineTuneOptions = field(default_factory=FineTuneOptions)  # the jobs' training settings


@dataclass
class GroupState:
    """A model group's current model and its latest fine-tune job."""

    model: str  # folder (or served name) of the current model
    job_id: Optional[str] = None
    job_status: Optional[str] = None  # pending | running | succeeded | failed


@dataclass
class TextTrainState:
    """The experiment state, written after every stage."""

    iteration: int = 0  # the iteration in progress
    stage: str = "warm_start"  # the next stage to run: warm_start, one of STAGES, or final_test
    groups: dict[str, GroupState] = field(default_factory=dict)
    frames: int = 0  # environment steps sampled by the iterations so far (each round of each train episode)
    iteration_seconds: float = 0.0  # wall time of the current iteration's stages so far
    train_seconds: float = 0.0  # wall time in the stages, over all sessions

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> "TextTrainState":
        groups = {name: GroupState(**group) for name, group in state["groups"].items()}
        return cls(**{**state, "groups": groups})


class PureTextRlTrainer(Trainer):
    """Staged training of text agents through fine-tune jobs (see the module docstring).

    A subclass that samples trees instead of episodes sets :attr:`branching`.

    Parameters
    ----------
    config, scenario, run_dir, logger
        As for :class:`~nip_like.trainers.base.Trainer`. The scenario is a
        chat scenario (``scenario=duplicates_chat``): it renders chats, parses
        replies and groups the agents.
    """

    requires = (ChatGame,)

    def __init__(self, config, scenario: ChatGame, run_dir, logger) -> None:
        super().__init__(config, scenario, run_dir, logger)
        self.options = config.trainer.objective
        self.num_iterations = int(config.trainer.num_iterations)
        self.seed = int(config.seed)
        self.device = str(config.run.device)
        self.jobs = config.trainer.get("jobs") or JobsConfig()  # a run folder from before trainer.jobs has none
        self.backend: FineTuneBackend = SubmititFineTuneBackend(self.run_dir / "fine_tune", self.jobs)
        self.state = TextTrainState(groups={group: GroupState(model="") for group in scenario.group_names()})
        if int(self.options.warm_start_episodes) == 0:
            self.state.stage = STAGES[0]
        self._models: dict[str, tuple[str, TextModel]] = {}
        self.final_metrics: dict[str, float] = {}

    @classmethod
    def preflight(cls, config, scenario: ChatGame) -> None:
        """Refuse, in one line, a job executor this machine lacks or a model group's server (``backend: openai``) that does not answer.

        ``trainer.jobs.executor: slurm`` needs SLURM's commands on ``PATH``
        (:func:`~nip_like.text.jobs.check_executor`).

        Each server is asked once (``GET <base_url>/models``) with the
        group's timeout and retries
        (:func:`~nip_like.text.remote.check_text_model_server`).
        """
        check_executor(config.trainer.get("jobs") or JobsConfig())
        checked_urls: set[str | None] = set()
        for group in scenario.group_names():
            model = scenario.model_config(group)
            if model.backend != "openai":
                continue
            url = model.base_url or os.environ.get(BASE_URL_ENV)
            if url in checked_urls:
                continue
            checked_urls.add(url)
            where = f"scenario.models.{group}" if group in scenario.config.models else "scenario.default_model"
            check_text_model_server(model, where)

    #: Each iteration plays every list as a tree branching this many ways per round (see
    #: :func:`~nip_like.text.rollouts.play_episodes`); 1 plays plain episodes.
    branching: int = 1

    # ------------------------------------------------------------- the hook
    @abstractmethod
    def _stage_create_fine_tune_jobs(self, rollouts: TensorDict) -> dict[str, FineTuneSpec]:
        """The fine-tune jobs of this iteration, by model group, from its rollouts.

        Write each job's dataset with :meth:`write_dataset` and make its spec
        with :meth:`job_spec`. A group left out keeps its model.
        """

    # ------------------------------------------------------------- helpers
    def job_name(self, group: str, iteration: int | None = None) -> str:
        """``group``'s job at ``iteration`` (the current one by default) within the run: ``it0003-verifier``.

        The warm start's job is ``warm-<group>``. The name places the job's
        model folder and derives its seed.
        """
        if self.state.stage == "warm_start":
            return f"warm-{group}"
        iteration = self.state.iteration if iteration is None else iteration
        return f"it{iteration:04d}-{group}"

    def job_id(self, group: str, iteration: int | None = None) -> str:
        """The stable id of ``group``'s job at ``iteration``: the run id, then :meth:`job_name`."""
        return f"{self.run_id}-{self.job_name(group, iteration)}"

    def job_spec(
        self, group: str, method: str, dataset: Path, epochs: int | None = None, lr: float | None = None
    ) -> FineTuneSpec:
        """A job that fine-tunes ``group``'s current model on ``dataset`` with ``method`` (sft or dpo).

        ``epochs`` and ``lr`` default to ``trainer.objective.fine_tune``'s.
        """
        options = self.options.fine_tune
        name = self.job_name(group)
        return FineTuneSpec(
            job_id=self.job_id(group),
            method=method,
            base_model=self.state.groups[group].model,
            dataset=str(dataset),
            output=str(self.run_dir / "models" / group / name),
            epochs=int(epochs if epochs is not None else options.epochs),
            lr=float(lr if lr is not None else options.lr),
            batch_size=int(options.batch_size),
            max_grad_norm=None if options.max_grad_norm is None else float(options.max_grad_norm),
            # From the seed and the job's place in the run only, like the rollouts': the same job of two runs
            # whose ids differ (another num_iterations, say) trains the same way.
            seed=derive_seed(self.seed, name),
            beta=float(options.beta),
            loss_type=str(options.loss_type),
            rpo_alpha=None if options.rpo_alpha is None else float(options.rpo_alpha),
            device=self.device,
            num_threads=self._job_threads(),
        )

    def _job_threads(self) -> int | None:
        """Threads per job.

        On SLURM ``trainer.jobs.cpus_per_task``, else ``run.num_threads``, else
        torch's default on the job's node; locally ``run.num_threads``, else
        this machine's cores shared among the groups' concurrent jobs.
        """
        slurm = str(self.jobs.executor) == "slurm"
        if slurm and self.jobs.cpus_per_task:
            return int(self.jobs.cpus_per_task)
        if self.config.run.num_threads:
            return int(self.config.run.num_threads)
        return None if slurm else max(1, (os.cpu_count() or 1) // len(self.state.groups))

    def write_dataset(self, name: str, records: list[dict]) -> Path:
        """Write fine-tune records (JSONL) to ``datasets/<name>.jsonl``, atomically."""
        path = self.run_dir / "datasets" / f"{name}.jsonl"
        write_text_atomic("".join(json.dumps(record) + "\n" for record in records), path)
        return path

    def trainable(self, group: str) -> bool:
        """Whether ``group``'s model is fine-tuned (a scripted player is not)."""
        return self.scenario.model_config(group).backend != "scripted"

    def model(self, group: str) -> TextModel:
        """``group``'s current model (rebuilt when its folder changes)."""
        folder = self.state.groups[group].model
        if not self.trainable(group):
            if group not in self._models:
                self._models[group] = (folder, self.scenario.scripted_model(group))
            return self._models[group][1]
        cached = self._models.get(group)
        if cached is None or cached[0] != folder:
            if cached is not None:
                cached[1].close()
            self._models[group] = (folder, build_text_model(self.scenario.model_config(group), folder, self.device))
        return self._models[group][1]

    def sampling(self, greedy: bool = False) -> dict[str, Sampling]:
        return {
            group: Sampling.from_config(self.scenario.model_config(group), greedy=greedy)
            for group in self.scenario.group_names()
        }

    def turns_by_agent(self, rollouts: TensorDict) -> list[dict]:
        """Every turn of the rollouts as a record: episode, round, agent, group, chat, reply, move, reward, the
        agent's episode return and the label."""
        groups = self.scenario.groups()
        turns = []
        for episode, record in enumerate(rollout_records(rollouts, self.scenario.agent_names)):
            for turn in record["turns"]:
                turns.append(
                    {
                        **turn,
                        "episode": episode,
                        "group": groups[turn["agent"]],
                        "return": record["returns"][turn["agent"]],
                        "label": record["label"],
                    }
                )
        return turns

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"text_state": self.state.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = TextTrainState.from_dict(state["text_state"])
        self.progress_initial = {"_run_stages": self._stages_done()}

    def save_checkpoint(self, name: str = "last") -> Path:
        path = super().save_checkpoint(name)
        write_text_atomic(json.dumps(self.state.to_dict(), indent=2) + "\n", self.checkpoint_dir / "state.json")
        return path

    def _stages_done(self) -> int:
        if self.state.stage in ("warm_start",):
            return 0
        if self.state.stage == "final_test":
            return self._total_stages() - 1
        return 1 + self.state.iteration * len(STAGES) + STAGES.index(self.state.stage)

    def _total_stages(self) -> int:
        # The warm start, every stage of every iteration, the final test.
        return 1 + self.num_iterations * len(STAGES) + 1

    # ------------------------------------------------------------- the run
    def train(self) -> dict[str, float]:
        """Run the stages from where the state says, then the final test; the test metrics."""
        for group in self.scenario.group_names():
            if not self.state.groups[group].model:
                self.state.groups[group].model = self._initial_model(group)
        self._run_stages()
        return self.final_metrics

    def _initial_model(self, group: str) -> str:
        """``group``'s starting model: the configured folder, or a tiny model built from config in the run folder."""
        config = self.scenario.model_config(group)
        if config.backend == "scripted":
            self.scenario.scripted_model(group)  # checks that the group has one role
            return "scripted"
        if config.path is not None:
            return str(Path(config.path).expanduser())
        folder = self.run_dir / "models" / group / "initial"
        if not (folder / "config.json").is_file():
            create_model_folder(config, folder, build_chat_tokenizer())
        return str(folder)

    @attach_progress_bar(lambda self: self._total_stages())
    def _run_stages(self, iteration_context: IterationContext) -> None:
        iteration_context.set_description("Text training")
        while True:
            stage = self.state.stage
            iteration_context.set_postfix(iteration=self.state.iteration, stage=stage)
            started = time.perf_counter()
            if stage == "warm_start":
                self._warm_start()
                self._advance(STAGES[0])
            elif stage == "final_test":
                self.final_metrics = self._final_test()
                self.state.train_seconds += time.perf_counter() - started
                self.save_checkpoint("last")
                iteration_context.step()
                return
            else:
                next_stage = getattr(self, f"_stage_{stage}_run")()
                seconds = time.perf_counter() - started
                self.state.iteration_seconds += seconds
                if next_stage == "next_iteration":
                    # The comparison report reads each iteration's wall time from timers/iteration.
                    self.logger.log({"timers/iteration": self.state.iteration_seconds}, step=self.state.iteration)
                    self.state.iteration_seconds = 0.0
                self._advance(next_stage)
            self.state.train_seconds += time.perf_counter() - started
            self.save_checkpoint("last")
            iteration_context.step(max(1, self._stages_done() - iteration_context.bar.n))
            self.stop_if_requested(self.state.iteration, checkpointed=True)

    def _advance(self, stage: str) -> None:
        if stage == "next_iteration":
            self.state.iteration += 1
            stage = STAGES[0] if self.state.iteration < self.num_iterations else "final_test"
        self.state.stage = stage

    # -------------------------------------------------------------- stages
    def _rollouts_path(self, iteration: int | None = None) -> Path:
        iteration = self.state.iteration if iteration is None else iteration
        return self.run_dir / "rollouts" / f"iteration_{iteration:04d}.jsonl"

    def _stage_sample_rollouts_run(self) -> str:
        path = self._rollouts_path()
        if not path.is_file():
            models = {group: self.model(group) for group in self.scenario.group_names()}
            seed = derive_seed(self.seed, f"rollouts:{self.state.iteration}")
            rollouts = play_episodes(
                self.scenario, models, self.sampling(), "train", int(self.options.episodes), seed,
                branching=self.branching,
            )
            save_rollouts(rollouts, self.scenario.agent_names, self.scenario.protocol.num_rounds, path)
        return "log_stats"

    def rollouts(self) -> TensorDict:
        """The current iteration's rollouts (read from its saved file)."""
        return load_rollouts(self._rollouts_path())

    def _stage_log_stats_run(self) -> str:
        rollouts = self.rollouts()
        metrics = self.rollout_metrics(rollouts)
        self.state.frames += int(rollouts["turns", "acted"].any(-1).sum())
        metrics["frames"] = self.state.frames
        self.logger.log({f"train/{name}": value for name, value in metrics.items()}, step=self.state.iteration)
        return "test"

    def rollout_metrics(self, rollouts: TensorDict) -> dict[str, float]:
        """Decision metrics, each agent's mean episode return (``reward``), reply length and share of replies that did something."""
        metrics = decision_metrics(rollouts["decision"], rollouts["label"], rollouts["list_index"])
        metrics["decided"] = (rollouts["decision"] >= 0).float().mean().item()
        # The reply and move strings as nested lists, (E, R, N): no chat needs reading here.
        turns = rollouts["turns"]
        acted = turns["acted"].tolist()
        replies, moves = turns.get("reply").tolist(), turns.get("move").tolist()
        for index, name in enumerate(self.scenario.agent_names):
            metrics[f"agents/{name}/reward"] = rollouts["return"][:, index].mean().item()
            own = [
                (replies[episode][step][index], moves[episode][step][index])
                for episode, rounds in enumerate(acted)
                for step, agents in enumerate(rounds)
                if agents[index]
            ]
            if own:
                metrics[f"agents/{name}/reply_chars"] = sum(len(reply) for reply, _ in own) / len(own)
                metrics[f"agents/{name}/effective_replies"] = sum(move != "none" for _, move in own) / len(own)
        return metrics

    def _tests_now(self) -> bool:
        scheme, iteration, last = str(self.options.test_scheme), self.state.iteration, self.num_iterations - 1
        return (
            scheme == "all"
            or (scheme == "last" and iteration == last)
            or (scheme == "first_and_last" and iteration in (0, last))
        )

    def _test_path(self, iteration: int) -> Path:
        return self.run_dir / "tests" / f"iteration_{iteration:04d}.json"

    def _stage_test_run(self) -> str:
        if self._tests_now():
            self._test(self._test_path(self.state.iteration))
        return "create_fine_tune_jobs" if self.state.iteration < self.num_iterations - 1 else "next_iteration"

    def play_test(self, split: str | None = None, episodes: int | None = None) -> TensorDict:
        """Play ``split`` (the test split by default) with the current models, as every test does.

        ``test_episodes`` episodes (or ``episodes``), decoded greedily with
        ``test_greedy``, with the same seed every time: the same lists, and
        with local models the same replies. ``python -m nip_like.evaluate``
        calls it on a run's saved state.
        """
        models = {group: self.model(group) for group in self.scenario.group_names()}
        return play_episodes(
            self.scenario,
            models,
            self.sampling(greedy=bool(self.options.test_greedy)),
            self.test_split if split is None else split,
            int(self.options.test_episodes if episodes is None else episodes),
            derive_seed(self.seed, "test"),
        )

    def _test(self, path: Path) -> dict[str, float]:
        """Play the test split with the current models (same lists every time); save the metrics.

        Logged as ``eval/...`` at the iteration; the final test returns them as ``test/...``.
        """
        if path.is_file():
            return json.loads(path.read_text())
        rollouts = self.play_test()
        metrics = self.rollout_metrics(rollouts)
        save_rollouts(rollouts, self.scenario.agent_names, self.scenario.protocol.num_rounds, path.with_suffix(".jsonl"))
        self.logger.log({f"eval/{name}": value for name, value in metrics.items()}, step=self.state.iteration)
        write_text_atomic(json.dumps(metrics, indent=2) + "\n", path)
        return metrics

    def _final_test(self) -> dict[str, float]:
        """The last models' test (the last iteration's, if the scheme ran it), as ``test/...``."""
        metrics = {f"test/{name}": value for name, value in self._test(self._test_path(self.num_iterations - 1)).items()}
        self.logger.log(metrics, step=self.num_iterations)
        return metrics

    def _stage_create_fine_tune_jobs_run(self) -> str:
        specs = self._stage_create_fine_tune_jobs(self.rollouts())
        self._submit(specs)
        return "await_fine_tune_jobs"

    def _submit(self, specs: dict[str, FineTuneSpec]) -> None:
        # Scripted players are never fine-tuned.
        specs = {group: spec for group, spec in specs.items() if not (group in self.state.groups and not self.trainable(group))}
        for group, spec in specs.items():
            if group not in self.state.groups:
                raise ConfigError(f"a fine-tune job for {group!r}, which is not a model group: {sorted(self.state.groups)}")
            status = self.backend.submit(spec)
            self.state.groups[group].job_id = spec.job_id
            self.state.groups[group].job_status = status.state
        # Groups without a job this iteration keep their model.
        for group in set(self.state.groups) - set(specs):
            self.state.groups[group].job_id = None
            self.state.groups[group].job_status = None

    def _stage_await_fine_tune_jobs_run(self) -> str:
        self._await_jobs()
        return "next_iteration"

    def _await_jobs(self) -> None:
        """Wait for the groups' jobs; switch each group to its new model, or stop at the first failure."""
        pending = {group: state.job_id for group, state in self.state.groups.items() if state.job_id is not None}
        timeout = self.options.fine_tune.timeout
        statuses = self.backend.wait(pending.values(), timeout=None if timeout is None else float(timeout))
        failed = [(group, statuses[job_id]) for group, job_id in pending.items() if statuses[job_id].state == "failed"]
        for group, job_id in pending.items():
            self.state.groups[group].job_status = statuses[job_id].state
        if failed:
            # Back to the job stage: resuming retries the jobs on the same rollouts.
            self.state.stage = "warm_start" if self.state.stage == "warm_start" else "create_fine_tune_jobs"
            self.save_checkpoint("last")
            group, status = failed[0]
            raise FineTuneError(f"fine-tune job {status.job_id} (group {group}) failed: {status.error}; log: {status.log}")
        for group, job_id in pending.items():
            self.state.groups[group].model = statuses[job_id].model
            self.state.groups[group].job_id = None

    def _warm_start(self) -> None:
        """SFT every group on honest play (``warm_start_episodes`` demonstrations), before the first iteration."""
        names = self.scenario.agent_names
        demonstrations = play_episodes(
            self.scenario,
            {agent: self.scenario.scripted_player(agent) for agent in names},
            {agent: Sampling(1) for agent in names},
            "train",
            int(self.options.warm_start_episodes),
            derive_seed(self.seed, "warm_start"),
            by_agent=True,
        )
        records: dict[str, list[dict]] = {group: [] for group in self.scenario.group_names()}
        for turn in self.turns_by_agent(demonstrations):
            records[turn["group"]].append(sft_record(turn))
        specs = {
            group: self.job_spec(
                group,
                "sft",
                self.write_dataset(f"warm_start_{group}", rows),
                epochs=int(self.options.warm_start_epochs),
                lr=float(self.options.warm_start_lr),
            )
            for group, rows in records.items()
            if rows
        }
        self._submit(specs)
        self._await_jobs()


def sft_record(turn: dict, reply: str | None = None) -> dict:
    """A turn as an SFT record in TRL's conversational format: the chat, then the reply as the assistant's."""
    return {"messages": [*turn["chat"], {"role": "assistant", "content": turn["reply"] if reply is None else reply}]}
