"""``python -m nip_like.export RUN_DIR``: each language-model agent of a run as a standalone Hugging Face folder.

A run saves every LM agent beside each checkpoint, under
``checkpoints/<best|last>/<agent>/``: the whole model for an agent trained in
full, the adapters only (``adapter_config.json``, ``adapter_model.safetensors``)
for an agent trained with LoRA, with the base they go on named in
``adapter_config.json`` (the run's ``pretrained_path`` folder, or the agent
folder's own ``base/`` for a base built from config or fitted in a warm
start). This command writes, for each agent, a folder that needs nothing
else: the LoRA adapters merged into a copy of the base model's weights, or a
copy of a full agent, with the tokenizer and the value head. Load it with
``AutoModelForCausalLM.from_pretrained``, or start a run from it
(``scenario.agents.<name>.pretrained_path``).

The checkpoint file itself (``checkpoints/<best|last>.pt``), when the run
has it, is checked first (its size and SHA-256, as a resume checks it): a
damaged one is refused in one line, since the agent folders beside it belong
to that checkpoint; its contents are not otherwise used. Every agent folder
(and base folder) is then compared with its ``checksums.json``: a file that
differs is refused in one line naming it, and nothing is written. The agent folders of runs before nip_like saved a
from-config base beside the adapters name no base: for them the base is
rebuilt from the run's config and seed, as ``python -m nip_like.evaluate``
rebuilds it. Bad input is one line ``error: ...`` with exit status 2; nothing
of the run is changed.

Examples
--------
``python -m nip_like.export outputs/2026-11-24/10-00-00_duplicates_nip``
``python -m nip_like.export RUN_DIR --checkpoint last --out exported/``
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path

from nip_like.checkpoint import check_manifest, load_checked
from nip_like.cli import OneLineArgumentParser, report_errors
from nip_like.errors import CheckpointError, ConfigError
from nip_like.lm.agent_folders import (
    ADAPTER_CONFIG,
    BASE_FOLDER,
    checked_agent_folder,
    save_agent,
    write_standalone,
)

#: Checkpoints whose agents a run saves.
CHECKPOINTS = ("best", "last")


def agent_folders(run_dir: Path, checkpoint: str) -> list[Path]:
    """The agent folders saved beside checkpoint ``checkpoint`` of ``run_dir``; a one-line error if none."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a run folder")
    folder = run_dir / "checkpoints" / checkpoint
    if not folder.is_dir():
        raise ConfigError(
            f"{run_dir} has no checkpoints/{checkpoint}/ folder of language-model agents "
            f"(only runs of LM agents save them; checkpoints: best, last)"
        )
    agents = sorted(path for path in folder.iterdir() if path.is_dir() and not path.name.startswith("."))
    if not agents:
        raise ConfigError(f"{folder} holds no agent folders")
    return agents


def check_checkpoint_file(run_dir: Path, checkpoint: str) -> None:
    """Refuse, in one line, a damaged ``checkpoints/<checkpoint>.pt`` (cut short, changed, not nip_like's); none is not refused.

    Raises
    ------
    CheckpointError
        Naming the file and what is wrong with it, and that nothing was exported.
    """
    path = run_dir / "checkpoints" / f"{checkpoint}.pt"
    if not path.is_file():
        return
    try:
        load_checked(path, what="checkpoint")
    except CheckpointError as error:
        raise CheckpointError(f"{error}; nothing was exported (its agent folders belong to it)") from error


def names_no_base(folder: Path) -> bool:
    """Whether ``folder`` holds adapters whose config names no base (a from-config base that older runs did not save)."""
    path = folder / ADAPTER_CONFIG
    if not path.is_file() or (folder / BASE_FOLDER / "config.json").is_file():
        return False
    try:
        return not json.loads(path.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{path} cannot be read ({type(error).__name__}): it is damaged or not a peft adapter config") from error


def rebuilt_bases(run_dir: Path, checkpoint: str, names: list[str], stack: ExitStack) -> dict[str, Path]:
    """The from-config bases of agents ``names``, rebuilt from the run's config and seed, in a scratch folder kept open by ``stack``."""
    from nip_like.evaluate import rebuilt_trainer

    trainer, _, scratch = stack.enter_context(rebuilt_trainer(run_dir, checkpoint))
    bases = {}
    for name in names:
        policy = trainer.policy.policy(name)
        saved = save_agent(scratch / "rebuilt" / name, policy.model, policy.tokenizer, with_base=True)
        bases[name] = saved / BASE_FOLDER
    return bases


def export_run(run_dir: Path, checkpoint: str = "last", out: Path | None = None) -> list[Path]:
    """Write each agent saved beside checkpoint ``checkpoint`` of ``run_dir`` as a standalone folder; return them.

    Parameters
    ----------
    run_dir : Path
        A run folder of language-model agents.
    checkpoint : str
        ``best`` or ``last``.
    out : Path, optional
        Where to write one folder per agent (default:
        ``RUN_DIR/exported/<checkpoint>``).

    Returns
    -------
    list of Path
        The folders written, one per agent.

    Raises
    ------
    ConfigError
        If the run has no such checkpoint folder, or an adapter folder names
        a base that is not a local folder.
    CheckpointError
        If the checkpoint file is damaged (:func:`check_checkpoint_file`) or
        a file of an agent or base folder differs from its
        ``checksums.json``; nothing is written then.
    """
    if checkpoint not in CHECKPOINTS:
        raise ConfigError(f"--checkpoint must be best or last, got {checkpoint!r}")
    run_dir = Path(run_dir)
    folders = agent_folders(run_dir, checkpoint)
    check_checkpoint_file(run_dir, checkpoint)
    out = Path(out) if out is not None else run_dir / "exported" / checkpoint
    for folder in folders:  # every agent folder is whole before any of its files is read
        check_manifest(folder, "agent folder")
    with ExitStack() as stack:
        missing = [folder.name for folder in folders if names_no_base(folder)]
        bases = rebuilt_bases(run_dir, checkpoint, missing, stack) if missing else {}
        for folder in folders:  # every base folder too, before the first agent is written
            if folder.name not in bases:
                bases[folder.name] = checked_agent_folder(folder, "nip_like.export")
        return [write_standalone(folder, out / folder.name, bases[folder.name]) for folder in folders]


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = OneLineArgumentParser(
        prog="python -m nip_like.export",
        usage="%(prog)s RUN_DIR [--checkpoint best|last] [--out DIR]",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("run_dir", type=Path, help="the run folder")
    parser.add_argument("--checkpoint", default="last", help="best or last (default: last)")
    parser.add_argument("--out", type=Path, help="where to write one folder per agent (default: RUN_DIR/exported/<checkpoint>)")
    args = parser.parse_args(argv)
    with report_errors():
        written = export_run(args.run_dir, args.checkpoint, args.out)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
