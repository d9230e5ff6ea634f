"""Trainer base classes, iteration contexts and progress bars.

``Trainer`` holds the config, the scenario and the run folder and owns
checkpointing. ``TensorDictTrainer`` adds the train and test contexts built on
an :class:`~contextlib.ExitStack`. Loops decorated with
:func:`attach_progress_bar` declare their length, so
:meth:`Trainer.get_total_num_iterations` knows the whole run's length before
anything runs.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch
from omegaconf import DictConfig
from torch import nn
from torchrl.envs.utils import ExplorationType, set_exploration_type
from tqdm.auto import tqdm

from nip_like import distributed
from nip_like.checkpoint import check_checkpoint_folders, load_checked, save_atomic
from nip_like.folders import check_writable_folder
from nip_like.config import TrainerConfig, run_id
from nip_like.errors import ConfigError, raise_problems
from nip_like.interrupts import StopRequested, stop_requested
from nip_like.logging import MetricLogger
from nip_like.scenarios.base import Scenario, TensorGame
from nip_like.trainers.checked_configs import was_checked

_PROGRESS_TOTAL = "_nip_like_progress_total"


class IterationContext:
    """Handle given to a loop decorated with :func:`attach_progress_bar`.

    Parameters
    ----------
    total : int
        Number of iterations the loop declared.
    initial : int
        Iterations already done (a resumed run starts its bar there).
    enabled : bool
        Whether to draw a tqdm bar (drawn only when standard error is a terminal).
    on_step : callable, optional
        Called with the number of iterations after each :meth:`step`, for an
        outer progress bar (a sweep's).
    """

    def __init__(
        self, total: int, initial: int = 0, enabled: bool = True, on_step: Callable[[int], None] | None = None
    ) -> None:
        self.total = total
        # disable=None: tqdm stays silent when standard error is not a terminal (a job's log file).
        self.bar = tqdm(total=total, initial=initial, disable=None if enabled else True, dynamic_ncols=True, leave=True)
        self.on_step = on_step

    def step(self, iterations: int = 1) -> None:
        """Advance the bar by ``iterations``."""
        self.bar.update(iterations)
        if self.bar.disable:  # a silent tqdm counts nothing; bar.n still tells the loop how far it got
            self.bar.n += iterations
        if self.on_step is not None:
            self.on_step(iterations)

    def set_description(self, description: str) -> None:
        """Set the text to the left of the bar."""
        self.bar.set_description(description)

    def set_postfix(self, **values: Any) -> None:
        """Show ``name=value`` pairs to the right of the bar."""
        self.bar.set_postfix(values, refresh=False)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()


def attach_progress_bar(total: Callable[[Any], int]) -> Callable:
    """Give a loop method a progress bar and declare its number of iterations.

    Parameters
    ----------
    total : callable
        ``total(trainer)`` returns how many iterations the loop runs.

    Notes
    -----
    The decorated method takes an :class:`IterationContext` as its last
    argument, which the wrapper supplies; callers omit it. The wrapper reads
    ``self._progress_initial`` (if set to a dict) for a resumed loop's starting
    point, keyed by the method's name.

    Examples
    --------
    >>> class MyTrainer(TensorDictTrainer):
    ...     @attach_progress_bar(lambda self: self.config.trainer.num_iterations)
    ...     def _run_train_loop(self, iteration_context):
    ...         iteration_context.set_description("Training")
    ...         for _ in range(self.config.trainer.num_iterations):
    ...             ...
    ...             iteration_context.step()
    """

    def decorator(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(self: "Trainer", *args: Any, **kwargs: Any) -> Any:
            initial = self.progress_initial.get(method.__name__, 0)
            context = IterationContext(total(self), initial, self.show_progress, self.on_progress)
            try:
                return method(self, *args, context, **kwargs)
            finally:
                context.close()

        setattr(wrapper, _PROGRESS_TOTAL, total)
        return wrapper

    return decorator


class Trainer(ABC):
    """Base of all trainers.

    Parameters
    ----------
    config : DictConfig
        The whole experiment config.
    scenario : Scenario
        The task: environments, agents, metrics.
    run_dir : Path
        The run folder (checkpoints, metrics, summary).
    logger : MetricLogger
        Where metrics go.

    Raises
    ------
    ConfigError
        What :meth:`validate` finds wrong, one line each, when ``config`` did
        not pass :func:`nip_like.validation.validate` (a trainer built
        directly); a config that did is not checked again
        (:mod:`~nip_like.trainers.checked_configs`).
    """

    #: What the trainer needs of its scenario: capabilities of :mod:`nip_like.scenarios.base`
    #: (a tuple among them: any one of those), checked before any work by
    #: :func:`nip_like.validation.requirement_problems`.
    requires: ClassVar[tuple[type | tuple[type, ...], ...]] = ()
    #: The schema of the trainer's section (``trainer``): the RL loop's by default; the text
    #: trainers' is :class:`~nip_like.config.TextTrainerConfig`. Fields outside it are refused.
    loop_schema: ClassVar[type] = TrainerConfig

    def __init__(self, config: DictConfig, scenario: Scenario, run_dir: Path, logger: MetricLogger) -> None:
        self.config = config
        self.scenario = scenario
        self.run_dir = Path(run_dir)
        self.logger = logger
        self.run_id = run_id(config)
        if not was_checked(config):  # built directly, not by the experiment (which checked it): the trainer's own checks
            raise_problems(type(self).validate(config, scenario))
        #: The rank context (:mod:`nip_like.distributed`): one rank unless started by torchrun.
        self.distributed = distributed.current()
        self.show_progress = bool(config.run.progress_bar) and self.distributed.is_writer
        self.on_progress: Callable[[int], None] | None = None
        self.progress_initial: dict[str, int] = {}
        #: The data split the test loop plays (``python -m nip_like.evaluate --split`` changes it).
        self.test_split = "test"
        #: The episodes of a test, where the trainer plays a number of them (``python -m nip_like.evaluate
        #: --episodes`` changes it); set by the trainer from its options, None where a test plays a whole split.
        self.test_episodes: int | None = None

    @classmethod
    def requirements(cls, config: DictConfig) -> dict[str, tuple[type | tuple[type, ...], ...]]:
        """What the trainer needs of its scenario under ``config``, by what needs it.

        By default the trainer's :attr:`requires`, under ``trainer <name>``; a
        trainer whose options need more adds them under the option's path
        (``trainer.pretrain.agents``).
        """
        return {f"trainer {config.trainer.trainer_type}": cls.requires}

    @classmethod
    def validate(cls, config: DictConfig, scenario: Scenario | None) -> list[str]:
        """What is wrong with this trainer's options that a field's range cannot say, one line each (nothing by default).

        The config's last check (:func:`nip_like.validation.validate`), once
        every field has its declared type and an allowed value: relations
        between fields, and between the options and the game. Return the
        problems; do not raise. Keep it cheap: no data, no weights, no files.

        Parameters
        ----------
        config : DictConfig
            The whole experiment config, its sections checked against their schemas.
        scenario : Scenario or None
            The scenario, built with no data loaded; ``None`` when its own
            section has a problem (check what does not need it).
        """
        return []

    @classmethod
    def preflight(cls, config: DictConfig, scenario: Scenario) -> None:
        """Refuse, in one line, what this trainer needs of its inputs and can check before any work (nothing by default).

        Called by :func:`nip_like.experiment.preflight` after the scenario's
        own :meth:`~nip_like.scenarios.base.Scenario.preflight`, before the run
        folder is made: keep it cheap (no data, no weights). The text trainers
        check that their model servers answer.

        Parameters
        ----------
        config : DictConfig
            The whole experiment config.
        scenario : Scenario
            The scenario, built but with no data loaded.
        """

    def close(self) -> None:
        """Release what the trainer holds outside this process (servers it started); nothing by default.

        :func:`~nip_like.experiment.run_experiment` calls it when the run
        ends, however it ends.
        """

    @property
    def checkpoint_dir(self) -> Path:
        """Folder of ``last.pt`` (latest state) and ``best.pt`` (best evaluation)."""
        return self.run_dir / "checkpoints"

    @property
    def trainer_config(self) -> DictConfig:
        """The trainer's options (``config.trainer``)."""
        return self.config.trainer

    @property
    def test_run(self) -> bool:
        """Whether every loop runs once (``run.test_run``)."""
        return bool(self.config.run.test_run)

    @abstractmethod
    def train(self) -> dict[str, float]:
        """Train, test, and return the final test metrics."""

    def test(self) -> dict[str, float]:
        """Test the current agents on :attr:`test_split`; return the ``test/...`` metrics.

        Writes the test's transcripts, if the scenario has any, to
        ``transcripts/test.jsonl`` in the run folder. :meth:`train` ends with a
        test; ``python -m nip_like.evaluate`` calls this on a run's saved state
        (after :meth:`load_state_dict`). A trainer without one refuses.
        """
        raise NotImplementedError(f"{type(self).__name__} has no test(); python -m nip_like.evaluate needs one")

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Return everything needed to resume: models, optimiser, counters, RNG."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`."""

    def save_checkpoint(self, name: str = "last") -> Path:
        """Atomically write the trainer state to ``checkpoints/<name>.pt`` (rank 0 writes, every rank waits)."""
        path = self.checkpoint_dir / f"{name}.pt"
        state = self.state_dict()
        if self.distributed.is_writer:
            save_atomic({"run_id": self.run_id, "trainer": state}, path)
        self.distributed.barrier()
        return path

    def load_checkpoint(self, name: str = "last") -> None:
        """Restore ``checkpoints/<name>.pt``, checking that it belongs to this run and that the agent folders beside it are whole."""
        state = load_checked(self.checkpoint_dir / f"{name}.pt", self.run_id)
        check_checkpoint_folders(self.checkpoint_dir / name)
        self.load_state_dict(state["trainer"])

    def stop_if_requested(self, iteration: int, checkpointed: bool = False) -> None:
        """Stop here if Ctrl-C or SIGTERM asked the run to stop (see :mod:`nip_like.interrupts`).

        Call it between two iterations of a train loop, where the state is
        whole. On a request it writes ``checkpoints/last.pt`` (unless
        ``checkpointed``: the loop has just written it for this iteration) and
        raises :class:`~nip_like.interrupts.StopRequested`, which
        :func:`~nip_like.experiment.run_experiment` reports with the resume
        command. A trainer with a train loop of its own calls it too;
        otherwise only a second signal stops its run.

        Parameters
        ----------
        iteration : int
            The iterations completed so far.
        checkpointed : bool
            Whether ``last.pt`` already holds this iteration.
        """
        if self.distributed.any(stop_requested()):  # every rank stops at the same iteration
            if not checkpointed:
                self.save_checkpoint("last")
            raise StopRequested(iteration)

    def get_total_num_iterations(self) -> int:
        """Sum the iterations declared by every loop decorated with :func:`attach_progress_bar`."""
        total = 0
        for klass in type(self).__mro__:
            for attribute in vars(klass).values():
                declared = getattr(attribute, _PROGRESS_TOTAL, None)
                if declared is not None and getattr(type(self), attribute.__name__) is attribute:
                    total += int(declared(self))
        return total


@contextmanager
def _modes(modules: list[nn.Module], training: bool) -> Iterator[None]:
    previous = [module.training for module in modules]
    for module in modules:
        module.train(training)
    try:
        yield
    finally:
        for module, mode in zip(modules, previous):
            module.train(mode)


class TensorDictTrainer(Trainer, ABC):
    """A trainer whose agents are local torch modules exchanging TensorDicts.

    Train and test loops run inside an :class:`~contextlib.ExitStack` filled by
    :meth:`_build_train_context` and :meth:`_build_test_context`.
    """

    requires = (TensorGame,)

    #: Whether LM agents may sample from an inference server (``sampler.kind: server``): the RL loop's trainers.
    samples_from_servers: ClassVar[bool] = False

    @classmethod
    def preflight(cls, config: DictConfig, scenario: TensorGame) -> None:
        """Refuse a warm-start cache folder that cannot be written, LM agents whose memory clearly cannot fit the run's device (:func:`~nip_like.lm.memory.check_lm_memory`), and inference servers that do not answer with log-probabilities (:func:`~nip_like.lm.server.check_sampler`).

        The agents are the scenario's language-model agents
        (:meth:`~nip_like.scenarios.base.TensorGame.lm_agent_configs`); a scenario
        without any has nothing to check.
        """
        pretrain = config.trainer.get("pretrain")
        if pretrain is not None and pretrain.get("agents"):  # the fitted agents are cached there
            check_writable_folder(Path(str(pretrain.cache_dir)).expanduser(), "trainer.pretrain.cache_dir")
        agents = scenario.lm_agent_configs()
        if not agents:
            return
        from nip_like.lm.memory import check_lm_memory

        trainer = config.trainer
        world_size = distributed.launched_world_size()  # torchrun splits the batch over the ranks
        batch = max(int(trainer.get("num_envs", 1)) // world_size, int(trainer.get("test_batch_episodes", 1)) // world_size, 1)
        check_lm_memory(
            agents, batch, int(trainer.get("minibatch_size", 1)), str(config.run.device),
            autocast_dtype=config.run.get("autocast_dtype"), limit_gib=config.run.get("memory_limit_gib"),
            sharded=bool(config.run.get("fsdp", False)),
        )
        from nip_like.lm.server import check_sampler, check_server_sharing, probe_server, server_agents

        servers = server_agents(agents)
        if servers and not cls.samples_from_servers:
            where = next(iter(servers.values()))[0]
            raise ConfigError(f"{where}.sampler.kind=server: trainer {config.trainer.trainer_type} samples with its own models; allowed: local")
        for name, (where, sampler) in servers.items():
            check_sampler(where, sampler, agents[name][1], world_size)
        check_server_sharing(servers)
        for name, (where, sampler) in servers.items():
            probe_server(where, sampler, agents[name][1])

    def trainable_modules(self) -> list[nn.Module]:
        """Modules switched between train and eval mode by the contexts."""
        return []

    def test(self) -> dict[str, float]:
        """Run the test loop (:meth:`_run_test_loop`, the hook a subclass writes) in the test context; its metrics."""
        with ExitStack() as stack:
            self._build_test_context(stack)
            return self._run_test_loop()

    def _run_test_loop(self) -> dict[str, float]:
        """The test loop: play :attr:`test_split`, return ``test/...`` metrics (runs inside the test context)."""
        raise NotImplementedError(f"{type(self).__name__} has no test loop (_run_test_loop)")

    def _autocast(self, stack: ExitStack) -> None:
        dtype = self.config.run.get("autocast_dtype")
        if dtype:
            device_type = torch.device(self.config.run.device).type
            # cache_enabled=False: the region spans the whole loop, optimiser steps included, and autocast's cache
            # keeps the first low-precision copy of each trainable weight until the region ends, so the forward
            # passes after a step would still use the weights from before it.
            stack.enter_context(torch.autocast(device_type=device_type, dtype=getattr(torch, dtype), cache_enabled=False))

    def _build_train_context(self, stack: ExitStack) -> None:
        """Enter the contexts of the train loop: train mode, gradients, autocast if asked."""
        stack.enter_context(_modes(self.trainable_modules(), training=True))
        stack.enter_context(torch.enable_grad())
        self._autocast(stack)

    def _build_test_context(self, stack: ExitStack, deterministic: bool = True) -> None:
        """Enter the contexts of evaluation: eval mode, no gradients, greedy actions."""
        stack.enter_context(_modes(self.trainable_modules(), training=False))
        stack.enter_context(torch.no_grad())
        exploration = ExplorationType.DETERMINISTIC if deterministic else ExplorationType.RANDOM
        stack.enter_context(set_exploration_type(exploration))
        self._autocast(stack)
