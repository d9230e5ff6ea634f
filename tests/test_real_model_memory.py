"""The memory preflight on the real model (Gemma 3 270M, tests/real_model.py), and the script that measures it: ``run.memory_limit_gib`` below what
``preset=real_chat`` needs is refused in one line before any run folder is made; a limit above it passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from nip_like.experiment import preflight
from nip_like.lm.memory import GIB, available_memory, estimate_lm_memory
from tests.conftest import make_config, run_cli
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.real_model import gemma_folder, gemma_gguf  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


def overrides(gguf: Path, tmp_path: Path, limit_gib: float) -> list[str]:
    """``preset=real_chat`` with the real model's GGUF file and a memory limit."""
    return [
        "preset=real_chat",
        f"scenario.default_agent.pretrained_path={gguf}",
        f"scenario.cache_dir={tmp_path / 'cache'}",
        f"run.memory_limit_gib={limit_gib}",
        "logger=none",
        "run.progress_bar=false",
    ]


def needed_gib(gguf: Path, tmp_path: Path) -> float:
    """The preset's estimated peak (the largest of its agents'), in GiB, as the trainer's preflight computes it."""
    config = make_config(*overrides(gguf, tmp_path, 1000.0))
    checked = preflight(config)
    trainer = config.trainer
    batch = max(int(trainer.num_envs), int(trainer.test_batch_episodes))
    estimates = estimate_lm_memory(checked.scenario.lm_agent_configs(), batch, int(trainer.minibatch_size))
    return max(estimate.needed for estimate in estimates.values()) / GIB


def test_a_memory_limit_below_the_real_presets_needs_is_refused_in_one_line_and_one_above_passes(gemma_gguf, tmp_path):
    needed = needed_gib(gemma_gguf, tmp_path)
    assert 1.0 < needed < 4.0, needed  # 1 GiB of float32 weights, adapters, a row's activations and logits

    below = round(needed * 0.9, 2)
    result = run_cli([*overrides(gemma_gguf, tmp_path, below), f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "cannot fit in memory" in lines[0] and f"run.memory_limit_gib={below:g}" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()

    above = round(needed * 1.1 + 0.01, 2)
    free = available_memory("cpu")
    if free is None or free[0] < above * GIB:
        pytest.skip(f"this machine has less than {above} GiB available")
    preflight(make_config(*overrides(gemma_gguf, tmp_path, above)))  # passes: no ConfigError


def test_the_memory_script_measures_each_configuration_in_its_own_process(chat_model, tmp_path, capsys):
    """scripts/real_model_memory.py on a tiny chat model: one row per configuration, the preflight's parts beside a measured peak."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import real_model_memory

    output = tmp_path / "memory.json"
    rows = real_model_memory.main([
        "--model", str(chat_model("qwen2")), "--chat-template", "chatml", "-B", "2", "--prompt-tokens", "8", "-T", "4",
        "--lora-r", "2", "--threads", "1", "--output", str(output),
    ])
    assert [row["config"] for row in rows] == ["lora", "full"]
    lora, full = rows
    assert lora["lora_r"] == 2 and full["lora_r"] == 0 and 0 < lora["trained_parameters"] < full["trained_parameters"]
    for row in rows:
        estimate = row["estimate"]
        assert estimate["update"] == estimate["state"] + estimate["activations"] + estimate["logits"]
        assert row["scored_tokens"] == 2 * (8 + 4) and row["measured_update"] > 0 and row["probe_per_token"] > 0
    assert full["estimate"]["state"] > lora["estimate"]["state"]
    printed = capsys.readouterr().out
    assert "estimate of the update within 25% of the measured peak" in printed and "load average" in printed
    assert output.is_file()
