"""Two language-model agents on one shared frozen base (``share_base_with``) against each on its own copy.

The game is the 2-agent chat game of the duplicates scenario: the chat view
(``scenario.view=chat``), the NIP protocol with the prover speaking first and
the verifier answering (two turns), trained with PPO; both agents carry LoRA
adapters of rank ``--lora-r`` (8; peft's default targets) and a value head,
and both are loaded from the same model folder through ``pretrained_path``.
The folder is by default the 30M benchmark shape of
``scripts/benchmark_lm_chat.py`` (a Qwen2-architecture chat model of 29.8M
parameters, random weights, built once into ``--cache-dir`` by the project's
builder); ``--model-folder`` takes any other. The two runs differ in one
setting only: the shared run gives the verifier ``share_base_with: prover``
(its model is a module tree over the prover's frozen base tensors, so the base
is held once), the copies run loads the base twice. Both are built with
``nip_like.experiment.build_trainer`` from a config composed by
``nip_like.cli.compose_config`` (``preset=none``, ``logger=none``, no
evaluation) into a temporary run folder, with the same seed, so both do the
same work: the same samples, the same updates (the losses are recorded to
show it).

Three measurements, each the shared run against the copies run:

1. **Memory held between iterations.** After one warm-up iteration
   (``trainer.train_iteration()``: collection and a PPO update, so the
   optimiser's state exists), the bytes of every distinct tensor storage the
   trainer's agents and optimiser hold: the parameters and buffers of
   ``trainer.loss_module`` and ``trainer.policy`` (frozen base weights,
   adapters, value heads), their gradients if kept, and the optimiser's state
   tensors. Each storage counts once, by its device and ``data_ptr``, at its
   whole size, so a tensor the two agents share counts once. On CUDA,
   ``torch.cuda.memory_allocated`` after the warm-up is reported too (and what
   the run added to it: the two trainers live side by side). Target: held by
   the shared run over held by the copies run at most 0.55 (the base is held
   once instead of twice; adapters, value heads and optimiser state are the
   same on both sides).
2. **Peak memory of the update.** One more iteration of each run, with
   ``TensorDictRlTrainer._optimize`` (the epochs x minibatches of PPO steps)
   wrapped in :class:`benchmark_lm.MemoryProbe`: the peak tensor memory
   allocated during the update over what was allocated when it began
   (``torch.cuda.max_memory_allocated`` on CUDA; on the CPU the allocation and
   free events of ``torch.profiler``). Both peaks and their ratio are
   reported, with no target (activations and gradients are the same work on
   both sides).
3. **Time per iteration.** Then ``--iterations`` timed iterations of each
   run, interleaved (shared, copies, shared, copies, ...) so that drift in
   the machine's load hits both; the global torch seed is set to the same
   value before the two runs' iterations of one round. The median seconds
   per iteration of each and their ratio shared / copies are reported.
   Target: at most 1.05 (sharing the base costs no time beyond noise).

The load average (``os.getloadavg``) is recorded at the start and at the end,
since the machine may be shared. ``--output`` writes every figure as JSON.

Run it from the repository root::

    python scripts/benchmark_shared_base.py --threads 1 --output shared_base.json   # 4 minutes on 2 busy cores
    python scripts/benchmark_shared_base.py --model-folder models/my-qwen --iterations 5
    python scripts/benchmark_shared_base.py --device cuda --num-envs 64 --frames-per-batch 256 --minibatch-size 64
    python scripts/benchmark_shared_base.py --smoke                      # a tiny model, seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from lm_benchmark_env import set_script_environment  # noqa: E402

if __name__ == "__main__":
    set_script_environment()  # HF_HUB_OFFLINE=1 and the rest, before torch and transformers are imported

import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import benchmark_lm as bench  # noqa: E402
from benchmark_lm_chat import GAME_OVERRIDES, SHAPES, load_average, model_folder  # noqa: E402
from nip_like.cli import compose_config  # noqa: E402
from nip_like.experiment import build_trainer  # noqa: E402

#: Largest acceptable ratio of the memory held between iterations, shared base over two copies.
TARGET_HELD_RATIO = 0.55
#: Largest acceptable ratio of the median seconds per iteration, shared base over two copies.
TARGET_TIME_RATIO = 1.05
#: The two runs, in the order they are built and, in each round, timed.
RUNS = ("shared", "copies")
#: What ``--smoke`` sets: the tiny model shape, a tiny game, one thread.
SMOKE = {
    "build": "qwen2-tiny",
    "num_envs": 4,
    "frames_per_batch": 8,
    "minibatch_size": 8,
    "new_tokens": 4,
    "list_length": 6,
    "num_values": 12,
    "iterations": 2,
    "threads": 1,
}
#: Metrics of an iteration recorded per run, to show that both runs do the same work.
RECORDED_METRICS = ("loss/policy", "train/reward")
#: The trainer's timers of an iteration (collection, then the update), recorded per timed iteration.
PHASES = {"collect": "timers/collect", "update": "timers/update"}
MIB = 2**20


# ------------------------------------------------------------------ the runs
def game_overrides(folder: Path, args: argparse.Namespace, shared: bool) -> list[str]:
    """The config overrides of one run: the chat game, both agents on ``folder``, sharing one base or not.

    Parameters
    ----------
    folder : Path
        The model folder both agents load (``pretrained_path``).
    args : argparse.Namespace
        The command line (game sizes, LoRA rank, threads, device, seed).
    shared : bool
        Whether the verifier shares the prover's base (``share_base_with: prover``).

    Returns
    -------
    list of str
        Hydra overrides, ``preset=none`` first.
    """
    # The verifier's entry is its whole config (it does not inherit default_agent's fields): the same settings.
    extra = ", share_base_with: prover" if shared else ""
    verifier = (f"+scenario.agents.verifier={{pretrained_path: {folder}, max_new_tokens: {args.new_tokens}, "
                f"lora: {{r: {args.lora_r}}}{extra}}}")
    return [
        "preset=none",
        *GAME_OVERRIDES,
        "trainer=ppo",
        f"scenario.default_agent.pretrained_path={folder}",
        f"scenario.default_agent.max_new_tokens={args.new_tokens}",
        f"scenario.default_agent.lora.r={args.lora_r}",
        verifier,
        f"scenario.length={args.list_length}",
        f"scenario.num_values={args.num_values}",
        f"scenario.num_lists={max(200, 20 * args.num_envs)}",
        f"scenario.cache_dir={Path(args.cache_dir).expanduser() / 'datasets'}",
        f"trainer.num_envs={args.num_envs}",
        f"trainer.frames_per_batch={args.frames_per_batch}",
        f"trainer.minibatch_size={args.minibatch_size}",
        f"trainer.num_epochs={args.epochs}",
        # The warm-up, the probed iteration and the timed ones (the schedule is constant anyway).
        f"trainer.num_iterations={args.iterations + 2}",
        "trainer.eval.every=0",
        f"trainer.num_test_episodes={args.num_envs}",
        f"trainer.test_batch_episodes={args.num_envs}",
        "run.progress_bar=false",
        f"run.num_threads={args.threads}",
        f"run.device={args.device}",
        "logger=none",
        f"seed={args.seed}",
    ]


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """What identifies a tensor's storage: its device and the address of its data."""
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def held_bytes(trainer: Any) -> dict[str, int]:
    """Bytes of the distinct tensor storages that the trainer's agents and optimiser hold, by kind.

    The parameters (frozen and trained) and buffers of ``trainer.loss_module``
    and ``trainer.policy``, the gradients the parameters keep, and the
    optimiser's state tensors. Each storage counts once, at its whole size,
    under the first kind that finds it (in that order).

    Parameters
    ----------
    trainer : TensorDictRlTrainer
        A built trainer.

    Returns
    -------
    dict of str to int
        ``frozen``, ``trained``, ``buffers``, ``gradients``, ``optimiser``
        and their ``total``.
    """
    modules = (trainer.loss_module, trainer.policy)
    seen: set[tuple[str, int]] = set()
    kinds = {"frozen": 0, "trained": 0, "buffers": 0, "gradients": 0, "optimizer": 0}

    def add(kind: str, tensor: torch.Tensor) -> None:
        key = storage_key(tensor)
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes and key not in seen:
            seen.add(key)
            kinds[kind] += nbytes

    parameters = [param for module in modules for param in module.parameters()]
    for param in parameters:
        add("trained" if param.requires_grad else "frozen", param)
    for module in modules:
        for buffer in module.buffers():
            add("buffers", buffer)
    for param in parameters:
        if param.grad is not None:
            add("gradients", param.grad)
    for state in trainer.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add("optimizer", value)
    return {**kinds, "total": sum(kinds.values())}


def base_of(trainer: Any, agent: str = "prover") -> dict[str, int]:
    """Parameters and bytes of one agent's frozen base: its model's frozen parameters and buffers, each storage once.

    Parameters
    ----------
    trainer : TensorDictRlTrainer
        A built trainer.
    agent : str
        The agent whose base is counted.

    Returns
    -------
    dict of str to int
        ``parameters`` (elements of the distinct frozen parameters) and
        ``bytes`` (of their storages and the model's buffers').
    """
    model = trainer.policy.policy(agent).model
    seen: set[tuple[str, int]] = set()
    count = nbytes = 0
    for tensor in (*(p for p in model.parameters() if not p.requires_grad), *model.buffers()):
        key = storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        nbytes += tensor.untyped_storage().nbytes()
        if isinstance(tensor, torch.nn.Parameter):
            count += tensor.numel()
    return {"parameters": count, "bytes": nbytes}


def trained_parameters(trainer: Any) -> dict[str, int]:
    """Each agent's trained parameters (adapters and value head), counted once each."""
    counts = {}
    for name in trainer.agent_names:
        policy = trainer.policy.policy(name)
        counts[name] = sum(p.numel() for p in {id(p): p for p in policy.parameters() if p.requires_grad}.values())
    return counts


def allocated(device: torch.device) -> int | None:
    """``torch.cuda.memory_allocated`` after a garbage collection on CUDA; None on other devices."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


class Run:
    """One of the two runs: its trainer, built in ``run_dir``, and what is measured of it.

    Parameters
    ----------
    name : str
        ``shared`` or ``copies``.
    folder : Path
        The model folder.
    args : argparse.Namespace
        The command line.
    run_dir : Path
        The run folder (temporary).
    """

    def __init__(self, name: str, folder: Path, args: argparse.Namespace, run_dir: Path) -> None:
        self.name = name
        self.device = torch.device(args.device)
        self.allocated_before = allocated(self.device)
        config = compose_config(game_overrides(folder, args, shared=name == "shared"))
        started = time.perf_counter()
        self.trainer = build_trainer(config, run_dir)
        self.build_seconds = time.perf_counter() - started
        self.metrics: list[dict[str, float]] = []
        self.seconds: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.update_peaks: list[int] = []

    def iteration(self, seed: int, probe: bench.MemoryProbe | None = None) -> float:
        """One ``train_iteration()`` after ``torch.manual_seed(seed)``, its update probed if asked; its seconds.

        Call it inside the trainer's train context (:meth:`enter`).
        """
        trainer = self.trainer
        if probe is not None:
            optimize = trainer._optimize

            def probed(trained: tuple[str, ...]) -> dict[str, float]:
                probe.start()
                try:
                    return optimize(trained)
                finally:
                    self.update_peaks.append(probe.stop())

            trainer._optimize = probed  # the bound method, on this instance only
        torch.manual_seed(seed)
        try:
            bench.synchronize(self.device)
            started = time.perf_counter()
            metrics = trainer.train_iteration()
            bench.synchronize(self.device)
            seconds = time.perf_counter() - started
        finally:
            if probe is not None:
                del trainer._optimize
        trainer.state.iteration += 1
        self.metrics.append({name: float(metrics[name]) for name in RECORDED_METRICS if name in metrics})
        self.phases.append({phase: float(metrics[name]) for phase, name in PHASES.items() if name in metrics})
        return seconds

    def enter(self, stack: ExitStack) -> None:
        """Enter the trainer's train context (train mode, gradients) on ``stack``."""
        self.trainer._build_train_context(stack)

    def budgets(self) -> dict[str, int | None]:
        """Each agent's token budget of a scoring pass with gradients (automatic unless set)."""
        return {name: getattr(self.trainer.policy.policy(name), "max_tokens_per_micro_batch", None)
                for name in self.trainer.agent_names}


# ------------------------------------------------------------------ the measurements
def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build both runs, warm them up, and measure held memory, update peaks and time per iteration.

    Parameters
    ----------
    args : argparse.Namespace
        The command line (:func:`parse_args`).

    Returns
    -------
    dict
        Every figure (see :func:`main`).
    """
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    started, load_at_start = time.perf_counter(), load_average()
    folder = model_folder(args)
    print(f"shared base against two copies: {folder}; {args.num_envs} envs, {args.frames_per_batch} frames per batch, "
          f"minibatches of {args.minibatch_size}, {args.epochs} epoch(s), replies of at most {args.new_tokens} tokens, "
          f"LoRA r={args.lora_r}; {device}, {args.threads} thread(s); load average {load_at_start}", flush=True)
    runs: dict[str, Run] = {}
    held: dict[str, dict[str, int]] = {}
    cuda: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory(prefix="benchmark_shared_base_") as tmp, ExitStack() as stack:
        for name in RUNS:
            run = runs[name] = Run(name, folder, args, Path(tmp) / name)
            run.enter(stack)
            warm_up = run.iteration(args.seed)
            held[name] = held_bytes(run.trainer)
            if device.type == "cuda":
                after = allocated(device)
                cuda[name] = {"allocated_after_warm_up": after, "added_by_run": after - run.allocated_before}
            print(f"{name}: built in {run.build_seconds:.1f} s, warm-up iteration {warm_up:.1f} s, "
                  f"holds {held[name]['total'] / MIB:.1f} MiB", flush=True)
        probe = bench.MemoryProbe(device)
        for name in RUNS:
            runs[name].iteration(args.seed + 1, probe)
        print("update peaks: " + ", ".join(f"{name} {runs[name].update_peaks[0] / MIB:.1f} MiB" for name in RUNS),
              flush=True)
        for index in range(args.iterations):
            for name in RUNS:
                runs[name].seconds.append(runs[name].iteration(args.seed + 2 + index))
            print(f"round {index + 1}: " + ", ".join(f"{name} {runs[name].seconds[-1]:.2f} s" for name in RUNS),
                  flush=True)
        shared, copies = runs["shared"].trainer, runs["copies"].trainer
        base = base_of(copies)
        model = {
            "folder": str(folder),
            "shape": None if args.model_folder is not None else args.build,
            "sizes": None if args.model_folder is not None else SHAPES[args.build],
            "model_type": shared.policy.policy("prover").model.config.model_type,
            "parameters": base["parameters"],
            "base_bytes": base["bytes"],
            "trained_parameters": trained_parameters(shared),
        }
        verifier_owner = {name: runs[name].trainer.policy.policy("verifier").base_owner for name in RUNS}
        budgets = {name: runs[name].budgets() for name in RUNS}
        metrics = {name: runs[name].metrics for name in RUNS}
        seconds = {name: runs[name].seconds for name in RUNS}
        phases = {name: runs[name].phases[-args.iterations:] for name in RUNS}  # of the timed iterations
        peaks = {name: runs[name].update_peaks[0] for name in RUNS}
        builds = {name: runs[name].build_seconds for name in RUNS}
        del runs, shared, copies
    return figures(args, model, held, cuda, peaks, seconds, phases, metrics, budgets, verifier_owner, builds,
                   [load_at_start, load_average()], time.perf_counter() - started)


def figures(
    args: argparse.Namespace,
    model: dict[str, Any],
    held: dict[str, dict[str, int]],
    cuda: dict[str, dict[str, int]],
    peaks: dict[str, int],
    seconds: dict[str, list[float]],
    phases: dict[str, list[dict[str, float]]],
    metrics: dict[str, list[dict[str, float]]],
    budgets: dict[str, dict[str, int | None]],
    verifier_owner: dict[str, str | None],
    builds: dict[str, float],
    load: list[list[float]],
    wall_seconds: float,
) -> dict[str, Any]:
    """The results of :func:`measure` as one JSON-ready dictionary, with the ratios and their verdicts."""
    device = torch.device(args.device)
    held_ratio = held["shared"]["total"] / held["copies"]["total"]
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    time_ratio = medians["shared"] / medians["copies"]
    peak_ratio = peaks["shared"] / peaks["copies"] if peaks["copies"] else None
    # The same seed, samples and updates: the two runs' recorded metrics agree (to float rounding).
    same_work = len(metrics["shared"]) == len(metrics["copies"]) and all(
        a.keys() == b.keys() and all(abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(b[key])) for key in a)
        for a, b in zip(metrics["shared"], metrics["copies"])
    )
    return {
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "model": model,
        "verifier_base_owner": verifier_owner,
        "held": {
            "shared": held["shared"],
            "copies": held["copies"],
            "difference": held["copies"]["total"] - held["shared"]["total"],
            "ratio": held_ratio,
            "target": TARGET_HELD_RATIO,
            "met": held_ratio <= TARGET_HELD_RATIO,
        },
        "cuda_memory_allocated": cuda or None,
        "update_peak": {
            "shared": peaks["shared"],
            "copies": peaks["copies"],
            "ratio": peak_ratio,
            "method": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler memory events",
        },
        "seconds_per_iteration": {
            "shared": seconds["shared"],
            "copies": seconds["copies"],
            "median_shared": medians["shared"],
            "median_copies": medians["copies"],
            "ratio": time_ratio,
            "target": TARGET_TIME_RATIO,
            "met": time_ratio <= TARGET_TIME_RATIO,
            # The trainer's own timers of the timed iterations (timers/collect and timers/update), medians.
            "median_phases": {name: {phase: statistics.median(row[phase] for row in rows) for phase in PHASES}
                              for name, rows in phases.items()},
        },
        "targets": {
            "held_ratio": {"value": held_ratio, "target": f"<= {TARGET_HELD_RATIO}",
                           "met": held_ratio <= TARGET_HELD_RATIO},
            "time_ratio": {"value": time_ratio, "target": f"<= {TARGET_TIME_RATIO}",
                           "met": time_ratio <= TARGET_TIME_RATIO},
        },
        "iteration_metrics": metrics,
        "same_work": same_work,
        "token_budgets": budgets,
        "build_seconds": builds,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "peft": peft.__version__},
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "load_average": {"start": load[0], "end": load[1]},
        "wall_seconds": wall_seconds,
    }


def device_name(device: torch.device) -> str:
    """The CUDA card's name, or the CPU's (with the number of cores)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def print_table(results: dict[str, Any]) -> None:
    """The figures of both runs side by side, with the ratios and their verdicts."""
    held, peak, timing = results["held"], results["update_peak"], results["seconds_per_iteration"]

    def verdict(met: bool, target: float) -> str:
        return f"target <= {target}: {'met' if met else 'MISSED'}"

    model = results["model"]
    print(f"\n{model['model_type']} ({model['shape'] or 'folder'}), {model['parameters']:,} base parameters "
          f"({model['base_bytes'] / MIB:.1f} MiB), trained {model['trained_parameters']}; {results['device']}")
    print(f"{'':<28} {'shared':>12} {'copies':>12} {'ratio':>7}")
    print(f"{'held between iterations MiB':<28} {held['shared']['total'] / MIB:>12.2f} "
          f"{held['copies']['total'] / MIB:>12.2f} {held['ratio']:>7.3f}  {verdict(held['met'], held['target'])}")
    for kind in ("frozen", "trained", "buffers", "gradients", "optimizer"):
        print(f"{'  ' + kind:<28} {held['shared'][kind] / MIB:>12.2f} {held['copies'][kind] / MIB:>12.2f}")
    if results["cuda_memory_allocated"]:
        cuda = results["cuda_memory_allocated"]
        print(f"{'CUDA added by the run MiB':<28} {cuda['shared']['added_by_run'] / MIB:>12.2f} "
              f"{cuda['copies']['added_by_run'] / MIB:>12.2f} "
              f"{cuda['shared']['added_by_run'] / cuda['copies']['added_by_run']:>7.3f}")
    ratio = f"{peak['ratio']:>7.3f}" if peak["ratio"] is not None else f"{'-':>7}"
    print(f"{'update peak MiB':<28} {peak['shared'] / MIB:>12.2f} {peak['copies'] / MIB:>12.2f} {ratio}")
    print(f"{'median s per iteration':<28} {timing['median_shared']:>12.3f} {timing['median_copies']:>12.3f} "
          f"{timing['ratio']:>7.3f}  {verdict(timing['met'], timing['target'])}")
    for phase in PHASES:
        shared, copies = (timing["median_phases"][name][phase] for name in RUNS)
        print(f"{'  ' + phase:<28} {shared:>12.3f} {copies:>12.3f} {shared / copies:>7.3f}")
    print(f"same work on both sides: {results['same_work']}; load average {results['load_average']['start']} -> "
          f"{results['load_average']['end']}; {results['wall_seconds']:.0f} s in all")


# ------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``--smoke`` replaces the defaults of the sizes by tiny ones).

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    argparse.Namespace
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-folder", type=Path, default=None, help="a chat-model folder (default: build --build)")
    parser.add_argument("--build", choices=sorted(SHAPES), default="qwen2-30m", help="shape built when no folder")
    parser.add_argument("--cache-dir", default="~/.cache/nip_like/benchmark", help="where built folders are kept")
    parser.add_argument("--num-envs", type=int, default=16, help="environments of the collector (16)")
    parser.add_argument("--frames-per-batch", type=int, default=32,
                        help="frames collected per iteration (32: one episode of two turns per environment)")
    parser.add_argument("--minibatch-size", type=int, default=32, help="PPO minibatch size (32)")
    parser.add_argument("--epochs", type=int, default=1, help="PPO epochs per iteration (1)")
    parser.add_argument("-T", "--new-tokens", type=int, default=16, help="longest message, in tokens (16)")
    parser.add_argument("--list-length", type=int, default=6, help="cells of a list (scenario.length, 6)")
    parser.add_argument("--num-values", type=int, default=12, help="values are 0 .. this - 1 (scenario.num_values, 12)")
    parser.add_argument("--lora-r", type=int, default=8, help="rank of both agents' LoRA adapters (8)")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations of each run (3)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and run.num_threads (2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="run.device (cpu)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model folder and of both runs (0)")
    parser.add_argument("--smoke", action="store_true", help="the qwen2-tiny shape and a tiny game (for tests)")
    parser.add_argument("--output", "--json", type=Path, default=None, help="also write the results as JSON here")
    args = bench.parse_with_smoke(
        parser, argv, SMOKE, ("num_envs", "frames_per_batch", "minibatch_size", "epochs", "new_tokens", "list_length", "lora_r",
                              "iterations", "threads"),
    )
    if args.list_length > args.num_values:
        parser.error("--list-length must be at most --num-values (lists without a duplicate must exist)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print its table, return (and with ``--output`` write) every figure.

    It sets ``torch.set_num_threads(--threads)`` and leaves it so; the
    warning filters and transformers' log level are restored on return.

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    dict
        ``held`` (bytes held by each run, by kind, their ratio, target and
        verdict), ``cuda_memory_allocated`` (None on the CPU),
        ``update_peak`` (each run's and the ratio), ``seconds_per_iteration``
        (each run's list, medians, ratio, target and verdict), ``targets``,
        ``model`` (folder, shape, parameters), ``versions``, ``device``,
        ``load_average`` and more.
    """
    args = parse_args(argv)
    # peft and transformers warn (UserWarning) about settings of the random model folder, once per load.
    results = bench.run_quietly(measure, args, UserWarning)
    print_table(results)
    bench.write_results(results, args.output)
    return results


if __name__ == "__main__":
    main()
