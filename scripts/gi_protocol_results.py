"""Train every graph-isomorphism protocol with PPO over several seeds and tabulate held-out accuracy.

Each (protocol, seed) is one ``python -m nip_like`` run of the chosen preset
(``quick`` by default) in its own folder under ``--out``; up to ``--jobs``
run at once, each on one thread. A run whose ``summary.json`` exists is not
run again, so an interrupted call can simply be repeated. The table (Markdown,
printed and written to ``<out>/results.md``, with ``results.json``) gives per
protocol the mean, standard deviation, minimum and maximum of the final
held-out test accuracy over seeds, the mean share of test datapoints the
verifier decided wrong in every episode (``test/always_wrong``, the NIP
paper's second measure: pass ``trainer.test_rollouts=N`` to play each test
datapoint N times), the mean share of faithful answers of the
prover that argues for acceptance (``prover`` or ``prover0``; see the
scenario's ``faithful_answers`` metric) and the mean episode length, the
frames and the mean wall time of a run, beside the final accuracies the NIP
paper reports.

Run it from the repository root::

    python scripts/gi_protocol_results.py                                  # quick preset, 5 seeds, every proof protocol
    python scripts/gi_protocol_results.py --protocols nip solo_verifier --seeds 0 1 2 --jobs 2
    python scripts/gi_protocol_results.py --preset paper_fast --out outputs/gi_paper_fast trainer.num_iterations=1500

``--target 0.9`` adds a column: the wall time until the validation accuracy
first reached 0.9 (the warm start, ``timers/pretrain``, plus the iterations up
to that evaluation, ``timers/iteration``), the mean and the slowest seed.
``--require PROTOCOL=ACCURACY`` (repeatable) fails the call (exit status 1) unless
every seed of that protocol reaches the test accuracy, and ``--require-gap
PROTOCOL=GAP`` unless its mean test accuracy is at least that far above the
solo verifier's: together they check a claim, such as the main job's::

    python scripts/gi_protocol_results.py --protocols nip solo_verifier --seeds 0 1 2 3 4 \
        --require nip=0.85 --require-gap nip=0.10

``--require-seed-gap PROTOCOL=GAP`` fails it unless every seed of the
protocol is that far above the solo verifier's run of the same seed. The
script takes any preset of a proof scenario; the language-model chat view's
claim (docs: own_language_model)::

    python scripts/gi_protocol_results.py --preset lm_chat --protocols nip solo_verifier --seeds 0 1 2 \
        --out outputs/lm_chat --require-seed-gap nip=0.2

With ``--plots`` it also draws, from the runs' CSV metrics, the validation
accuracy against frames (``<out>/curves_accuracy.png``, one colour per
protocol, the mean over seeds with a 95% bootstrap band) and the share of
faithful answers of the prover that argues for acceptance
(``<out>/curves_faithful_prover.png`` for the protocols with one prover,
``curves_faithful_prover0.png`` for those with two).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from nip_like.protocols.proof import ProofProtocol  # noqa: E402
from nip_like.registry import PROTOCOLS as REGISTERED_PROTOCOLS  # noqa: E402

#: Every registered interactive-proof protocol (the graph-isomorphism scenario takes those).
PROTOCOLS = REGISTERED_PROTOCOLS.names(subclass_of=ProofProtocol)
#: Final test accuracy reported by Hammond and Adam-Day (NIP paper), graph isomorphism: published data.
PAPER = {
    "nip": 0.945,
    "adp": 0.61,
    "debate": 0.64,
    "mnip": 0.67,
}


#: The presets of the graph-isomorphism scenario (the table's NIP-paper column applies to them only).
GRAPH_PRESETS = ("smoke", "quick", "paper_fast", "paper")


def run_one(args: argparse.Namespace, protocol: str, seed: int) -> dict:
    """Run (or reuse) one training run; return its summary, or the error."""
    folder = Path(args.out) / f"{protocol}_seed{seed}"
    summary = folder / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text())
    if folder.exists():
        folder.rename(folder.with_name(f"{folder.name}.incomplete.{int(time.time())}"))
    command = [
        sys.executable, "-m", "nip_like", f"preset={args.preset}", f"protocol={protocol}", f"seed={seed}",
        "run.num_threads=1", "run.progress_bar=false", f"hydra.run.dir={folder}", *args.overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode or not summary.is_file():
        lines = result.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit status {result.returncode}"}
    return json.loads(summary.read_text())


#: The prover whose answers are judged: the one that argues for acceptance.
ACCEPT_PROVERS = ("prover", "prover0")


def _mean_metric(runs: list[dict], names: tuple[str, ...]) -> str:
    """Mean over runs of the first test metric of ``names`` each run has, formatted; empty if none has one."""
    values = []
    for run in runs:
        found = [run["test_metrics"][name] for name in names if name in run["test_metrics"]]
        values += found[:1]
    return f"{statistics.mean(values):.2f}" if values else ""


def _logged(folder: Path, metric: str) -> list[tuple[int, float]]:
    """A run's ``(step, value)`` rows of ``metric``; none if the run did not log it."""
    from nip_like.logging import read_csv_metric

    if not (folder / "metrics" / "scalars" / f"{metric}.csv").is_file():
        return []
    return read_csv_metric(folder, metric)


def seconds_to_target(folder: Path, target: float) -> float | None:
    """Wall seconds until a run's validation accuracy first reached ``target`` (warm start included); None if never."""
    reached = [step for step, value in _logged(folder, "eval/accuracy") if value >= target]
    if not reached:
        return None
    pretrain = sum(value for _, value in _logged(folder, "timers/pretrain"))
    return pretrain + sum(value for step, value in _logged(folder, "timers/iteration") if step <= reached[0])


def _time_to_target(runs: list[dict], target: float) -> str:
    """Mean and slowest :func:`seconds_to_target` of ``runs`` (minutes), or how many never reached it."""
    times = [run.get("seconds_to_target") for run in runs]
    reached = [value for value in times if value is not None]
    if not reached:
        return "never"
    text = f"{statistics.mean(reached) / 60:.1f} (max {max(reached) / 60:.1f}) min"
    return text if len(reached) == len(times) else f"{text}; {len(times) - len(reached)} never"


def check_claims(
    results: dict[str, list[dict]], required: dict[str, float], gaps: dict[str, float], seed_gaps: dict[str, float] | None = None
) -> list[str]:
    """The claims of ``--require``, ``--require-gap`` and ``--require-seed-gap`` that the results do not bear out, one line each."""
    failed = []

    def accuracies(protocol: str) -> list[float]:
        return [run["test_metrics"]["test/accuracy"] for run in results.get(protocol, []) if "error" not in run]

    for protocol, bar in required.items():
        runs = results.get(protocol, [])
        below = [f"seed {run['seed']}: {run['test_metrics']['test/accuracy']:.3f}" for run in runs
                 if "error" not in run and run["test_metrics"]["test/accuracy"] < bar]
        broken = [f"seed {run['seed']}: failed" for run in runs if "error" in run]
        if not runs or below or broken:
            failed.append(f"{protocol}: every seed must reach {bar}; " + (", ".join(below + broken) or "no runs"))
    for protocol, gap in gaps.items():
        mine, solo = accuracies(protocol), accuracies("solo_verifier")
        if not mine or not solo:
            failed.append(f"{protocol}: the gap to solo_verifier needs runs of both")
        elif statistics.mean(mine) - statistics.mean(solo) < gap:
            failed.append(
                f"{protocol}: mean {statistics.mean(mine):.3f} is not {gap} above solo_verifier's {statistics.mean(solo):.3f}"
            )
    solo = {run["seed"]: run["test_metrics"]["test/accuracy"] for run in results.get("solo_verifier", []) if "error" not in run}
    for protocol, gap in (seed_gaps or {}).items():
        short = []
        for run in results.get(protocol, []):
            if "error" in run or run["seed"] not in solo:
                short.append(f"seed {run['seed']}: no run of both")
            elif run["test_metrics"]["test/accuracy"] - solo[run["seed"]] < gap:
                short.append(f"seed {run['seed']}: {run['test_metrics']['test/accuracy']:.3f} against {solo[run['seed']]:.3f}")
        if short or not results.get(protocol):
            failed.append(f"{protocol}: every seed must be {gap} above solo_verifier's same seed; " + (", ".join(short) or "no runs"))
    return failed


def table(results: dict[str, list[dict]], target: float | None = None, paper: bool = True) -> str:
    """The Markdown results table (with a time-to-``target`` column when ``target`` is given).

    ``paper``: fill the last column with the NIP paper's graph-isomorphism
    accuracies (leave it empty for presets of other scenarios).
    """
    extra = f" time to {target} val |" if target is not None else ""
    rows = [
        "| protocol | test accuracy, mean ± sd | min | max | always wrong | faithful answers | episode length | seeds "
        f"| frames per run | wall time per run |{extra} NIP paper |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if target is not None else "") + "---|",
    ]
    faithful = tuple(f"test/agents/{name}/faithful_answers" for name in ACCEPT_PROVERS)
    for protocol, runs in results.items():
        done = [run for run in runs if "error" not in run]
        if not done:
            rows.append(f"| {protocol} | failed | | | | | | 0 | | |{' |' if target is not None else ''} {PAPER.get(protocol, '') if paper else ''} |")
            continue
        accuracy = [run["test_metrics"]["test/accuracy"] for run in done]
        spread = statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0
        seconds = statistics.mean(run["train_seconds"] + run.get("pretrain_seconds", 0.0) for run in done)
        reach = f" {_time_to_target(done, target)} |" if target is not None else ""
        rows.append(
            f"| {protocol} | {statistics.mean(accuracy):.3f} ± {spread:.3f} | {min(accuracy):.3f} | "
            f"{max(accuracy):.3f} | {_mean_metric(done, ('test/always_wrong',))} | {_mean_metric(done, faithful)} | "
            f"{_mean_metric(done, ('test/episode_length',))} | {len(done)} | {done[0]['frames']:,} | "
            f"{seconds / 60:.1f} min |{reach} {PAPER.get(protocol, '') if paper else ''} |"
        )
    return "\n".join(rows)


#: The curves ``--plots`` draws: file name and metric (protocols whose runs do not log it are left out).
CURVES = {
    "curves_accuracy.png": "eval/accuracy",
    **{f"curves_faithful_{name}.png": f"eval/agents/{name}/faithful_answers" for name in ACCEPT_PROVERS},
}


def plot(out: Path, protocols: list[str], seeds: list[int]) -> list[Path]:
    """Draw the learning curves of the finished runs under ``out``; return the PNG files written."""
    from nip_like.analysis.groups import Group
    from nip_like.analysis.plots import plot_learning_curves
    from nip_like.analysis.runs import Run

    folders = {protocol: [out / f"{protocol}_seed{seed}" for seed in seeds] for protocol in protocols}
    runs = {
        protocol: [Run.load(folder) for folder in found if (folder / "summary.json").is_file()]
        for protocol, found in folders.items()
    }
    written = []
    for name, metric in CURVES.items():
        groups = []
        for protocol, found in runs.items():
            logged = [run for run in found if (run.folder / "metrics" / "scalars" / f"{metric}.csv").is_file()]
            if logged:
                groups.append(Group("graph isomorphism", protocol, logged))
        if groups:
            written.append(plot_learning_curves({"graph isomorphism": groups}, metric, "frames", out / name))
    return written


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    """Run the grid, print and write the table, return the summaries."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protocols", nargs="+", default=PROTOCOLS, choices=PROTOCOLS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--preset", default="quick", help="config preset of every run (quick, paper_fast or paper)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--out", default="outputs/gi_protocol_results", help="folder of the runs and the table")
    parser.add_argument("--plots", action="store_true", help="also draw the learning curves")
    parser.add_argument("--target", type=float, help="add the wall time until the validation accuracy reached this")
    parser.add_argument("--require", action="append", default=[], metavar="PROTOCOL=ACCURACY",
                        help="fail unless every seed of PROTOCOL reaches this test accuracy")
    parser.add_argument("--require-gap", action="append", default=[], metavar="PROTOCOL=GAP",
                        help="fail unless PROTOCOL's mean test accuracy is this far above solo_verifier's")
    parser.add_argument("--require-seed-gap", action="append", default=[], metavar="PROTOCOL=GAP",
                        help="fail unless every seed of PROTOCOL is this far above solo_verifier's run of the same seed")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    required, gaps = _claims(parser, args.require, "--require"), _claims(parser, args.require_gap, "--require-gap")
    seed_gaps = _claims(parser, args.require_seed_gap, "--require-seed-gap")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    grid = [(protocol, seed) for protocol in args.protocols for seed in args.seeds]
    started = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        outcomes = list(pool.map(lambda job: run_one(args, *job), grid))
    results: dict[str, list[dict]] = {protocol: [] for protocol in args.protocols}
    for (protocol, seed), outcome in zip(grid, outcomes):
        folder = Path(args.out) / f"{protocol}_seed{seed}"
        if "error" not in outcome:
            outcome = {**outcome, **_timings(folder, args.target)}
        results[protocol].append({"seed": seed, **outcome})
        if "error" in outcome:
            print(f"failed: {protocol} seed {seed}: {outcome['error']}", file=sys.stderr)
    text = table(results, args.target, paper=args.preset in GRAPH_PRESETS)
    print(text)
    print(f"\n{len(grid)} runs, {(time.perf_counter() - started) / 60:.1f} min in this call")
    (Path(args.out) / "results.md").write_text(text + "\n")
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if args.plots:
        for path in plot(Path(args.out), args.protocols, args.seeds):
            print(f"wrote {path}")
    failed = check_claims(results, required, gaps, seed_gaps)
    for line in failed:
        print(f"claim not met: {line}", file=sys.stderr)
    if failed:
        raise SystemExit(1)
    return results


def _claims(parser: argparse.ArgumentParser, values: list[str], option: str) -> dict[str, float]:
    """``PROTOCOL=NUMBER`` arguments of ``option`` as a dict (a parser error names a bad one)."""
    claims = {}
    for value in values:
        protocol, _, number = value.partition("=")
        try:
            claims[protocol] = float(number)
        except ValueError:
            parser.error(f"{option} takes PROTOCOL=NUMBER, got {value!r}")
        if protocol not in PROTOCOLS:
            parser.error(f"{option} names {protocol!r}; the protocols are {PROTOCOLS}")
    return claims


def _timings(folder: Path, target: float | None) -> dict[str, float | None]:
    """A finished run's warm-start seconds and, with ``target``, its :func:`seconds_to_target`."""
    timings: dict[str, float | None] = {"pretrain_seconds": sum(value for _, value in _logged(folder, "timers/pretrain"))}
    if target is not None:
        timings["seconds_to_target"] = seconds_to_target(folder, target)
    return timings


if __name__ == "__main__":
    main()
