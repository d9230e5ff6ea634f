"""Memory held by the ``lm_chat`` game's agents: prover and verifier on one shared base against the preset's two models.

``preset=lm_chat`` gives the prover a model of width 128 and 3 blocks and the
verifier one of width 64 and 2 blocks, each its own, fitted whole in the
warm start and then trained through rank-8 adapters. Its shared-base variant
(the learning result in ``docs/shared_models.rst``) gives both agents the
prover's shape on one base (``scenario.shared_base=true``), fitted whole on
both roles' demonstrations, then an adapter set per agent. This script builds
both games' trainers (without the warm start, which changes no size), runs
one training iteration of each (so that the optimiser's state exists) and
reports the bytes each holds between iterations, by kind, counted as
``scripts/benchmark_shared_base.py`` counts them (each tensor storage once),
with the same for two separate copies of the prover's shape, the fair
comparison of sharing itself.

Run it from the repository root::

    python scripts/lm_chat_shared_memory.py --output lm_chat_memory.json    # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from lm_benchmark_env import set_script_environment  # noqa: E402

if __name__ == "__main__":
    set_script_environment()

from benchmark_shared_base import held_bytes  # noqa: E402
from nip_like.cli import compose_config  # noqa: E402
from nip_like.experiment import build_trainer  # noqa: E402

#: The verifier in the prover's shape (width 128, 3 blocks, MLP width 384), as the shared base needs.
PROVER_SHAPE = (
    "scenario.agents.verifier.hidden_size=128",
    "scenario.agents.verifier.num_layers=3",
    "scenario.agents.verifier.intermediate_size=384",
)
#: The three games measured: the preset as it is, two copies of the prover's shape, and one shared base.
GAMES: dict[str, tuple[str, ...]] = {
    "preset": (),
    "copies": PROVER_SHAPE,
    "shared": (*PROVER_SHAPE, "scenario.shared_base=true"),
}


def held(overrides: tuple[str, ...], cache_dir: str, run_dir: Path) -> dict[str, int]:
    """The bytes one game's trainer holds after one training iteration (see the module docstring)."""
    config = compose_config([
        "preset=lm_chat", *overrides, f"scenario.cache_dir={Path(cache_dir).expanduser()}", "trainer.pretrain.agents=[]", "logger=none",
        "run.progress_bar=false", "trainer.eval.every=0",
    ])
    trainer = build_trainer(config, run_dir)
    trainer.train_iteration()
    return held_bytes(trainer)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure the three games; print a table; return (and with ``--output`` write) the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default="~/.cache/nip_like/datasets", help="scenario.cache_dir (datasets, built models)")
    parser.add_argument("--output", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        results = {name: held(overrides, args.cache_dir, Path(folder) / name) for name, overrides in GAMES.items()}
    results["ratios"] = {
        "shared_over_preset": results["shared"]["total"] / results["preset"]["total"],
        "shared_over_copies": results["shared"]["total"] / results["copies"]["total"],
    }
    print(f"{'held bytes':<14}" + "".join(f"{name:>12}" for name in GAMES))
    for kind in ("frozen", "trained", "buffers", "optimizer", "total"):
        print(f"{kind:<14}" + "".join(f"{results[name][kind]:>12,}" for name in GAMES))
    print(f"shared / preset {results['ratios']['shared_over_preset']:.3f}, shared / copies {results['ratios']['shared_over_copies']:.3f}")
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
