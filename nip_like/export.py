"""``python -m nip_like.export RUN_DIR``: each language-model agent of a run as a standalone Hugging Face folder.

A run saves every LM agent beside each checkpoint, under
``checkpoints/<best|last>/<agent>/``: the whole model for an agent trained in
full, the adapters only (``adapter_config.json``, ``adapter_model.safetensors``)
for an agent trained with LoRA. This command writes, for each agent, a folder
that needs nothing else: the LoRA adapters merged into a copy of the base
model's weights (the base folder named in ``adapter_config.json``), or a copy
of a full agent, with the tokenizer and the value head. Load it with
``AutoModelForCausalLM.from_pretrained``, or start a run from it
(``scenario.agents.<name>.pretrained_path``). Bad input is one line ``error:
...`` with exit status 2; nothing of the run is changed.

Examples
--------
``python -m nip_like.export outputs/2026-11-24/10-00-00_duplicates_nip``
``python -m nip_like.export RUN_DIR --checkpoint last --out exported/``
"""

from __future__ import annotations

import sys
from pathlib import Path

from nip_like.cli import OneLineArgumentParser, report_errors
from nip_like.errors import ConfigError
from nip_like.lm.checkpoints import write_standalone


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


def export_agent(folder: Path, out: Path) -> Path:
    """Write agent ``folder`` to ``out`` as a standalone model folder (see the module docstring)."""
    return write_standalone(folder, out)


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
        if args.checkpoint not in ("best", "last"):
            raise ConfigError(f"--checkpoint must be best or last, got {args.checkpoint!r}")
        folders = agent_folders(args.run_dir, args.checkpoint)
        out = args.out or args.run_dir / "exported" / args.checkpoint
        written = [export_agent(folder, out / folder.name) for folder in folders]
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
