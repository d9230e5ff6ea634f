"""The stress test's scorers: keywords, a callable, a local classifier, a served judge, and each one's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nip_like.errors import ConfigError, ModelServerError
from nip_like.lm.served_config import ServedConfig
from nip_like.scenarios.stress_test.scorers import ScorerConfig, build_scorer, check_scorer
from tests.fake_servers import fake_server, refusing_url
from tests.lm_folders import chat_model  # noqa: F401 - the fixture


def length_score(texts: list[str]) -> list[float]:
    """A callable scorer: longer texts score higher."""
    return [min(len(text) / 10, 1.0) for text in texts]


def two_columns(texts: list[str]):
    return [[0.0, 1.0] for _ in texts]


def too_high(texts: list[str]):
    return torch.full((len(texts),), 2.0)


def words(texts: list[str]):
    return "not a score"


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------ keywords
def test_keywords_flag_whole_words_in_any_case_and_patterns_search_the_text():
    scorer = build_scorer(ScorerConfig(keywords=["idiot", "shut up"]))
    assert scorer(["You IDIOT.", "idiotic plan", "please shut up now", "hello"]).tolist() == [1.0, 0.0, 1.0, 0.0]
    patterns = build_scorer(ScorerConfig(keywords=[r"idiot\w*", r"^no\b"], regex=True))
    assert patterns(["idiotic plan", "no way", "say no"]).tolist() == [1.0, 1.0, 0.0]
    assert build_scorer(ScorerConfig())(["You are pathetic"]).tolist() == [1.0]  # the default list, offline
    assert build_scorer(ScorerConfig())([]).shape == (0,)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ScorerConfig(keywords=[]), "scenario.scorer.keywords is empty"),
        (ScorerConfig(keywords=["(unclosed"], regex=True), "scenario.scorer.keywords holds an invalid regular expression"),
    ],
)
def test_bad_keywords_are_one_line(config, message):
    with pytest.raises(ConfigError) as error:
        build_scorer(config)
    assert one_line(error).startswith(message)


# ------------------------------------------------------------------ a callable
def test_a_callable_by_dotted_path_scores_the_texts():
    scorer = build_scorer(ScorerConfig(kind="callable", function=f"{__name__}.length_score"))
    assert scorer(["12345", "a" * 30]).tolist() == [0.5, 1.0]


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("length_score", "must be a dotted path module.name"),
        ("no_such_module_here.score", "cannot import module 'no_such_module_here'"),
        (f"{__name__}.missing", f"module {__name__} has no callable 'missing'"),
    ],
)
def test_a_callable_that_cannot_be_loaded_is_one_line(function, message):
    with pytest.raises(ConfigError) as error:
        check_scorer(ScorerConfig(kind="callable", function=function))
    assert message in one_line(error) and "scenario.scorer.function" in str(error.value)


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("two_columns", "returned scores of shape (2, 2) for 2 texts"),
        ("too_high", "returned a score outside [0, 1] (2 to 2)"),
        ("words", "returned str, not numbers"),
    ],
)
def test_a_callable_that_returns_the_wrong_shape_or_range_is_one_line(function, message):
    scorer = build_scorer(ScorerConfig(kind="callable", function=f"{__name__}.{function}"))
    with pytest.raises(ConfigError) as error:
        scorer(["a", "b"])
    assert message in one_line(error) and f"{__name__}.{function}" in str(error.value)


# ------------------------------------------------------------------ a local classifier
@pytest.fixture(scope="module")
def classifier(chat_model, tmp_path_factory) -> Path:  # noqa: F811 - the fixture
    """A tiny sequence classifier built from config, with labels ok and toxic, and a tokenizer, saved to a folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(chat_model("llama", vocab_size=500, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_labels=2, id2label={0: "ok", 1: "toxic"}, label2id={"ok": 0, "toxic": 1}, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("classifier") / "tiny"
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_local_classifier_scores_the_probability_of_its_named_label(classifier):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = ["you are an idiot", "what a lovely day it is today"]
    scores = build_scorer(ScorerConfig(kind="classifier", path=str(classifier), label="toxic", batch_size=1))(texts)
    model = AutoModelForSequenceClassification.from_pretrained(classifier).eval()
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    with torch.no_grad():
        by_hand = [model(**tokenizer([text], return_tensors="pt", return_token_type_ids=False)).logits.softmax(-1)[0, 1].item() for text in texts]
    assert scores.tolist() == pytest.approx(by_hand, abs=1e-5)
    ok = build_scorer(ScorerConfig(kind="classifier", path=str(classifier), label="ok"))(texts)
    assert torch.allclose(ok + scores, torch.ones(2), atol=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"label": "hateful"}, "scenario.scorer.label must name one of the classifier's labels ['ok', 'toxic'], got 'hateful'"),
        ({"path": "/no/such/classifier"}, "scenario.scorer.path must be a local AutoModelForSequenceClassification folder"),
    ],
)
def test_a_classifier_that_cannot_be_loaded_is_one_line_before_any_weights_are_read(tmp_path, overrides, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "id2label": {"0": "ok", "1": "toxic"}}))
    with pytest.raises(ConfigError) as error:
        check_scorer(ScorerConfig(kind="classifier", **{"path": str(tmp_path), "label": "toxic", **overrides}))  # config.json only
    assert one_line(error).startswith(message)


@pytest.mark.slow
def test_a_classifier_with_an_unknown_label_is_one_line_at_loading(classifier):
    with pytest.raises(ConfigError) as error:
        build_scorer(ScorerConfig(kind="classifier", path=str(classifier), label="hateful"))
    assert one_line(error).startswith("scenario.scorer.label must name one of the classifier's labels ['ok', 'toxic'], got 'hateful'")


def test_a_folder_that_holds_no_classifier_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model_type"}))
    with pytest.raises(ConfigError) as error:
        build_scorer(ScorerConfig(kind="classifier", path=str(tmp_path), label="toxic"))
    assert one_line(error).startswith(f"scenario.scorer.path: cannot load a sequence classifier from {tmp_path}")


# ------------------------------------------------------------------ a served judge
def verdict(body: dict) -> str:
    """A judge that says yes to texts with an insult."""
    return "Yes." if "idiot" in body["messages"][-1]["content"].lower() else "No, it is fine."


@pytest.mark.slow
def test_a_served_judge_is_asked_for_a_verdict_on_each_text():
    with fake_server("ok", reply=verdict) as server:
        config = ScorerConfig(kind="served", served=ServedConfig(base_url=server.url, model="judge"))
        check_scorer(config)
        scorer = build_scorer(config)
        assert scorer(["you idiot", "nice weather", "IDIOT!"]).tolist() == [1.0, 0.0, 1.0]
        scorer.close()
    asked = [body for kind, body in server.requests if kind == "chat"]
    assert len(asked) == 3 and all(body["model"] == "judge" and body["temperature"] == 0 for body in asked)
    assert {body["messages"][0]["content"].rpartition("Text: ")[2] for body in asked} == {"you idiot", "nice weather", "IDIOT!"}
    unsafe = ScorerConfig(kind="served", served=ServedConfig(base_url=server.url, model="judge"))
    with fake_server("ok", reply="unsafe\nS1") as guard:
        unsafe.served.base_url = guard.url
        assert build_scorer(unsafe)(["anything"]).tolist() == [1.0]  # LlamaGuard's answer


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ScorerConfig(kind="served"), "scenario.scorer.served is missing"),
        (ScorerConfig(kind="served", served=ServedConfig(base_url="http://127.0.0.1:9/v1")), "scenario.scorer.served.model is missing"),
        (ScorerConfig(kind="served", served=ServedConfig(base_url="http://x/v1", model="m"), verdict_prompt="Judge it."), "scenario.scorer.verdict_prompt must hold {text}"),
        (ScorerConfig(kind="served", served=ServedConfig(base_url="http://x/v1", model="m"), flag_pattern="(yes"), "scenario.scorer.flag_pattern is not a regular expression"),
    ],
)
def test_a_served_judge_that_cannot_be_set_up_is_one_line(config, message):
    with pytest.raises(ConfigError) as error:
        build_scorer(config)
    assert one_line(error).startswith(message)


def test_a_served_judge_that_does_not_answer_is_one_line():
    served = ServedConfig(base_url=refusing_url(), model="judge", max_retries=0, timeout=5)
    with pytest.raises(ModelServerError) as error:
        check_scorer(ScorerConfig(kind="served", served=served))
    assert one_line(error).startswith(f"scenario.scorer.served: text-model server {served.base_url} (GET /models) failed after 1 try")
