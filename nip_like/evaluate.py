"""``python -m nip_like.evaluate RUN_DIR``: test a run's saved agents again, on any split or data file.

Rebuilds the run's trainer from its own config (``RUN_DIR/config.yaml``), loads
a checkpoint (by default the one the run's test loop used: ``best`` when
``trainer.eval.test_checkpoint=best``, else ``last``) and runs the trainer's
own test loop on the chosen split, or on every example of a dataset file in
the scenario's format. The checkpoint and the agent folders saved beside it
are checked first (their checksums): a damaged file is refused in one line.
A cache entry the run used (its ``caches.json``) that has changed or is gone
since is named in one ``warning: ...`` line each; the evaluation goes on.
On the test split with the run's seed it reproduces the run's logged test
metrics exactly. Nothing of the run is changed: the metrics
and transcripts go to ``RUN_DIR/evaluations/<checkpoint>-<split or file>.json``
(and ``.jsonl`` beside it) or to ``--out``, written atomically. Only run
settings may be overridden (``run.device=cuda``); bad input is one line
``error: ...`` with exit status 2.

Examples
--------
``python -m nip_like.evaluate outputs/2026-11-23/10-00-00_duplicates_nip``
``python -m nip_like.evaluate RUN_DIR --checkpoint last --split val``
``python -m nip_like.evaluate RUN_DIR --data lists.pt --episodes 2000 run.device=cuda``
"""

from __future__ import annotations

import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from nip_like import start_up

if __name__ == "__main__":  # before the imports below: the collector waits until the trainer is built (nip_like.start_up)
    start_up.pause_for_start_up()

from nip_like import cache_record  # noqa: E402 - after the pause above
from nip_like.checkpoint import check_checkpoint_folders, load_checked, write_text_atomic
from nip_like.cli import OneLineArgumentParser, report_errors
from nip_like.config import run_id
from nip_like.errors import CheckpointError, ConfigError
from nip_like.experiment import build_trainer, format_metrics
from nip_like.resume import load_run_config

#: Checkpoints a run writes; "tested" is the one its test loop used.
CHECKPOINTS = ("tested", "best", "last")
#: Where evaluations go inside the run folder.
EVALUATIONS_DIR = "evaluations"


def tested_checkpoint(config) -> str:
    """The checkpoint a run's test loop evaluated: ``best`` or ``last``."""
    chosen = config.trainer.get("eval", {}).get("test_checkpoint", "final")
    return "best" if chosen == "best" else "last"


@contextmanager
def rebuilt_trainer(run_dir: Path, checkpoint: str = "tested", overrides: list[str] | None = None) -> Iterator[tuple[Any, str, Path]]:
    """A run's trainer, rebuilt from its own config, with a checkpoint's state loaded; nothing of the run is changed.

    The checkpoint's file is checked (:func:`~nip_like.checkpoint.load_checked`)
    and so are the agent folders saved beside it, against their
    ``checksums.json``, before anything is built; each cache entry the run
    recorded (``caches.json``, :mod:`nip_like.cache_record`) that has changed
    or is gone since is named in one ``warning: ...`` line on standard error.
    A run with ``run.fresh_cache`` reads its own caches (``RUN_DIR/cache/``).
    Warm starts are skipped, nothing is logged, and the trainer writes only in
    a scratch folder that is removed on leaving. A LoRA base fitted in the
    warm start, which the checkpoint file leaves out, is read from the agent's
    folder (``base/``).

    Parameters
    ----------
    run_dir : Path
        A run folder written by ``python -m nip_like``.
    checkpoint : str
        ``tested`` (the checkpoint the run's test used), ``best`` or ``last``.
    overrides : list of str, optional
        ``run.*`` settings, ``key=value``.

    Yields
    ------
    trainer : Trainer
        The trainer, its state the checkpoint's.
    name : str
        The checkpoint loaded: ``best`` or ``last``.
    scratch : Path
        The trainer's scratch run folder.
    """
    run_dir = Path(run_dir)
    if checkpoint not in CHECKPOINTS:
        raise ConfigError(f"--checkpoint must be one of {list(CHECKPOINTS)}, got {checkpoint!r}")
    for item in overrides or []:
        if not item.startswith("run."):
            raise ConfigError(f"cannot override {item!r} when evaluating: only run.* settings (key=value) may change")
    config = load_run_config(run_dir, overrides)
    expected_id = run_id(config)
    name = tested_checkpoint(config) if checkpoint == "tested" else checkpoint
    path = run_dir / "checkpoints" / f"{name}.pt"
    if not path.is_file():
        found = sorted(p.stem for p in (run_dir / "checkpoints").glob("*.pt"))
        raise CheckpointError(f"{run_dir} has no {name} checkpoint (checkpoints/{name}.pt); it has {found or 'none'}")
    state = load_checked(path, expected_id)
    check_checkpoint_folders(run_dir / "checkpoints" / name)  # the agents saved with it: a damaged file is refused too
    cache_record.warn_changes(run_dir)  # the data the run played may differ now: said, not refused
    fresh = run_dir / cache_record.FRESH_FOLDER if config.run.get("fresh_cache") else None
    # The agents come from the checkpoint: skip warm starts, log nothing, write nowhere in the run.
    if "pretrain" in config.trainer:  # the RL trainers' warm start; a text trainer's state is past its own
        config.trainer.pretrain.agents = []
    config.logger.backends = []
    config.logger.print_metrics = False
    config.run.test_run = False
    with tempfile.TemporaryDirectory(prefix="nip_like_evaluate_") as scratch, cache_record.recording(fresh_root=fresh):
        trainer = build_trainer(config, Path(scratch))
        trainer.load_state_dict(state["trainer"])
        restore_fitted_bases(trainer, run_dir / "checkpoints" / name)
        yield trainer, name, Path(scratch)


def restore_fitted_bases(trainer: Any, folder: Path) -> None:
    """Load into each LM agent whose LoRA base was fitted in the warm start that base, from its folder beside the checkpoint.

    The checkpoint file leaves frozen weights out, and the warm start that
    fitted them is skipped here: the agent's folder (``base/``) holds them.
    Other agents (graph networks, bases loaded or built from config) are left
    as built.
    """
    from nip_like.lm.agent_folders import load_saved_base

    actor = getattr(trainer, "policy", None)
    for agent in getattr(actor, "agent_names", ()) if hasattr(actor, "save_pretrained") else ():
        policy = actor.policy(agent)
        if policy.fitted_base and policy.policy_owner is None:  # an agent playing another's model gets its base with it
            load_saved_base(policy.model, folder / agent)


def evaluate_run(
    run_dir: Path,
    checkpoint: str = "tested",
    split: str = "test",
    data: Path | None = None,
    episodes: int | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint of a finished (or running) run; return the metrics and what was evaluated.

    Parameters
    ----------
    run_dir : Path
        A run folder written by ``python -m nip_like``.
    checkpoint : str
        ``tested`` (the checkpoint the run's test used), ``best`` or ``last``.
    split : str
        The data split to play (a scenario's ``train``, ``val``, ``test``).
    data : Path, optional
        A dataset file in the scenario's format; its examples replace ``split``.
    episodes : int, optional
        Test episodes (default: the run's own number, as its test played).
    overrides : list of str, optional
        ``run.*`` settings, ``key=value``.

    Returns
    -------
    dict
        ``"metrics"`` (named ``test/...`` on the test split, else after the
        split or ``data``), ``"checkpoint"``, ``"split"``, ``"data"``,
        ``"episodes"``, ``"transcripts"`` (the records written, if any).

    Raises
    ------
    CheckpointError
        If the checkpoint is missing, damaged or of another run, or a file of
        an agent folder saved with it differs from its ``checksums.json``.
    """
    if episodes is not None and episodes < 1:
        raise ConfigError(f"--episodes must be at least 1, got {episodes}")
    with rebuilt_trainer(Path(run_dir), checkpoint, overrides) as (trainer, name, scratch):
        examples = trainer.scenario.use_dataset_file(data, split) if data is not None else None
        trainer.test_split = split  # the test refuses an unknown split in one line
        if episodes is not None:
            trainer.test_episodes = int(episodes)
        metrics = trainer.test()
        transcripts_file = scratch / "transcripts" / "test.jsonl"
        transcripts = transcripts_file.read_text() if transcripts_file.is_file() else ""
        tested_episodes = trainer.test_episodes
    label = "data" if data is not None else split
    if label != "test":
        metrics = {f"{label}/{key.split('/', 1)[1]}": value for key, value in metrics.items()}
    return {
        "run_dir": str(run_dir),
        "checkpoint": name,
        "split": split,
        "data": str(data) if data is not None else None,
        "data_examples": examples,
        "episodes": tested_episodes,
        "metrics": metrics,
        "transcripts": transcripts,
    }


def write_evaluation(result: dict[str, Any], out: Path) -> None:
    """Write ``result`` as JSON to ``out`` and its transcripts, if any, to ``out`` with suffix ``.jsonl``."""
    transcripts = result.get("transcripts") or ""
    record = {key: value for key, value in result.items() if key != "transcripts"}
    write_text_atomic(json.dumps(record, indent=2, sort_keys=True) + "\n", out)
    if transcripts:
        write_text_atomic(transcripts, out.with_suffix(".jsonl"))


def default_output(run_dir: Path, result: dict[str, Any]) -> Path:
    """``RUN_DIR/evaluations/<checkpoint>-<split or data file stem>.json``."""
    source = Path(result["data"]).stem if result["data"] else result["split"]
    return Path(run_dir) / EVALUATIONS_DIR / f"{result['checkpoint']}-{source}.json"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = OneLineArgumentParser(
        prog="python -m nip_like.evaluate",
        usage="%(prog)s RUN_DIR [--checkpoint C] [--split S | --data FILE] [--episodes N] [--out FILE] [run.key=value ...]",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("run_dir", type=Path, help="the run folder")
    parser.add_argument("overrides", nargs="*", default=[], help="optional run.* settings, key=value (run.device=cuda)")
    parser.add_argument("--checkpoint", default="tested", help=f"one of {', '.join(CHECKPOINTS)} (default: tested)")
    parser.add_argument("--split", default="test", help="the data split to play (default: test)")
    parser.add_argument("--data", type=Path, help="a dataset file in the scenario's format, played instead of the split")
    parser.add_argument("--episodes", type=int, help="test episodes (default: as many as the run's test played)")
    parser.add_argument("--out", type=Path, help="the JSON file to write (default: RUN_DIR/evaluations/<checkpoint>-<split>.json)")
    args = parser.parse_args(argv)
    start_up.pause_for_start_up()  # until the trainer is built (nip_like.start_up)
    try:
        with report_errors():
            result = evaluate_run(args.run_dir, args.checkpoint, args.split, args.data, args.episodes, args.overrides)
            out = args.out or default_output(args.run_dir, result)
            write_evaluation(result, out)
    finally:
        start_up.start_up_over()
    source = f"data file {result['data']}" if result["data"] else f"split {result['split']}"
    print(f"Checkpoint {result['checkpoint']} of {args.run_dir} on the {source} ({out}):")
    print(format_metrics(result["metrics"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
