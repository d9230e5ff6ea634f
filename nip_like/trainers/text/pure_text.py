"""PureTextRlTrainer: staged, resumable training of text agents through fine-tune jobs.

The third trainer base, beside :class:`~nip_like.trainers.base.Trainer`'s
tensor subclasses. Its agents are text models reached through an interface
(:mod:`nip_like.text.interface`), trained by fine-tune jobs
(:mod:`nip_like.text.jobs`), not by gradient steps in this process. Each
iteration runs five stages::

    sample_rollouts -> log_stats -> test (by test_scheme) -> create_fine_tune_jobs -> await_fine_tune_jobs

The last iteration stops after its test (nothing would use its fine-tunes),
and the run ends with the final test of the last models (reused if the scheme
already tested them). After every stage the experiment state
(:mod:`~nip_like.trainers.text.state`) is written atomically to
``checkpoints/last.pt`` and, readable, ``checkpoints/state.json``; a resumed
run starts at the stage where the last one stopped, reuses the iteration's
saved rollouts (``rollouts/iteration_<i>.jsonl``, also the readable
transcripts) and adopts jobs that finished, or are still running, under their
stable ids. A failed job stops the run with its error and log path, and
resuming retries the job stage with the same rollouts.

The loop (:meth:`PureTextRlTrainer._run_stages`) and each stage read top to
bottom here; each stage's work is in a sibling module: sampling
(:mod:`~nip_like.trainers.text.sampling`), tests
(:mod:`~nip_like.trainers.text.evaluation`), fine-tune jobs
(:mod:`~nip_like.trainers.text.fine_tune_jobs`), the state
(:mod:`~nip_like.trainers.text.state`).

A subclass writes one method, :meth:`PureTextRlTrainer._stage_create_fine_tune_jobs`:
from the iteration's rollouts, the fine-tune jobs to run, at most one per model
group (agents that share a model form a group).
"""

from __future__ import annotations

import json
import os
import time
from abc import abstractmethod
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from nip_like.checkpoint import derive_seed, file_sha256, write_text_atomic
from nip_like.config import TextTrainerConfig
from nip_like.lm.templated_folders import templated_folder
from nip_like.lm.models import agent_option, source_folder
from nip_like.scenarios.chat import ChatGame
from nip_like.text.fine_tune import FineTuneSpec
from nip_like.text.interface import Sampling, TextModel
from nip_like.text.jobs import FineTuneBackend, SubmititFineTuneBackend, check_executor
from nip_like.text.models import build_text_model, create_model_folder
from nip_like.text.remote import BASE_URL_ENV, check_text_model_server
from nip_like.text.rollouts import play_episodes, rollout_records
from nip_like.text.tokenizer import build_chat_tokenizer
from nip_like.trainers.base import IterationContext, Trainer, attach_progress_bar
from nip_like.trainers.text import evaluation, fine_tune_jobs, sampling
from nip_like.trainers.text.fine_tune_jobs import sft_record
from nip_like.trainers.text.state import STAGES, GroupState, TextTrainState, stages_done, total_stages, write_readable_state

__all__ = ["PureTextRlTrainer", "STAGES", "sft_record"]


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
    loop_schema = TextTrainerConfig

    def __init__(self, config, scenario: ChatGame, run_dir, logger) -> None:
        super().__init__(config, scenario, run_dir, logger)
        #: The loop's options (``trainer``: :class:`~nip_like.config.TextTrainerConfig`).
        self.loop = config.trainer
        #: The algorithm's own options (``trainer.objective``: the schema the trainer is registered with).
        self.options = config.trainer.get("objective")
        self.num_iterations = int(config.trainer.num_iterations)
        self.seed = int(config.seed)
        self.device = str(config.run.device)
        self.test_episodes = int(self.loop.test_episodes)
        self.jobs = config.trainer.jobs
        self.backend: FineTuneBackend = SubmititFineTuneBackend(self.run_dir / "fine_tune", self.jobs)
        self.state = TextTrainState(groups={group: GroupState(model="") for group in scenario.group_names()})
        if int(self.loop.warm_start_episodes) == 0:
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
        check_executor(config.trainer.jobs)
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

    @classmethod
    def validate(cls, config, scenario) -> list[str]:
        """``trainer.test_rollouts`` above 1 needs sampled tests (``test_greedy: false``) and ``test_episodes`` a multiple of it."""
        loop = config.trainer
        rollouts = int(loop.get("test_rollouts", 1))  # a run folder from before the option has none: 1
        if rollouts == 1:
            return []
        problems = []
        if bool(loop.test_greedy):
            problems.append(
                f"trainer.test_rollouts ({rollouts}) plays each test datapoint several times, which greedy decoding "
                "repeats word for word; set trainer.test_greedy=false with it"
            )
        if int(loop.test_episodes) % rollouts:
            problems.append(
                f"trainer.test_episodes ({loop.test_episodes}) must be a multiple of trainer.test_rollouts ({rollouts})"
            )
        return problems

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

    # ------------------------------------------------------------- the run
    def train(self) -> dict[str, float]:
        """Run the stages from where the state says, then the final test; the test metrics."""
        for group in self.scenario.group_names():
            if not self.state.groups[group].model:
                self.state.groups[group].model = self._initial_model(group)
        self._run_stages()
        return self.final_metrics

    @attach_progress_bar(lambda self: total_stages(int(self.config.trainer.num_iterations)))
    def _run_stages(self, iteration_context: IterationContext) -> None:
        """Run the stages from :attr:`state`'s, saving the state after each; the final test ends the run."""
        iteration_context.set_description("Text training")
        while True:
            stage = self.state.stage
            iteration_context.set_postfix(iteration=self.state.iteration, stage=stage)
            started = time.perf_counter()
            if stage == "warm_start":
                self._warm_start()
                self.state.advance(STAGES[0], self.num_iterations)
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
                self.state.advance(next_stage, self.num_iterations)
            self.state.train_seconds += time.perf_counter() - started
            self.save_checkpoint("last")
            iteration_context.step(max(1, stages_done(self.state, self.num_iterations) - iteration_context.bar.n))
            self.stop_if_requested(self.state.iteration, checkpointed=True)

    # -------------------------------------------------------------- stages
    # Each returns the next stage ("next_iteration" to start the next iteration).
    def _stage_sample_rollouts_run(self) -> str:
        path = sampling.rollouts_path(self.run_dir, self.state.iteration)
        if path.is_file():  # written before a crash or stop, the state not yet saved: reused once its header checks out
            sampling.read_rollouts(path)
            self.state.rollouts_sha256 = file_sha256(path)
        else:
            self._sample(path)
        return "log_stats"

    def _sample(self, path: Path) -> None:
        """Play the iteration's train episodes with the groups' current models; save them and their digest."""
        models = {group: self.model(group) for group in self.scenario.group_names()}
        self.state.rollouts_sha256 = sampling.sample_rollouts(
            self.scenario,
            models,
            self.sampling(),
            int(self.loop.episodes),
            derive_seed(self.seed, f"rollouts:{self.state.iteration}"),
            path,
            branching=self.branching,
        )

    def _stage_log_stats_run(self) -> str:
        rollouts = self.rollouts()
        metrics = self.rollout_metrics(rollouts)
        self.state.frames += sampling.sampled_frames(rollouts)
        metrics["frames"] = self.state.frames
        self.logger.log({f"train/{name}": value for name, value in metrics.items()}, step=self.state.iteration)
        return "test"

    def _stage_test_run(self) -> str:
        if evaluation.tests_now(str(self.loop.test_scheme), self.state.iteration, self.num_iterations):
            self._saved_test(self.state.iteration)
        return "create_fine_tune_jobs" if self.state.iteration < self.num_iterations - 1 else "next_iteration"

    def _stage_create_fine_tune_jobs_run(self) -> str:
        self._submit(self._stage_create_fine_tune_jobs(self.rollouts()))
        return "await_fine_tune_jobs"

    def _stage_await_fine_tune_jobs_run(self) -> str:
        self._await_jobs()
        return "next_iteration"

    def _warm_start(self) -> None:
        """SFT every group on honest play (``warm_start_episodes`` demonstrations), before the first iteration."""
        names = self.scenario.agent_names
        demonstrations = play_episodes(
            self.scenario,
            {agent: self.scenario.scripted_player(agent) for agent in names},
            {agent: Sampling(1) for agent in names},
            "train",
            int(self.loop.warm_start_episodes),
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
                epochs=int(self.loop.warm_start_epochs),
                lr=float(self.loop.warm_start_lr),
            )
            for group, rows in records.items()
            if rows
        }
        self._submit(specs)
        self._await_jobs()

    def _final_test(self) -> dict[str, float]:
        """The last models' test (the last iteration's, if the scheme ran it), as ``test/...``."""
        metrics = {f"test/{name}": value for name, value in self._saved_test(self.num_iterations - 1).items()}
        self.logger.log(metrics, step=self.num_iterations)
        return metrics

    def _saved_test(self, iteration: int) -> dict[str, float]:
        """Iteration ``iteration``'s test: played once with the current models, logged as ``eval/...``, saved."""
        return evaluation.run_test(
            evaluation.test_path(self.run_dir, iteration),
            self.play_test,
            lambda metrics: self.logger.log({f"eval/{name}": value for name, value in metrics.items()}, step=self.state.iteration),
            self.scenario.agent_names,
            self.scenario.protocol.num_rounds,
        )

    def _submit(self, specs: dict[str, FineTuneSpec]) -> None:
        # Scripted players are never fine-tuned.
        specs = {group: spec for group, spec in specs.items() if not (group in self.state.groups and not self.trainable(group))}
        fine_tune_jobs.submit_jobs(self.backend, self.state.groups, specs)

    def _await_jobs(self) -> None:
        """Wait for the groups' jobs; switch each group to its new model, or stop at the first failure."""
        timeout = self.loop.fine_tune.timeout
        failed = fine_tune_jobs.await_jobs(self.backend, self.state.groups, None if timeout is None else float(timeout))
        if failed:
            # Back to the job stage: resuming retries the jobs on the same rollouts.
            self.state.stage = "warm_start" if self.state.stage == "warm_start" else "create_fine_tune_jobs"
            self.save_checkpoint("last")
            raise fine_tune_jobs.failure(*failed[0])

    def _initial_model(self, group: str) -> str:
        """``group``'s starting model: the configured folder, or a tiny model built from config in the run folder."""
        config = self.scenario.model_config(group)
        if config.backend == "scripted":
            self.scenario.scripted_model(group)  # checks that the group has one role
            return "scripted"
        if config.path is not None:
            where = f"{self.scenario.model_config_path(group)}.path"
            folder = source_folder(config.path, where)  # a .gguf file: its converted folder
            template = agent_option(config, "chat_template")
            if template:
                folder = templated_folder(folder, template, self.run_dir / "models" / group / "initial", where)
            return str(folder)
        folder = self.run_dir / "models" / group / "initial"
        if not (folder / "config.json").is_file():
            create_model_folder(config, folder, build_chat_tokenizer())
        return str(folder)

    # ------------------------------------------------------------- testing
    def test(self) -> dict[str, float]:
        """Test the current models on :attr:`test_split`, as every test of the run does; the ``test/...`` metrics.

        Plays :attr:`test_episodes` episodes (:meth:`play_test`) and writes
        their transcripts to ``transcripts/test.jsonl``. The run's own tests
        are its test stages; ``python -m nip_like.evaluate`` calls this on a
        run's saved state.
        """
        self.scenario.split(self.test_split)  # refuses an unknown split in one line
        rollouts = self.play_test()
        records = rollout_records(rollouts, self.scenario.agent_names)
        if records:
            write_text_atomic("".join(json.dumps(record) + "\n" for record in records), self.run_dir / "transcripts" / "test.jsonl")
        return {f"test/{key}": value for key, value in self.rollout_metrics(rollouts).items()}

    def play_test(self, split: str | None = None, episodes: int | None = None) -> TensorDict:
        """Play ``split`` (:attr:`test_split` by default) with the current models, as every test does.

        :attr:`test_episodes` episodes (or ``episodes``), decoded greedily with
        ``test_greedy``, with the same seed every time: the same lists, and
        with local models the same replies. With ``trainer.test_rollouts``
        ``k`` each list is played ``k`` times side by side (consecutive
        episodes), so that ``test/always_wrong`` counts the lists the
        verifier decides wrong every time.
        """
        models = {group: self.model(group) for group in self.scenario.group_names()}
        return play_episodes(
            self.scenario,
            models,
            self.sampling(greedy=bool(self.loop.test_greedy)),
            self.test_split if split is None else split,
            int(self.test_episodes if episodes is None else episodes),
            derive_seed(self.seed, "test"),
            group_size=int(self.loop.get("test_rollouts", 1)),
        )

    # ------------------------------------------------- helpers for the hook
    def job_name(self, group: str, iteration: int | None = None) -> str:
        """``group``'s job at ``iteration`` (the current one by default) within the run: ``it0003-verifier``.

        The warm start's job is ``warm-<group>``. The name places the job's
        model folder and derives its seed.
        """
        iteration = self.state.iteration if iteration is None else iteration
        return fine_tune_jobs.job_name(group, iteration, warm_start=self.state.stage == "warm_start")

    def job_id(self, group: str, iteration: int | None = None) -> str:
        """The stable id of ``group``'s job at ``iteration``: the run id, then :meth:`job_name`."""
        return f"{self.run_id}-{self.job_name(group, iteration)}"

    def job_spec(
        self, group: str, method: str, dataset: Path, epochs: int | None = None, lr: float | None = None
    ) -> FineTuneSpec:
        """A job that fine-tunes ``group``'s current model on ``dataset`` with ``method`` (sft or dpo).

        ``epochs`` and ``lr`` default to ``trainer.fine_tune``'s.
        """
        options = self.loop.fine_tune
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
            num_threads=fine_tune_jobs.job_threads(self.jobs, self.config.run.num_threads, len(self.state.groups)),
        )

    def write_dataset(self, name: str, records: list[dict]) -> Path:
        """Write fine-tune records (JSONL) to ``datasets/<name>.jsonl``, atomically."""
        return fine_tune_jobs.write_dataset(self.run_dir, name, records)

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
        """How each group samples (its model config's settings; ``greedy``: temperature 0)."""
        return {
            group: Sampling.from_config(self.scenario.model_config(group), greedy=greedy)
            for group in self.scenario.group_names()
        }

    def rollouts(self) -> TensorDict:
        """The current iteration's rollouts, read from its saved file and checked against the digest in the state.

        A file deleted after a :class:`~nip_like.errors.CheckpointError` about it
        is sampled again, with the same models and seed as the first time.
        """
        path = sampling.rollouts_path(self.run_dir, self.state.iteration)
        if not path.is_file():
            print(f"{path} is missing: sampling iteration {self.state.iteration}'s rollouts again with the same models and seed")
            self._sample(path)
        return sampling.read_rollouts(path, self.state.rollouts_sha256)

    def rollout_metrics(self, rollouts: TensorDict) -> dict[str, float]:
        """Decision metrics, each agent's mean episode return (``reward``), reply length and share of replies that did something."""
        return sampling.rollout_metrics(rollouts, self.scenario.agent_names)

    def turns_by_agent(self, rollouts: TensorDict) -> list[dict]:
        """Every turn of the rollouts as a record: episode, round, agent, group, chat, reply, move, reward, the
        agent's episode return and the label."""
        return sampling.turns_by_agent(rollouts, self.scenario.agent_names, self.scenario.groups())

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"text_state": self.state.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = TextTrainState.from_dict(state["text_state"])
        self.progress_initial = {"_run_stages": stages_done(self.state, self.num_iterations)}

    def save_checkpoint(self, name: str = "last") -> Path:
        path = super().save_checkpoint(name)
        write_readable_state(self.state, self.checkpoint_dir)
        return path
