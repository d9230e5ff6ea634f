"""The duplicates chat game with a real model: NIP against the solo verifier, both warm-started on honest play.

For each seed, one run per protocol (``nip``, ``solo_verifier``) of
``preset=real_chat``: the model (a GGUF file or a model folder) plays every
agent through LoRA adapters on one shared base; each agent's adapters are first
fitted to the scenario's honest demonstrations (``trainer.pretrain.agents=[*]``,
the warm start: without it the base model never writes a decision), then
trained with PPO in the game and tested on held-out lists. Each run is a
``python -m nip_like`` process in ``<out>/<protocol>_seed<seed>``; a run whose
``summary.json`` exists is not run again, so a call can be repeated (or run one
protocol and seed at a time) and the last call makes the table. Warm starts
are cached in ``<out>/pretrained``.

Written to ``--out``: ``results.md`` (the per-run table, then the project's
comparison report of :mod:`nip_like.analysis` on ``test/accuracy``, which says
so below 5 runs per protocol), ``results.json`` (every run's figures and the
report's rows) and ``report/`` (:func:`~nip_like.analysis.report.write_report`'s
files). Each run's row holds its wall time and the machine's load average
when it started and ended (runs made by an earlier call keep the figures of
that call).

Sizes (``--size``; each option below overrides its figure):

* ``cpu`` (default): seed 0, 160 lists, 2 warm-start epochs, 1 PPO iteration
  of 32 frames, 16 test lists (the test split), 2 threads.
* ``gpu``: seeds 0 1 2, 2,000 lists, 2 warm-start epochs, 10 iterations of 128
  frames, the 200 lists of the test split, on ``cuda``.

Examples
--------
``python scripts/real_nip_vs_solo.py``
``python scripts/real_nip_vs_solo.py --size gpu --out outputs/real_nip_vs_solo_gpu``
``python scripts/real_nip_vs_solo.py --model models/my-qwen --chat-template none --seeds 0 --iterations 1``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from nip_like.analysis.report import ReportOptions, build_report, format_markdown, write_report  # noqa: E402
from nip_like.analysis.runs import find_runs  # noqa: E402
from nip_like.cli import report_errors  # noqa: E402
from nip_like.experiment import SUMMARY_FILE  # noqa: E402
from nip_like.logging import read_csv_metric  # noqa: E402

#: The protocols compared: the prover-verifier game and the verifier alone (it sees no cell of the list).
PROTOCOLS = ("nip", "solo_verifier")
#: Where the test suite assembles Gemma 3 270M's GGUF file (tests/real_model.py).
REAL_MODEL = "~/.cache/nip_like/real_model/gemma-3-270m-q4_k_m.gguf"
#: Turn limits of the protocols that take turns: the prover opens and the verifier decides on the next step.
TURNS = {"nip": ("protocol.first_speaker=prover", "protocol.min_rounds=1", "protocol.max_rounds=2")}
#: The final metrics of the table: held-out accuracy and the share of test episodes the verifier decided.
METRICS = ("test/accuracy", "test/decided")


@dataclass(frozen=True)
class Size:
    """How large each run is (the figures of one ``--size``)."""

    seeds: tuple[int, ...]
    num_lists: int  # lists of the dataset, all splits (80% train: the warm start's demonstrations)
    pretrain_epochs: int  # passes of the warm start over the train demonstrations
    pretrain_lr: float  # learning rate of the warm start (the adapters)
    pretrain_minibatch: int  # demonstrations per warm-start step
    iterations: int  # PPO iterations
    num_envs: int  # games played at once
    frames_per_batch: int  # frames an iteration
    minibatch_size: int  # frames per PPO step
    test_episodes: int  # held-out lists of the final test
    device: str
    threads: int  # torch threads of each run


SIZES = {
    "cpu": Size(
        seeds=(0,), num_lists=160, pretrain_epochs=2, pretrain_lr=1e-3, pretrain_minibatch=8, iterations=1,
        num_envs=4, frames_per_batch=32, minibatch_size=16, test_episodes=16, device="cpu", threads=2,
    ),
    "gpu": Size(
        seeds=(0, 1, 2), num_lists=2000, pretrain_epochs=2, pretrain_lr=1e-3, pretrain_minibatch=32, iterations=10,
        num_envs=32, frames_per_batch=128, minibatch_size=64, test_episodes=200, device="cuda", threads=4,
    ),
}

#: ``--option`` -> the :class:`Size` field it overrides.
SIZE_OPTIONS = {
    "num_lists": int, "pretrain_epochs": int, "pretrain_lr": float, "pretrain_minibatch": int, "iterations": int,
    "num_envs": int, "frames_per_batch": int, "minibatch_size": int, "test_episodes": int, "device": str, "threads": int,
}


def run_overrides(args: argparse.Namespace, size: Size, protocol: str, seed: int) -> list[str]:
    """The Hydra overrides of one run (``preset=real_chat`` with the warm start, sized by ``size``)."""
    out = Path(args.out).resolve()
    template = [] if args.chat_template is None else [f"scenario.default_agent.chat_template={args.chat_template}"]
    test_batch = min(size.test_episodes, size.num_envs * 4)
    return [
        "preset=real_chat",
        f"protocol={protocol}",
        *TURNS.get(protocol, ()),
        f"seed={seed}",
        f"scenario.default_agent.pretrained_path={args.model}",
        *template,
        f"scenario.num_lists={size.num_lists}",
        f"scenario.cache_dir={out / 'cache'}",
        "trainer.pretrain.agents=[*]",
        f"trainer.pretrain.epochs={size.pretrain_epochs}",
        f"trainer.pretrain.lr={size.pretrain_lr}",
        f"trainer.pretrain.minibatch_size={size.pretrain_minibatch}",
        f"trainer.pretrain.cache_dir={out / 'pretrained'}",
        f"trainer.num_iterations={size.iterations}",
        f"trainer.num_envs={size.num_envs}",
        f"trainer.frames_per_batch={size.frames_per_batch}",
        f"trainer.minibatch_size={size.minibatch_size}",
        "trainer.num_epochs=1",
        f"trainer.eval.every={size.iterations}",  # one evaluation, after the last iteration (the report's curve)
        f"trainer.eval.num_episodes={min(size.test_episodes, 16)}",
        f"trainer.num_test_episodes={size.test_episodes}",
        f"trainer.test_batch_episodes={test_batch}",
        f"run.device={size.device}",
        f"run.num_threads={size.threads}",
        "run.progress_bar=false",
        "logger=csv",
        "logger.diagnostics_every=0",  # two more scoring passes an iteration, not needed here
        f"hydra.run.dir={out / f'{protocol}_seed{seed}'}",
        *args.overrides,
    ]


def run_one(args: argparse.Namespace, size: Size, protocol: str, seed: int) -> dict:
    """Run (or reuse) one run; return its row: seed, protocol, metrics, wall time and load, or its error."""
    folder = Path(args.out) / f"{protocol}_seed{seed}"
    row_file = folder / "real_nip_vs_solo.json"
    if (folder / SUMMARY_FILE).is_file() and row_file.is_file():
        return json.loads(row_file.read_text())
    if folder.exists():
        folder.rename(folder.with_name(f"{folder.name}.incomplete.{int(time.time())}"))
    command = [sys.executable, "-m", "nip_like", *run_overrides(args, size, protocol, seed)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(size.threads), "HF_HUB_OFFLINE": "1"}
    print(f"running {protocol} seed {seed}", flush=True)
    load_before, started = os.getloadavg()[0], time.time()
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    row = {
        "protocol": protocol,
        "seed": seed,
        "wall_seconds": round(time.time() - started, 1),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
    }
    if result.returncode or not (folder / SUMMARY_FILE).is_file():
        lines = result.stderr.strip().splitlines()
        return {**row, "error": lines[-1] if lines else f"exit status {result.returncode}"}
    summary = json.loads((folder / SUMMARY_FILE).read_text())
    metrics = summary["test_metrics"]
    row.update(
        metrics={name: metrics[name] for name in METRICS if name in metrics},
        warm_start=warm_start_metrics(folder),
        frames=summary.get("frames"),
        train_seconds=summary.get("train_seconds"),
    )
    row_file.write_text(json.dumps(row, indent=2) + "\n")
    return row


def warm_start_metrics(folder: Path) -> dict[str, float]:
    """A finished run's warm-start figures (``pretrain/...`` and ``timers/pretrain``, logged with its first iteration)."""
    scalars = folder / "metrics" / "scalars"
    names = [path.relative_to(scalars).with_suffix("").as_posix() for path in sorted((scalars / "pretrain").rglob("*.csv"))]
    if (scalars / "timers" / "pretrain.csv").is_file():
        names.append("timers/pretrain")
    return {name: read_csv_metric(folder, name)[-1][1] for name in names}


def runs_table(rows: list[dict], size: Size) -> str:
    """The Markdown table of every run: test accuracy, decided rate, warm start, wall time and load."""
    lines = [
        f"Lists: {size.num_lists} (80% train); warm-start epochs: {size.pretrain_epochs}, at lr {size.pretrain_lr}; "
        f"PPO iterations: {size.iterations}, of {size.frames_per_batch} frames; held-out test lists: {size.test_episodes}; "
        f"device {size.device}, {size.threads} threads.",
        "",
        "| protocol | seed | test accuracy | test decided | verifier warm start: demonstrations reproduced | warm start "
        "| frames | wall time | load (start, end) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['protocol']} | {row['seed']} | failed: {row['error']} | | | | | {row['wall_seconds'] / 60:.1f} min | |")
            continue
        metrics, warm = row["metrics"], row["warm_start"]
        reproduced = warm.get("pretrain/verifier/val_accuracy", warm.get("pretrain/verifier/train_accuracy"))
        warm_minutes = f"{warm['timers/pretrain'] / 60:.1f} min" if "timers/pretrain" in warm else ""
        lines.append(
            f"| {row['protocol']} | {row['seed']} | {metrics['test/accuracy']:.3f} | {metrics.get('test/decided', float('nan')):.3f} "
            f"| {'' if reproduced is None else f'{reproduced:.3f}'} | {warm_minutes} | {row['frames']} | {row['wall_seconds'] / 60:.1f} min "
            f"| {row['load_before']}, {row['load_after']} |"
        )
    return "\n".join(lines)


def comparison(out: Path) -> tuple[str, dict]:
    """The project's comparison report of the runs under ``out`` (protocols compared on ``test/accuracy``)."""
    options = ReportOptions(
        metrics=list(METRICS),
        primary_metric="test/accuracy",
        curve_metric="eval/accuracy",
        threshold=0.75,
        objective_keys=("protocol.name",),
        task_keys=("scenario.name",),
        objectives=PROTOCOLS,
        plots=False,
    )
    report = build_report(find_runs([out]), options, roots=[out])
    write_report(report, out / "report")
    rows = {"summary": [row for task in report.tasks for row in task.summary],
            "metrics": [row for task in report.tasks for row in task.metrics]}
    return format_markdown(report), rows


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Size]:
    """The command line, and the run size it chooses."""
    parser = argparse.ArgumentParser(
        prog="python scripts/real_nip_vs_solo.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=REAL_MODEL, help="a model folder or a .gguf file (default: the tests' Gemma 3 270M)")
    parser.add_argument("--chat-template", default="gemma", help="gemma (default), chatml, llama3, a file, or none: the folder's own")
    parser.add_argument("--size", default="cpu", choices=sorted(SIZES), help="the figures of every run (default: cpu)")
    parser.add_argument("--seeds", nargs="+", type=int, help="seeds (default: the size's)")
    parser.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS, help="protocols to run now")
    parser.add_argument("--out", default="outputs/real_nip_vs_solo", help="folder of the runs and the tables")
    for name, kind in SIZE_OPTIONS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"override the size's {name}")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    if args.chat_template == "none":
        args.chat_template = None
    model = Path(args.model).expanduser()
    if not model.exists():
        parser.error(f"--model {args.model}: no such file or folder (a model folder or a .gguf file)")
    args.model = str(model.resolve())
    size = replace(SIZES[args.size], **{name: getattr(args, name) for name in SIZE_OPTIONS if getattr(args, name) is not None})
    if args.seeds:
        size = replace(size, seeds=tuple(args.seeds))
    small = {name: value for name, value in asdict(size).items() if isinstance(value, (int, float)) and not isinstance(value, bool)
             and value <= 0}
    if small:
        parser.error(f"sizes must be positive, got {small}")
    return args, size


def main(argv: list[str] | None = None) -> dict:
    """Run what is missing, write and print the tables; return what ``results.json`` holds."""
    args, size = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run_one(args, size, protocol, seed) for seed in size.seeds for protocol in args.protocols]
    failed = [row for row in rows if "error" in row]
    for row in failed:
        print(f"failed: {row['protocol']} seed {row['seed']}: {row['error']}", file=sys.stderr)
    text = runs_table(rows, size)
    report_text, report_rows = "", {}
    done = {row["protocol"] for row in rows if "error" not in row}
    if done == set(PROTOCOLS):
        with report_errors():
            report_text, report_rows = comparison(out)
    else:
        report_text = f"No comparison: runs of both {' and '.join(PROTOCOLS)} are needed; finished here: {sorted(done)}.\n"
    accuracies = {
        protocol: [row["metrics"]["test/accuracy"] for row in rows if row["protocol"] == protocol and "error" not in row]
        for protocol in PROTOCOLS
    }
    means = {protocol: statistics.mean(values) for protocol, values in accuracies.items() if values}
    (out / "results.md").write_text(f"{text}\n\n{report_text}")
    results = {"size": asdict(size), "model": args.model, "runs": rows, "mean_test_accuracy": means, "report": report_rows}
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(text)
    print()
    print(report_text)
    if failed:
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
