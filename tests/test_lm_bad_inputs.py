"""Bad inputs of the language-model and text paths: one line naming what is wrong, exit status 2, nothing lost.

As in ``tests/test_bad_inputs.py``: each case is run in this process the way
the entry point runs it (compose, check, build, up to the first training
step) inside :func:`nip_like.cli.report_errors`, against the folder of a
finished run, which must stay byte-for-byte as it was. One more test runs the
command line and checks that a refused command makes no run folder.
"""

from __future__ import annotations

import json
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import pytest
from transformers import AutoModelForCausalLM, BertConfig, BertModel

from nip_like.cli import report_errors
from tests.conftest import run_cli
from tests.fake_servers import fake_server, refusing_url
from tests.lm_folders import chat_model  # noqa: F401 - the fixture
from tests.test_bad_inputs import _hashes, _run_command, existing_run  # noqa: F401 - the fixture

#: The duplicates game, small, in the chat view unless a case says otherwise.
GAME = (
    "scenario=duplicates protocol=nip protocol.first_speaker=prover protocol.max_rounds=2 scenario.num_lists=60 "
    "scenario.length=6 scenario.num_values=12 scenario.default_agent.max_new_tokens=8 trainer.num_envs=4 "
    "trainer.frames_per_batch=16 trainer.minibatch_size=8"
)
CHAT = f"{GAME} scenario.view=chat scenario.default_agent.pretrained_path={{qwen2}}"
TEXT = "preset=none scenario=duplicates_chat protocol=nip trainer=expert_iteration scenario.num_lists=60"  # no smoke: its RL loop fields are refused by a text trainer
#: Text agents behind a server ({refusing}, {error_500}, ...: fake servers on 127.0.0.1), failing fast.
SERVED = (
    f"{TEXT} scenario.default_model.backend=openai scenario.default_model.max_retries=1 "
    "scenario.default_model.retry_backoff=0.01"
)
#: A server that answers at all answers at once (a long timeout, so a busy machine's load spike is no hang) ...
ANSWERING = f"{SERVED} scenario.default_model.timeout=30"
#: ... and one that never answers is waited for a fraction of a second.
SILENT = f"{SERVED} scenario.default_model.timeout=0.3"
#: How the preflight's message on a server that does not answer begins.
NO_ANSWER = "scenario.default_model: text-model server {url} (GET /models) failed after 2 tries (timeout 30 s): "

#: (overrides with {folder} and {server} placeholders, a fragment of the one-line error, with the same placeholders).
CASES = [
    # model folders
    (f"{CHAT} scenario.default_agent.pretrained_path={{missing}}", "does not exist"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{a_file}}", "is a file, not a folder"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{encoder}}", "holds BertModel, not a causal language model"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{bad_json}}", "config.json is not JSON (line 4 column 1: Expecting ':' delimiter)"),
    (f"{CHAT} trainer.pretrain.agents=[verifier] trainer.pretrain.cache_dir={{a_file}}", "trainer.pretrain.cache_dir"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{empty}}", "has no config.json"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{config_only}}", "no weights"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{unknown_type}}", "config.json cannot be read"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{truncated}}", "cannot be loaded"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{no_tokenizer}}", "has no tokenizer"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{small_vocab}}", "do not belong together"),
    (f"{CHAT} scenario.default_agent.pretrained_path={{no_template}}", "no chat_template"),
    (f"{GAME} scenario.default_agent.pretrained_path={{qwen2}}", "is not the duplicates game's"),
    # LoRA
    (f"{CHAT} scenario.default_agent.lora.r=4 scenario.default_agent.lora.target_modules=[nope]", "lora.target_modules"),
    (f"{CHAT} scenario.default_agent.lora.r=-1", "scenario.default_agent.lora.r must be >= 0"),
    (f"{CHAT} scenario.default_agent.lora.alpha=0", "scenario.default_agent.lora.alpha must be > 0"),
    (f"{CHAT} scenario.default_agent.lora.dropout=1", "scenario.default_agent.lora.dropout must be in [0, 1)"),
    (f"{CHAT} scenario.default_agent.lora.warm_start=half", "scenario.default_agent.lora.warm_start must be one of"),
    # sizes
    (f"{CHAT} scenario.default_agent.max_tokens_per_micro_batch=-1", "max_tokens_per_micro_batch must be >= 0"),
    (f"{CHAT} scenario.default_agent.max_tokens_per_micro_batch=8", "max_tokens_per_micro_batch (8) cannot hold"),
    (f"{CHAT} scenario.default_agent.max_tokens_per_micro_batch=60", "below one sequence"),
    (f"{CHAT} scenario.default_agent.max_new_tokens=4096", "is not below the context"),
    (f"{CHAT} scenario.default_agent.max_new_tokens=2000", "exceeds the context"),
    (f"{GAME} scenario.default_agent.max_new_tokens=1000000", "is not below the context"),
    (f"{CHAT} scenario.default_agent.dtype=float16", "scenario.default_agent.dtype must be one of"),
    (f"{CHAT} scenario.default_agent.vocab_size=10", "scenario.default_agent.vocab_size must be >= 300"),
    # memory: a lower bound of the weights, KV cache and logits against what the device has (terabytes here)
    (
        f"{GAME} scenario.default_agent.max_new_tokens=2000 trainer.test_batch_episodes=1000000",
        "KV cache 1907.3 GiB of 1000000 sequences of 2000 tokens), but",
    ),
    (f"{CHAT} scenario.default_agent.max_tokens_per_micro_batch=100000000000", ", scenario.default_agent.max_tokens_per_micro_batch (100000000000)"),
    (
        f"{GAME} scenario.view=chat scenario.default_agent.vocab_size=10000000000",
        "cannot fit in memory: it needs at least 19074.7 GiB (weights of the agents 4768.4 GiB",
    ),
    (
        f"{GAME} +scenario.agents.verifier.max_new_tokens=2000 trainer.test_batch_episodes=1000000",
        "lower scenario.agents.verifier.max_new_tokens (2000) or trainer.num_envs / trainer.test_batch_episodes",
    ),
    # sampling
    (f"{CHAT} scenario.default_agent.temperature=0", "scenario.default_agent.temperature must be >= 0.01"),
    (f"{CHAT} scenario.default_agent.temperature=1e-45", "scenario.default_agent.temperature must be >= 0.01"),
    (f"{CHAT} scenario.default_agent.top_p=1.5", "scenario.default_agent.top_p must be in (0, 1]"),
    (f"{CHAT} scenario.default_agent.top_k=-1", "scenario.default_agent.top_k must be >= 0"),
    # the chat view
    (f"{CHAT} scenario.view=image", "scenario.view must be one of"),
    (f"{CHAT} scenario.quote_tokens=0", "scenario.quote_tokens must be >= 1"),
    (f"{CHAT} scenario.list_format=json", "scenario.list_format must be one of"),
    (f"{CHAT} scenario.decoys.pair=0 scenario.decoys.alone=0 scenario.decoys.twice=0", "scenario.decoys: the weights (pair, alone, twice) must be >= 0 with one > 0"),
    (f"{CHAT} scenario.decoys.alone=-1", "scenario.decoys.alone must be >= 0"),
    (f"{CHAT} +scenario.system_prompts.judge=hello", "scenario.system_prompts names ['judge']"),
    (f"{GAME} scenario.view=chat scenario.default_agent.architecture=mistral", "cannot be built for the chat view"),
    (f"{GAME} scenario.default_agent.architecture=nonsense", "unknown architecture 'nonsense'"),
    # text agents
    (f"{TEXT} scenario.default_model.max_new_tokens=0", "scenario.default_model.max_new_tokens must be >= 1"),
    (f"{TEXT} scenario.default_model.temperature=-1", "scenario.default_model.temperature must be 0 or >= 0.01"),
    (f"{TEXT} scenario.default_model.temperature=1e-45", "scenario.default_model.temperature must be 0 or >= 0.01"),
    (f"{TEXT} scenario.default_model.backend=vllm", "scenario.default_model.backend must be one of"),
    (f"{TEXT} +scenario.agent_groups.judge=verifier", "scenario.agent_groups names ['judge']"),
    (f"{TEXT} scenario.default_model.path={{missing}}", "does not exist"),
    (f"{TEXT} scenario.default_model.path={{encoder}}", "holds BertModel, not a causal language model"),
    (f"{TEXT} scenario.default_model.path={{short_context}}", "exceeds the context of the model in"),
    (f"{TEXT} scenario.default_model.max_new_tokens=100000000", "exceeds the context of a from-config llama (2048 tokens)"),
    (f"{TEXT} +scenario.system_prompts.verifier=caf\udce9", "scenario.system_prompts.verifier: the command-line argument holds a byte that is not UTF-8"),
    (f"{TEXT} scenario.default_model.path={{no_template}}", "has no chat_template, which text models need"),
    (f"{TEXT} scenario.default_model.path={{no_tokenizer}}", "scenario.default_model.path: "),
    # text agents behind a server: the preflight asks it, with the model's retries and timeout
    (f"{ANSWERING} scenario.default_model.base_url={{refusing}}", NO_ANSWER.format(url="{refusing}") + "APIConnectionError"),
    (f"{ANSWERING} scenario.default_model.base_url={{error_500}}", NO_ANSWER.format(url="{error_500}") + "HTTP 500"),
    (f"{ANSWERING} scenario.default_model.base_url={{malformed}}", NO_ANSWER.format(url="{malformed}") + "malformed JSON answer"),
    (f"{SILENT} scenario.default_model.base_url={{hang}}", "scenario.default_model: text-model server {hang} (GET /models) gave no answer within its timeout of 0.3 s"),
    (f"{ANSWERING} scenario.default_model.base_url={{unauthorized}}", "text-model server {unauthorized} refused GET /models: HTTP 401"),
    (
        f"{TEXT} +scenario.models.verifier.backend=openai +scenario.models.verifier.base_url={{error_500}} "
        "+scenario.models.verifier.max_retries=0",
        "scenario.models.verifier: text-model server {error_500} (GET /models) failed after 1 try (timeout 60 s): HTTP 500",
    ),
    (SERVED, "scenario.default_model: backend openai needs the server's URL: set base_url or the OPENAI_BASE_URL"),
    (f"{SERVED} scenario.default_model.base_url=ftp://127.0.0.1/v1", "scenario.default_model.base_url must be an http:// or https:// URL"),
    (f"{SERVED} scenario.default_model.max_retries=-1", "scenario.default_model.max_retries must be >= 0"),
    (f"{SERVED} scenario.default_model.timeout=0", "scenario.default_model.timeout must be > 0"),
    (f"{SERVED} scenario.default_model.retry_backoff=0", "scenario.default_model.retry_backoff must be > 0"),
    (f"{SERVED} scenario.default_model.max_concurrency=0", "scenario.default_model.max_concurrency must be >= 1"),
    (f"{TEXT} scenario.default_model.top_p=0", "scenario.default_model.top_p must be in (0, 1]"),
    (f"{TEXT} scenario.default_model.batch_size=0", "scenario.default_model.batch_size must be >= 1"),
]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    """The API roots of fake servers that fail in each way, by behaviour, and of one that refuses connections."""
    with ExitStack() as stack:
        failing = ("error_500", "malformed", "hang", "unauthorized")
        yield {"refusing": refusing_url(), **{name: stack.enter_context(fake_server(name)).url for name in failing}}


@pytest.fixture(scope="module")
def folders(chat_model, tmp_path_factory) -> dict[str, Path]:
    """A good chat-model folder and broken copies of it, by name."""
    good = chat_model("qwen2")
    root = tmp_path_factory.mktemp("broken")
    made = {"qwen2": good, "missing": root / "missing", "a_file": root / "a_file", "empty": root / "empty"}
    made["a_file"].write_text("not a folder")
    made["empty"].mkdir()

    def copy(name: str) -> Path:
        made[name] = root / name
        shutil.copytree(good, made[name])
        return made[name]

    config_only = root / "config_only"
    config_only.mkdir()
    shutil.copy(good / "config.json", config_only / "config.json")
    made["config_only"] = config_only
    folder = copy("unknown_type")
    (folder / "config.json").write_text(json.dumps({**json.loads((good / "config.json").read_text()), "model_type": "blorp"}))
    folder = copy("truncated")
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:1000])
    folder = copy("no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    folder = copy("no_template")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    folder = copy("bad_json")
    (folder / "config.json").write_text('{\n  "model_type": "qwen2",\n  "oops"\n}\n')
    folder = copy("short_context")
    (folder / "config.json").write_text(json.dumps({**json.loads((good / "config.json").read_text()), "max_position_embeddings": 64}))
    encoder = root / "encoder"
    BertModel(BertConfig(vocab_size=1000, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)).save_pretrained(encoder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (good / name).is_file():
            shutil.copy(good / name, encoder / name)
    made["encoder"] = encoder
    folder = copy("small_vocab")
    model = AutoModelForCausalLM.from_pretrained(good)
    model.resize_token_embeddings(500)
    model.save_pretrained(folder)
    return made


def test_there_are_at_least_twenty_five_cases():
    assert len(CASES) >= 25 and len({overrides for overrides, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("overrides, fragment", CASES, ids=[overrides.rsplit(" ", 1)[-1] for overrides, _ in CASES])
def test_bad_lm_or_text_input_is_one_line_exit_2_and_loses_nothing(
    existing_run, folders, servers, capsys, tmp_path, monkeypatch, overrides, fragment  # noqa: F811 - fixtures
):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    before = _hashes(existing_run)
    names = {**{name: str(path) for name, path in folders.items()}, **servers}
    fragment = fragment.format(**names)
    args = overrides.format(**names).split()
    args.append(f"scenario.cache_dir={tmp_path / 'cache'}")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, report_errors():
        _run_command(args, existing_run)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fragment in err, err
    assert _hashes(existing_run) == before


@pytest.mark.slow
def test_a_refused_model_folder_leaves_no_run_folder(folders, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        [*GAME.split(), "preset=none", "scenario.view=chat", f"scenario.default_agent.pretrained_path={folders['no_template']}",
         f"scenario.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run_dir}"],
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "no chat_template" in result.stderr
    assert not run_dir.exists()
