"""Model sources: GGUF files (checked from their header, converted once into a cached folder) and chosen chat templates.

The conversion itself, through transformers, is shown on the real model
(tests/test_real_model.py); here the GGUF files are small ones written with
the ``gguf`` package's writer, and the conversion step is replaced where a
test is about the cache around it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nip_like.errors import ConfigError
from nip_like.lm import chat_templates, gguf as gguf_sources
from nip_like.lm.chat_templates import TEMPLATES, apply_chat_template, resolve_chat_template
from nip_like.lm.gguf_header import read_header
from nip_like.lm.models import load_tokenizer, source_folder, template_stop_strings
from tests.lm_folders import chat_model  # noqa: F401 - fixture

gguf = pytest.importorskip("gguf")


def write_gguf(path: Path, architecture: str = "llama", tensors: int = 3, name: str | None = "tiny") -> Path:
    """A small GGUF file: ``tensors`` float32 and q8_0-sized tensors, a vocabulary array, an architecture."""
    writer = gguf.GGUFWriter(str(path), architecture)
    if name:
        writer.add_name(name)
    writer.add_token_list([f"t{i}" for i in range(300)])  # an array the header reader steps over
    writer.add_uint32("test.number", 7)
    for index in range(tensors):
        writer.add_tensor(f"w{index}", np.arange(64 * (index + 1), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(gguf_sources.CACHE_ENV, str(root))
    gguf_sources._checked.clear()
    return root


def test_the_header_reader_finds_the_architecture_and_where_the_data_ends(tmp_path):
    file = write_gguf(tmp_path / "m.gguf")
    header = read_header(file)
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["general.name"] == "tiny"
    assert header.tensors == 3
    assert header.data_end == file.stat().st_size
    reader = gguf.GGUFReader(str(file))  # the package's own reader agrees on where the data ends
    assert header.data_end == max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)


def test_a_good_file_is_accepted_and_its_digest_remembered(tmp_path, cache):
    file = write_gguf(tmp_path / "m.gguf")
    info = gguf_sources.check_gguf(file)
    assert (info.architecture, info.name, info.size) == ("llama", "tiny", file.stat().st_size)
    digests = json.loads((cache / gguf_sources.DIGESTS_FILE).read_text())
    assert list(digests.values()) == [info.sha256]


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("truncate", "is truncated: its tensors need"),
        ("header", "is not a readable GGUF file: the file ends at byte"),
        ("magic", "is not a readable GGUF file: it does not start with the bytes 'GGUF'"),
        ("folder", "is a folder, not a file"),
        ("missing", "is not an existing file"),
    ],
)
def test_a_damaged_or_wrong_source_is_refused_in_one_line(tmp_path, cache, damage, expected):
    file = write_gguf(tmp_path / "m.gguf")
    data = file.read_bytes()
    if damage == "truncate":
        file.write_bytes(data[: len(data) - 100])
    elif damage == "header":
        file.write_bytes(data[:60])
    elif damage == "magic":
        file.write_bytes(b"PK\x03\x04" + data[4:])
    elif damage == "folder":
        file.unlink()
        file.mkdir()
    else:
        file.unlink()
    with pytest.raises(ConfigError) as error:
        gguf_sources.check_gguf(file, "scenario.default_agent.pretrained_path")
    message = str(error.value)
    assert expected in message and message.startswith("scenario.default_agent.pretrained_path: ")
    assert "\n" not in message
    assert not cache.exists() or not [p for p in cache.iterdir() if p.is_dir()]  # nothing converted


@pytest.mark.parametrize("architecture, expected", [("bert", "not a causal language model"), ("rwkv7", "cannot read from GGUF")])
def test_an_architecture_transformers_cannot_train_is_refused(tmp_path, cache, architecture, expected):
    file = write_gguf(tmp_path / "m.gguf", architecture)
    with pytest.raises(ConfigError, match=expected):
        gguf_sources.check_gguf(file)


def test_without_the_gguf_package_the_line_says_how_to_install_it(tmp_path, cache, monkeypatch):
    file = write_gguf(tmp_path / "m.gguf")
    real = gguf_sources.importlib.util.find_spec
    monkeypatch.setattr(gguf_sources.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(ConfigError, match=r"needs the gguf package: pip install 'gguf>=0.10'"):
        gguf_sources.check_gguf(file)


def _fake_convert(calls: list):
    def convert(info, folder: Path) -> None:
        calls.append(info.sha256)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"weights")
        (folder / gguf_sources.SOURCE_FILE).write_text(json.dumps({"sha256": info.sha256}))
        from nip_like.checkpoint import write_manifest

        write_manifest(folder)

    return convert


def test_a_file_is_converted_once_then_read_from_the_cache_and_a_damaged_entry_is_rebuilt(tmp_path, cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(gguf_sources, "_convert", _fake_convert(calls))
    file = write_gguf(tmp_path / "m.gguf")
    first = gguf_sources.converted_folder(file)
    assert first == cache / calls[0][:16] and (first / "model.safetensors").is_file()
    assert gguf_sources.converted_folder(file) == first and len(calls) == 1  # reused
    copy = write_gguf(tmp_path / "copy.gguf")  # the same bytes elsewhere: the same entry
    assert gguf_sources.converted_folder(copy) == first and len(calls) == 1
    (first / "model.safetensors").write_bytes(b"weightz")  # damaged: found by its checksums, converted again
    from nip_like import checkpoint

    checkpoint._checked_folders.clear()
    assert gguf_sources.converted_folder(file) == first and len(calls) == 2
    assert (first / "model.safetensors").read_bytes() == b"weights"
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]  # no staging folder left behind


def test_a_failed_conversion_leaves_no_entry(tmp_path, cache, monkeypatch):
    def broken(info, folder):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        raise ConfigError("transformers could not load it")

    monkeypatch.setattr(gguf_sources, "_convert", broken)
    file = write_gguf(tmp_path / "m.gguf")
    with pytest.raises(ConfigError, match="could not load"):
        gguf_sources.converted_folder(file)
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []


def test_the_conversion_parses_a_file_once_over_a_plain_array_and_reads_the_same_fields(tmp_path):
    file = write_gguf(tmp_path / "m.gguf")
    original = gguf.GGUFReader
    plain = original(file)
    with gguf_sources._one_reader_per_file():
        first, second = gguf.GGUFReader(file), gguf.GGUFReader(str(file))  # config, then weights: one parse
        assert first is second and type(first.data) is np.ndarray and type(plain.data) is np.memmap
        assert list(first.fields) == list(plain.fields)
        assert first.fields["tokenizer.ggml.tokens"].contents() == plain.fields["tokenizer.ggml.tokens"].contents()
        for ours, theirs in zip(first.tensors, plain.tensors, strict=True):
            assert ours.name == theirs.name and np.array_equal(ours.data, theirs.data)
    assert gguf.GGUFReader is original


def test_source_folder_passes_folders_through_and_refuses_hub_names(tmp_path):
    assert source_folder(tmp_path) == tmp_path
    with pytest.raises(ConfigError, match="only local folders are read"):
        source_folder("google/gemma-3-270m")


def test_every_family_template_renders_a_system_message_a_reply_and_the_generation_prompt():
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    from jinja2 import Environment

    for template in TEMPLATES.values():
        text = Environment().from_string(template.text).render(
            messages=chat, add_generation_prompt=True, bos_token="<B>", eos_token="<E>"
        )
        assert all(part in text for part in ("S", "U1", "A1", "U2")), template.name
        assert text.index("S") < text.index("U1") < text.index("A1") < text.index("U2")
        if template.turn_end:
            assert text.count(template.turn_end) == 4 - (template.name == "gemma")  # gemma folds the system turn in
    gemma = Environment().from_string(TEMPLATES["gemma"].text).render(messages=chat, add_generation_prompt=True, bos_token="<B>")
    assert gemma.startswith("<B><start_of_turn>user\nS\n\nU1<end_of_turn>\n<start_of_turn>model\nA1<end_of_turn>")
    assert gemma.endswith("<start_of_turn>model\n")


def test_a_template_is_a_family_or_a_jinja_file_and_anything_else_is_refused(tmp_path):
    assert resolve_chat_template("chatml") is TEMPLATES["chatml"]
    file = tmp_path / "t.jinja"
    file.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert resolve_chat_template(str(file)).text == file.read_text()
    with pytest.raises(ConfigError, match=r"x.chat_template='mistral' is neither a known chat template \(chatml, llama3, gemma, plain\)"):
        resolve_chat_template("mistral", "x.chat_template")
    file.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="is not a Jinja template"):
        resolve_chat_template(str(file))
    file.write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_chat_template(str(file))


def test_a_turn_end_that_is_one_token_becomes_the_eos_else_a_stop_string(chat_model):  # noqa: F811
    qwen = chat_model("qwen2")
    tokenizer = load_tokenizer(qwen, chat_template="llama3")  # <|eot_id|> is not one of its tokens
    assert tokenizer.chat_template == TEMPLATES["llama3"].text
    assert tokenizer.eos_token == "<|im_end|>"
    assert template_stop_strings(qwen, "llama3") == ["<|eot_id|>"]
    assert template_stop_strings(qwen, "chatml") == [] and template_stop_strings(qwen, None) == []
    llama = load_tokenizer(chat_model("llama"), chat_template="plain")
    assert llama.eos_token == "<|eot_id|>"  # plain ends turns with the tokenizer's own eos
    tokenizer = load_tokenizer(qwen)
    assert apply_chat_template(tokenizer, chat_templates.ChatTemplate("x", "{{ 1 }}", "<|im_start|>")) == []
    assert tokenizer.eos_token == "<|im_start|>"


def test_a_templated_folder_links_the_weights_and_saves_the_tokenizer_with_the_template(chat_model, tmp_path):  # noqa: F811
    from nip_like.lm.templated_folders import templated_folder

    source = chat_model("llama")
    folder = templated_folder(source, "llama3", tmp_path / "initial", "scenario.models.verifier.path")
    assert (folder / "model.safetensors").is_symlink() and (folder / "model.safetensors").resolve() == (source / "model.safetensors").resolve()
    reloaded = load_tokenizer(folder)  # a plain folder now: its own template, no option needed
    assert reloaded.chat_template == TEMPLATES["llama3"].text
    assert templated_folder(source, "plain", folder) == folder  # written once: a resumed run keeps it
    with pytest.raises(ConfigError, match=r"scenario.models.verifier.path: chat template 'gemma' ends turns with '<end_of_turn>', which is not one token"):
        templated_folder(source, "gemma", tmp_path / "other", "scenario.models.verifier.path")
    assert not (tmp_path / "other").exists()


def test_agents_on_one_base_get_tokenizers_that_change_on_their_own_over_one_backend(chat_model):  # noqa: F811
    # A deep copy of a 262,144-token tokenizer took seconds per agent of a shared base; the agents' copies now share
    # the Rust backend (vocabulary and merges) and copy their own settings.
    from nip_like.lm.models import clone_tokenizer

    original = load_tokenizer(chat_model("qwen2"))
    clone = clone_tokenizer(original)
    assert clone._tokenizer is original._tokenizer
    apply_chat_template(clone, TEMPLATES["llama3"])
    clone.padding_side = "right"
    clone.eos_token = "<|im_start|>"
    assert original.chat_template != clone.chat_template and original.padding_side == "left"
    assert original.eos_token == "<|im_end|>" and clone.eos_token == "<|im_start|>"
    assert clone("a b c").input_ids == original("a b c").input_ids
