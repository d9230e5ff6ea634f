"""``python -m nip_like.analyse plot|message-regression RUN_DIR ...``: a run's curves, and analyses of its agents.

``plot``
    ``plot RUN_DIR [RUN_DIR ...] [METRIC ...]`` draws the learning curves of
    one run, or of several run folders side by side (finished or still
    running), one panel per metric: by default the main metrics the runs
    logged (:data:`~nip_like.analysis.run_curves.MAIN_METRICS`), against the
    iteration (``--x frames`` or ``--x seconds`` for the others). It writes
    ``curves.png`` and ``run.html`` into ``--out`` (default:
    ``<first RUN_DIR>/plots/``); the page holds the figure, each run's final
    metrics, config and latest transcripts
    (:mod:`nip_like.analysis.run_page`). An argument that is a folder is a
    run folder; the others are metrics.
``message-regression``
    Does the transcript carry the answer? Rebuilds the run's trainer from its
    own config with a checkpoint's agents (as ``python -m nip_like.evaluate``
    does, nothing of the run changed), plays the run's test episodes again,
    and fits a regressor per prover (and one on all provers together) that
    predicts each episode's label from that prover's messages alone, on a
    seeded share of the episodes; it scores the regressor on the rest, beside
    the majority-label baseline and the verifier's accuracy on the same
    episodes (:mod:`nip_like.analysis.message_regression`). The scores go to
    ``RUN_DIR/evaluations/message-regression-<checkpoint>.json`` (or
    ``--out``), written atomically, and are printed as a table. A scenario
    takes part when its messages can be read on their own (the
    :class:`~nip_like.scenarios.messaging.Messaging` capability); bad input is one line
    ``error: ...`` with exit status 2.

Examples
--------
``python -m nip_like.analyse plot outputs/2026-11-27/10-00-00_hidden_bits_prover_verifier``
``python -m nip_like.analyse plot RUN_A RUN_B eval/reward loss/policy --x frames``
``python -m nip_like.analyse message-regression outputs/2026-11-27/10-00-00_graph_isomorphism_nip``
``python -m nip_like.analyse message-regression RUN_DIR --checkpoint last --held-out 0.3 run.device=cuda``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

from nip_like.analysis.message_regression import RegressionOptions, RegressionScore, format_scores, regress_messages
from nip_like.analysis.run_curves import X_AXES, choose_metrics, open_run_folder, run_label, write_run_curves
from nip_like.analysis.run_page import write_run_page
from nip_like.checkpoint import write_text_atomic
from nip_like.cli import OneLineArgumentParser, report_errors
from nip_like.errors import ConfigError
from nip_like.evaluate import EVALUATIONS_DIR, rebuilt_trainer
from nip_like.registry import SCENARIOS
from nip_like.scenarios.messaging import Messaging

#: The analyses this command runs, by name.
ANALYSES = ("plot", "message-regression")

#: The files ``plot`` writes into its output folder.
PLOT_PNG = "curves.png"
PLOT_HTML = "run.html"


def _is_folder_argument(item: str) -> bool:
    """Whether a ``plot`` argument names a folder (a run) rather than a metric.

    A folder that exists, or a path that starts at the root, the home or the
    current folder, or under an existing folder (``outputs/...``): metric
    names never do.
    """
    path = Path(item).expanduser()
    return path.is_dir() or item.startswith(("/", ".", "~")) or (len(path.parts) > 1 and Path(path.parts[0]).is_dir())


def plot_runs(items: Sequence[str], out: Path | None = None, x_axis: str = "iteration") -> tuple[Path, Path, list[str]]:
    """Draw the curves of the run folders among ``items`` (the rest are metrics) and write the figure and page.

    Parameters
    ----------
    items : sequence of str
        Run folders and metric names, in any order (:func:`_is_folder_argument`).
    out : Path, optional
        The folder to write into (default: ``<first run folder>/plots``).
    x_axis : str
        ``iteration``, ``frames`` or ``seconds``.

    Returns
    -------
    (Path, Path, list of str)
        The PNG, the HTML page and the metrics drawn.

    Raises
    ------
    ReportError
        If no run folder is given, a folder is not a run's, or a metric is
        not logged.
    """
    folders = [Path(item).expanduser() for item in items if _is_folder_argument(item)]
    asked = [item for item in items if not _is_folder_argument(item)]
    if not folders:
        raise ConfigError(f"plot needs a run folder; {', '.join(repr(item) for item in items)} is not a folder")
    runs = [open_run_folder(folder) for folder in folders]
    metrics = choose_metrics(runs, asked)
    out = Path(out) if out is not None else folders[0] / "plots"
    png = write_run_curves(runs, metrics, x_axis, out / PLOT_PNG)
    html = write_run_page(runs, [run_label(run, runs) for run in runs], metrics, png, out / PLOT_HTML)
    return png, html, metrics


def message_regression(
    run_dir: Path,
    checkpoint: str = "tested",
    episodes: int | None = None,
    options: RegressionOptions | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Play a run's test episodes with a checkpoint's agents and regress the label on the provers' messages.

    Parameters
    ----------
    run_dir : Path
        A run folder written by ``python -m nip_like``.
    checkpoint : str
        ``tested`` (the checkpoint the run's test used), ``best`` or ``last``.
    episodes : int, optional
        Test episodes to play (default: as many as the run's test played).
    options : RegressionOptions, optional
        The held-out share, the seed and the fitting.
    overrides : list of str, optional
        ``run.*`` settings, ``key=value``.

    Returns
    -------
    dict
        ``run_dir``, ``checkpoint``, ``episodes``, ``label_share`` (the share
        of accept labels), ``verifier_accuracy`` (on every played episode),
        ``options`` and ``scores`` (one dict per regressor, see
        :class:`~nip_like.analysis.message_regression.RegressionScore`).

    Raises
    ------
    ConfigError
        If the scenario's messages cannot be read on their own, the protocol
        has no prover, or there are too few episodes to split.
    """
    options = options or RegressionOptions()
    if episodes is not None and episodes < 2:
        raise ConfigError(f"--episodes must be at least 2, got {episodes}")
    with rebuilt_trainer(Path(run_dir), checkpoint, overrides) as (trainer, name, _):
        scenario = trainer.scenario
        if not isinstance(scenario, Messaging):
            able = [name for name in SCENARIOS.names() if issubclass(SCENARIOS.get(name), Messaging)]
            raise ConfigError(
                f"scenario {scenario.config.name!r} does not lay out its messages for a regressor "
                f"(the Messaging capability); scenarios that do: {', '.join(able)}"
            )
        if not hasattr(trainer, "play_test_episodes"):
            raise ConfigError(f"trainer {trainer.config.trainer.trainer_type} plays no test episodes to read messages from")
        if episodes is not None:
            trainer.test_episodes = int(episodes)
        played = trainer.play_test_episodes()
        labels = scenario.episode_labels(played)
        correct = scenario.episode_correct(played)
        scores = regress_messages(scenario.message_features(played, trainer.policy), labels, correct, options)
    return {
        "run_dir": str(run_dir),
        "checkpoint": name,
        "episodes": int(labels.numel()),
        "label_share": float(labels.float().mean()),
        "verifier_accuracy": float(correct.float().mean()),
        "options": options.__dict__,
        "scores": [score.as_dict() for score in scores],
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = OneLineArgumentParser(
        prog="python -m nip_like.analyse",
        usage=(
            "%(prog)s plot RUN_DIR [RUN_DIR ...] [METRIC ...] [--x iteration|frames|seconds] [--out DIR]\n"
            "       %(prog)s message-regression RUN_DIR [--checkpoint C] [--episodes N] [--held-out F] [--seed S] "
            "[--out FILE] [run.key=value ...]"
        ),
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("analysis", help=f"one of {', '.join(ANALYSES)}")
    parser.add_argument("run_dir", type=Path, help="the run folder")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="plot: more run folders and the metrics to draw; message-regression: run.* settings, key=value",
    )
    parser.add_argument("--x", default="iteration", help=f"plot: the x axis, one of {', '.join(X_AXES)} (default: iteration)")
    parser.add_argument("--checkpoint", default="tested", help="tested, best or last (default: tested)")
    parser.add_argument("--episodes", type=int, help="test episodes to play (default: as many as the run's test played)")
    parser.add_argument("--held-out", type=float, default=RegressionOptions.held_out, help="share of episodes scored, not fitted (default: 0.2)")
    parser.add_argument("--seed", type=int, default=RegressionOptions.seed, help="seed of the split and the regressors (default: 0)")
    parser.add_argument("--epochs", type=int, default=RegressionOptions.epochs, help="passes over the fitting episodes (default: 60)")
    parser.add_argument(
        "--out",
        type=Path,
        help="plot: the folder to write into (default: RUN_DIR/plots); message-regression: the JSON file to write "
        "(default: RUN_DIR/evaluations/message-regression-<checkpoint>.json)",
    )
    args = parser.parse_args(argv)
    with report_errors():
        if args.analysis not in ANALYSES:
            raise ConfigError(f"unknown analysis {args.analysis!r}; choose one of {list(ANALYSES)}")
        if args.analysis == "plot":
            png, html, metrics = plot_runs([str(args.run_dir), *args.overrides], args.out, args.x)
            print(f"Curves of {', '.join(metrics)}: {png}; with the config, final metrics and transcripts: {html}")
            return 0
        options = RegressionOptions(held_out=args.held_out, seed=args.seed, epochs=args.epochs)
        result = message_regression(args.run_dir, args.checkpoint, args.episodes, options, args.overrides)
        out = args.out or Path(args.run_dir) / EVALUATIONS_DIR / f"message-regression-{result['checkpoint']}.json"
        write_text_atomic(json.dumps(result, indent=2, sort_keys=True) + "\n", out)
    print(
        f"Message regression, checkpoint {result['checkpoint']} of {args.run_dir}: {result['episodes']} test episodes, "
        f"{result['label_share']:.0%} accept labels, verifier accuracy {result['verifier_accuracy']:.3f} ({out})"
    )
    print(format_scores([RegressionScore(**item) for item in result["scores"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
