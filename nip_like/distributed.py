"""Data-parallel runs under ``torchrun``: the rank context the trainers ask for shares and reductions.

``torchrun --nproc_per_node=N -m nip_like ...`` starts N processes (ranks) of one
run. :func:`current` reads torchrun's environment variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...) and joins the process
group once (gloo on the CPU, NCCL for CUDA tensors); without them, or with one
rank, it returns a context whose every method does nothing, so that a plain
process runs exactly as before.

What the trainer asks of it, at a few named points:

* :meth:`Distributed.share`: each rank collects ``1/N`` of every batch (and
  plays ``1/N`` of the evaluation and test episodes) with its own environment
  seeds (:meth:`Distributed.seed`), inside :meth:`Distributed.rank_rng`, a
  random stream of its own;
* :meth:`Distributed.gather`: the laid-out rollouts and the finished episodes
  of every rank, in rank order, on every rank; metrics are computed on them;
* :meth:`Distributed.owns`: every rank draws the same minibatches from the
  same gathered buffer and computes the loss of the minibatches it owns (round
  robin within each gradient-accumulation window); the gradients are summed
  over the ranks by ``DistributedDataParallel``
  (:mod:`nip_like.trainers.data_parallel`) or FSDP2 before each optimiser
  step, which is then the same on every rank;
* :attr:`Distributed.is_writer`: only rank 0 writes logs, transcripts,
  checkpoints and the summary, and holds the run folder's lock.

A rank stopped by an error of ours prints it in one line and also records it
in the error file torchrun reads (:func:`record_for_torchrun`), so that
torchrun's report of the failed ranks ends with that line.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from nip_like.checkpoint import derive_seed
from nip_like.errors import ConfigError, NipLikeError

# TensorDict is imported where a rank gathers one: a process that only asks current() (a fine-tune job) never loads it.
if TYPE_CHECKING:
    from tensordict import TensorDictBase

#: Seconds a rank waits for the others in one collective before it gives up
#: (a rank that hangs), unless ``NIP_LIKE_DISTRIBUTED_TIMEOUT`` says otherwise.
DEFAULT_TIMEOUT = 1800
#: Seconds the ranks wait for each other while rank 0 builds the run first (data caches, a warm start),
#: unless ``NIP_LIKE_BUILD_TIMEOUT`` says otherwise.
BUILD_TIMEOUT = 7 * 24 * 3600


class PeerFailure(NipLikeError):
    """Another rank stopped (it failed, and reported its own error) or stopped answering."""

    def __init__(self, message: str, quiet: bool) -> None:
        super().__init__(message)
        #: Whether the failing rank has reported the error already (nothing to add).
        self.quiet = quiet


class Distributed:
    """The rank context of a run; one rank (``world_size == 1``) does nothing.

    Parameters
    ----------
    rank : int
        This process's rank.
    world_size : int
        Number of ranks.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, patient_group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self._patient_group = patient_group  # gloo, for the waits of rank_zero_first (None: the default group)
        self._rank_rng: torch.Tensor | None = None
        self._others_waiting = False  # rank 0 inside rank_zero_first, the other ranks still waiting

    @property
    def enabled(self) -> bool:
        """Whether this run has more than one rank."""
        return self.world_size > 1

    @property
    def local_world_size(self) -> int:
        """Ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``; all of them when it is not set)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)) if self.enabled else 1

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes the run folder (rank 0)."""
        return self.rank == 0

    # ------------------------------------------------------------ shares, seeds
    def share(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (a count of environments, frames or episodes).

        Raises
        ------
        ConfigError
            If ``total`` does not split evenly over the ranks; ``what`` names the field.
        """
        if total % self.world_size:
            raise ConfigError(f"{what} ({total}) must be a multiple of the number of ranks ({self.world_size})")
        return total // self.world_size

    def seed(self, seed: int, purpose: str) -> int:
        """The seed of ``purpose`` for this rank (:func:`~nip_like.checkpoint.derive_seed`; rank-free with one rank)."""
        return derive_seed(seed, purpose if not self.enabled else f"{purpose}/rank{self.rank}")

    @contextmanager
    def rank_rng(self, seed: int) -> Iterator[None]:
        """Run the block on this rank's own stream of torch's global generator.

        What a rank samples alone (actions while collecting, evaluation and test
        episodes) draws from its own stream, so that the ranks explore
        differently while the global stream, which draws the minibatches,
        stays the same on every rank. Nothing happens with one rank.

        Parameters
        ----------
        seed : int
            The run's seed (the stream starts from it, per rank).
        """
        if not self.enabled:
            yield
            return
        if self._rank_rng is None:
            self._rank_rng = torch.Generator().manual_seed(self.seed(seed, "rank_rng")).get_state()
        shared = torch.get_rng_state()
        torch.set_rng_state(self._rank_rng)
        try:
            yield
        finally:
            self._rank_rng = torch.get_rng_state()
            torch.set_rng_state(shared)

    def rng_state(self) -> torch.Tensor | None:
        """This rank's own stream (for checkpoints)."""
        return self._rank_rng

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Restore the stream from :meth:`rng_state`."""
        self._rank_rng = state

    # ------------------------------------------------------------ collectives
    @contextmanager
    def collective(self) -> Iterator[None]:
        """Run collectives of torch.distributed; a rank that stopped or did not answer raises :class:`PeerFailure`.

        Other errors raised inside (an out-of-memory error in a backward pass
        that reduces gradients as it runs) pass through unchanged: the rank
        that meets them reports them.
        """
        try:
            yield
        except RuntimeError as error:  # torch.distributed's errors (DistBackendError, ...) are RuntimeErrors
            if not from_process_group(error):
                raise
            text = str(error)
            timed_out = "imed out" in text or "imeout" in text
            what = "no answer from the other ranks in time" if timed_out else "another rank stopped"
            raise PeerFailure(f"rank {self.rank}: {what} ({text.splitlines()[0][:160]})", quiet=not timed_out) from error

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.enabled:
            with self.collective():
                torch.distributed.barrier()

    @contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """Run the block on rank 0, then on the others (caches that rank 0 writes, the others read).

        Rank 0 may let the others start before it leaves the block
        (:meth:`release_others`), from where the rest of the block needs every
        rank at once. The ranks wait for each other here without the
        collectives' time limit (a warm start may take hours), up to
        ``NIP_LIKE_BUILD_TIMEOUT`` seconds (default :data:`BUILD_TIMEOUT`);
        a rank that fails meanwhile still stops the others at once.
        """
        if self.rank != 0:
            self._wait_patiently()
        self._others_waiting = self.enabled and self.rank == 0
        yield
        self.release_others()
        self._wait_patiently()  # every rank has left the block (the others' part may take long too)

    def release_others(self) -> None:
        """Inside :meth:`rank_zero_first`, on rank 0: let the other ranks start the block now (nothing elsewhere)."""
        if self._others_waiting:
            self._others_waiting = False
            self._wait_patiently()

    def _wait_patiently(self) -> None:
        if self.enabled:
            with self.collective():
                torch.distributed.barrier(group=self._patient_group)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank (``[value]`` with one rank)."""
        if not self.enabled:
            return [value]
        from tensordict import TensorDictBase

        moved = value.to("cpu") if isinstance(value, (torch.Tensor, TensorDictBase)) else value
        values: list[Any] = [None] * self.world_size
        with self.collective():
            torch.distributed.all_gather_object(values, moved)
        return values

    def gather_cat(
        self, data: TensorDictBase, join: Callable[[list[TensorDictBase]], TensorDictBase] | None = None
    ) -> TensorDictBase:
        """Every rank's ``data`` joined along its first dimension, in rank order (``data`` with one rank).

        ``join`` joins the parts (default :func:`concatenated`); a layout whose
        items' shape depends on the batch pads them to one shape there.
        """
        if not self.enabled:
            return data
        return (join or concatenated)(self.gather(data)).to(data.device)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank."""
        if not self.enabled:
            return flag
        return any(self.gather(bool(flag)))

    def mean(self, metrics: dict[str, float], weight: float = 1.0) -> dict[str, float]:
        """Average each metric over the ranks that report it, each rank counting ``weight``."""
        if not self.enabled:
            return metrics
        totals: dict[str, list[float]] = {}
        for part, part_weight in self.gather((metrics, weight)):
            for name, value in part.items():
                total = totals.setdefault(name, [0.0, 0.0])
                total[0] += float(value) * part_weight
                total[1] += part_weight
        return {name: value / count for name, (value, count) in totals.items() if count}

    def maximum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``values`` over the ranks (``values`` itself with one rank)."""
        if not self.enabled:
            return values
        values = values.clone()
        with self.collective():
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        return values

    def owns(self, position: int) -> bool:
        """Whether this rank computes the ``position``-th minibatch of an accumulation window."""
        return position % self.world_size == self.rank


def from_process_group(error: RuntimeError) -> bool:
    """Whether ``error`` comes from the process group (a peer gone or silent), not from this rank's own work.

    NCCL's errors are ``torch.distributed.DistError``; gloo's are plain
    RuntimeErrors whose text names gloo's sources.
    """
    if isinstance(error, torch.distributed.DistError):
        return True
    text = str(error).lower()
    return "gloo" in text or "nccl" in text or "connection closed" in text or "connection reset" in text


def concatenated(parts: list[TensorDictBase]) -> TensorDictBase:
    """``parts`` concatenated along their first dimension; empty ones left out (they may lack keys that only items carry)."""
    filled = [part for part in parts if part.batch_size[0]] or parts[:1]
    return torch.cat(filled)


def hydra_overrides(arguments: list[str]) -> list[str]:
    """Make the ranks of a torchrun run agree on one run folder, which only rank 0 writes.

    With one rank, ``arguments`` unchanged. Otherwise every rank resolves
    ``${now:...}`` in the folder's name with rank 0's start time, and the other
    ranks neither write ``.hydra/`` nor a job log there.

    Parameters
    ----------
    arguments : list of str
        The command line's Hydra arguments.
    """
    context = current()
    if not context.enabled:
        return arguments
    import hydra.core.utils
    from datetime import datetime

    started = datetime.fromtimestamp(context.gather(datetime.now().timestamp())[0])

    class _RankZeroClock(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime:
            return started

    hydra.core.utils.datetime = _RankZeroClock  # what Hydra's ${now:...} resolver reads
    if context.is_writer:
        return arguments
    return [*arguments, "hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


_current: Distributed | None = None


def launched_world_size() -> int:
    """The number of ranks torchrun started (1 without torchrun), read from its environment without joining the group."""
    return max(1, int(os.environ.get("WORLD_SIZE", "1")))


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun), read from its environment without joining the group."""
    return int(os.environ.get("RANK", "0"))


def timeout_from_environment(name: str, default: float) -> timedelta:
    """The time limit in seconds that environment variable ``name`` sets (``default`` when it is unset or empty).

    Raises
    ------
    ConfigError
        If the value is not a positive number of seconds (``abc``, ``-5``,
        ``0``, ``inf``, one too large for a time limit).
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return timedelta(seconds=default)
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= timedelta.max.total_seconds():  # also refuses NaN
        raise ConfigError(f"{name}={text!r} must be a positive number of seconds (default {default:g})")
    return timedelta(seconds=seconds)


def record_for_torchrun(line: str) -> None:
    """Under torchrun, write ``line`` (an error of ours, as printed) to the error file torchrun reads for this rank.

    torchrun (torch.distributed.elastic) names the file in
    ``TORCHELASTIC_ERROR_FILE``; its report of a failed rank, printed when
    the ranks have stopped, then shows ``traceback : <line>`` instead of a
    link to instructions for tracebacks the rank does not have. Nothing
    happens without torchrun, or if the file cannot be written.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # The layout torch's own ErrorHandler.record_exception writes; torchrun reads the timestamp as an int.
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as file:
            json.dump(data, file)
    except OSError:
        pass


def current() -> Distributed:
    """The rank context of this process; joins torchrun's process group on first use.

    Without torchrun's variables, or with ``WORLD_SIZE=1``, a one-rank context
    that does nothing. The process group's timeout is
    ``NIP_LIKE_DISTRIBUTED_TIMEOUT`` seconds (default :data:`DEFAULT_TIMEOUT`):
    a rank that waits longer for the others in one collective stops with an
    error. A second (gloo) group with ``NIP_LIKE_BUILD_TIMEOUT`` (default
    :data:`BUILD_TIMEOUT`) serves the waits of :meth:`Distributed.rank_zero_first`.

    Raises
    ------
    ConfigError
        If one of these variables is not a positive number of seconds
        (:func:`timeout_from_environment`); every rank raises it, before joining.
    """
    global _current
    if _current is not None:
        return _current
    if launched_world_size() == 1:
        _current = Distributed()
        return _current
    # Read both before joining: a bad value stops every rank alike, at once.
    timeout = timeout_from_environment("NIP_LIKE_DISTRIBUTED_TIMEOUT", DEFAULT_TIMEOUT)
    build_timeout = timeout_from_environment("NIP_LIKE_BUILD_TIMEOUT", BUILD_TIMEOUT)
    if not torch.distributed.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            # CUDA tensors go through NCCL, CPU ones (gathered objects, CPU runs) through gloo.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "cpu:gloo,cuda:nccl"
        torch.distributed.init_process_group(backend, timeout=timeout)
    patient = torch.distributed.new_group(backend="gloo", timeout=build_timeout)
    _current = Distributed(torch.distributed.get_rank(), torch.distributed.get_world_size(), patient)
    return _current


def shutdown() -> None:
    """Leave the process group (at the end of a command).

    The process keeps its rank but no longer talks to the others: a later
    :func:`current` does not join the group again (the other ranks may have
    ended; joining would wait for them, then fail).
    """
    global _current
    if _current is not None and _current.enabled:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _current = Distributed(_current.rank, 1)
