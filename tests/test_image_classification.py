"""The image-classification scenario: sources, binarisations, the cache, who sees what, and training end to end."""

import dataclasses
import re

import numpy as np
import pytest
import torch
from torchrl.envs.utils import check_env_specs

from nip_like.errors import ConfigError
from nip_like.experiment import build_trainer, run_experiment
from nip_like.validation import build_scenario
from nip_like.protocols.proof import ProofProtocol
from nip_like.registry import PROTOCOLS, TRAINERS
from nip_like.scenarios.datasets import DatasetFileError
from nip_like.scenarios.image_classification.data import (
    ImageSpec,
    LabelledImages,
    binarise,
    build_images,
    cache_path,
    load_or_build_images,
    load_source,
    merge_positive_classes,
    resolve_source,
    source_fingerprint,
)
from nip_like.scenarios.image_classification.demonstrations import PixelEvidence, honest_patches
from nip_like.scenarios.image_classification.environment import ImageClassificationEnv
from nip_like.trainers import TensorDictRlTrainer
from tests.conftest import smoke_config, tiered

#: Every registered interactive-proof protocol, from the registry.
PROOF_PROTOCOLS = PROTOCOLS.names(subclass_of=ProofProtocol)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ic_cache")


def turns(name: str) -> tuple[str, ...]:
    """Four steps for a protocol whose schema has turn limits (the others have fixed turns)."""
    fields = {field.name for field in dataclasses.fields(PROTOCOLS.entry(name).schema)}
    return ("protocol.max_rounds=4",) if "max_rounds" in fields else ()


def ic_config(cache_dir, *overrides, protocol="nip"):
    """The smoke preset on 200 digits under ``protocol``, with tiny agents, one PPO iteration and a short test."""
    return smoke_config(
        "scenario=image_classification",
        f"protocol={protocol}",
        *turns(protocol),
        f"scenario.cache_dir={cache_dir}",
        "scenario.max_images=200",
        "scenario.default_agent.channels=4",
        "scenario.default_agent.head_size=8",
        "trainer.num_iterations=1",
        "trainer.eval.every=0",
        "trainer.num_test_episodes=16",
        "trainer.test_batch_episodes=16",
        *overrides,
    )


def protocol(name: str, **options):
    return PROTOCOLS.get(name)(name, **options)


def tiny_env(proto, images: torch.Tensor, label: torch.Tensor | None = None, **options) -> ImageClassificationEnv:
    label = torch.zeros(len(images), dtype=torch.bool) if label is None else label
    return ImageClassificationEnv(proto, images, label, num_envs=len(images), **options)


def save_png(path, array: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


# ------------------------------------------------------------ binarisations
def test_select_two_keeps_the_two_classes_and_labels_the_second_positive():
    classes = np.array([0, 3, 8, 3, 5, 8, 8])
    kept, label = binarise(classes, 10, "select_two", (3, 8))
    assert kept.tolist() == [False, True, True, True, False, True, True]
    assert label[kept].tolist() == [False, True, False, True, True]
    with pytest.raises(ConfigError, match=r"scenario.selected_classes \[3, 12\]: the source has 10 classes, 0 to 9"):
        binarise(classes, 10, "select_two", (3, 12))


def test_merge_shuffles_the_classes_and_makes_the_second_half_positive():
    classes = np.arange(10).repeat(3)
    kept, label = binarise(classes, 10, "merge", seed=4)
    assert kept.all()
    order = torch.randperm(10, generator=torch.Generator().manual_seed(4))  # the documented rule, recomputed
    assert label.tolist() == (order[classes] >= 5).tolist()
    assert torch.equal(merge_positive_classes(10, 4), order >= 5)
    assert int(merge_positive_classes(7, 0).sum()) == 4  # K - K // 2 positive classes
    # Every image of a class has its class's label; another seed splits the classes otherwise.
    assert all(len(set(label[classes == c])) == 1 for c in range(10))
    assert not torch.equal(merge_positive_classes(10, 4), merge_positive_classes(10, 5))


def test_random_labels_ignore_the_classes():
    classes = np.zeros(400, dtype=np.int64)
    kept, label = binarise(classes, 10, "random", seed=2)
    assert kept.all()
    assert label.tolist() == torch.randint(0, 2, (400,), generator=torch.Generator().manual_seed(2)).bool().tolist()
    assert 0.4 < label.mean() < 0.6


def test_the_built_dataset_balances_subsamples_and_keeps_the_labels(tmp_path):
    # 30 images of class 0, 10 of class 1, 20 of class 2; image i is filled with the value i but for its last pixel.
    labels = np.array([0] * 30 + [1] * 10 + [2] * 20)
    images = np.arange(60, dtype=np.uint8)[:, None, None].repeat(4, 1).repeat(4, 2)
    images[:, 3, 3] = 255
    np.savez(tmp_path / "toy.npz", images=images, labels=labels)
    source = resolve_source(str(tmp_path / "toy.npz"))
    spec = ImageSpec(source=source, binarisation="select_two", selected_classes=(2, 1), make_balanced=False)
    data = build_images(spec)
    assert len(data) == 30 and data.image_shape == (1, 4, 4)
    assert torch.equal(data.label, data.source_class == 1)
    assert torch.equal(data.images[:, 0, 0, 0].long(), data.source_index)  # each image is the source's
    balanced = build_images(dataclasses.replace(spec, make_balanced=True))
    assert int(balanced.label.sum()) == int((~balanced.label).sum()) == 10
    drawn = build_images(dataclasses.replace(spec, binarisation="merge", selected_classes=(), max_images=12))
    assert len(drawn) == 12 and 0 < int(drawn.label.sum()) < 12
    assert torch.equal(drawn.label, merge_positive_classes(3, 0)[drawn.source_class])


# ------------------------------------------------------------------ sources
def test_digits_are_the_default_source():
    digits = load_source("digits")
    assert digits.images.shape == (1797, 1, 8, 8) and digits.images.dtype == np.uint8
    assert digits.class_names == [str(c) for c in range(10)] and digits.images.max() == 255


def test_an_image_folder_is_read_in_sorted_class_order(tmp_path):
    rng = np.random.default_rng(0)
    pixels = {}
    for name, count in (("dog", 2), ("cat", 3)):
        for k in range(count):
            pixels[(name, k)] = rng.integers(0, 256, (6, 5), dtype=np.uint8)
            save_png(tmp_path / "folder" / name / f"{k}.png", pixels[(name, k)])
    (tmp_path / "folder" / "cat" / "notes.txt").write_text("not an image")
    loaded = load_source(str(tmp_path / "folder"))
    assert loaded.class_names == ["cat", "dog"] and loaded.classes.tolist() == [0, 0, 0, 1, 1]
    assert loaded.images.shape == (5, 1, 6, 5)  # grey PNGs: one channel
    assert np.array_equal(loaded.images[3, 0], pixels[("dog", 0)])
    # One colour image makes every image RGB; image_size resizes them all.
    save_png(tmp_path / "folder" / "dog" / "2.png", rng.integers(0, 256, (7, 7, 3), dtype=np.uint8))
    resized = load_source(str(tmp_path / "folder"), image_size=4)
    assert resized.images.shape == (6, 3, 4, 4)


def test_an_npz_is_read_in_every_layout(tmp_path):
    images = np.random.default_rng(0).random((6, 5, 4, 3))  # channels last, floats in [0, 1]
    np.savez(tmp_path / "a.npz", x=images, y=np.array([7, 2, 7, 2, 2, 7]))
    loaded = load_source(str(tmp_path / "a.npz"))
    assert loaded.images.shape == (6, 3, 5, 4) and loaded.images.dtype == np.uint8
    assert np.array_equal(loaded.images[0], np.rint(images[0] * 255).astype(np.uint8).transpose(2, 0, 1))
    assert loaded.class_names == ["2", "7"] and loaded.classes.tolist() == [1, 0, 1, 0, 0, 1]
    # Keras's MNIST layout: train and test arrays, joined.
    grey = np.arange(5 * 3 * 3, dtype=np.uint8).reshape(5, 3, 3)
    np.savez(tmp_path / "mnist.npz", x_train=grey[:3], y_train=[0, 1, 0], x_test=grey[3:], y_test=[1, 1])
    joined = load_source(str(tmp_path / "mnist.npz"))
    assert joined.images.shape == (5, 1, 3, 3) and joined.classes.tolist() == [0, 1, 0, 1, 1]
    assert np.array_equal(joined.images[:, 0], grey)


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_bad_sources_fail_in_one_line_naming_the_file(tmp_path, cache_dir):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError) as error:
        build_scenario(ic_config(cache_dir, f"scenario.source={missing}"))
    assert f"scenario.source: {missing} does not exist" in one_line(error)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="neither a folder nor an .npz file"):
        resolve_source(str(tmp_path / "notes.txt"))
    save_png(tmp_path / "one" / "only_class" / "a.png", np.zeros((3, 3), dtype=np.uint8))
    with pytest.raises(DatasetFileError) as error:
        load_source(str(tmp_path / "one"))
    assert f"{tmp_path / 'one'}: an ImageFolder needs at least two class folders holding images" in one_line(error)
    with pytest.raises(DatasetFileError, match="at least two class folders"):  # before the run folder is made
        build_scenario(ic_config(cache_dir, f"scenario.source={tmp_path / 'one'}")).preflight()
    save_png(tmp_path / "one" / "other" / "b.png", np.zeros((4, 3), dtype=np.uint8))
    with pytest.raises(DatasetFileError) as error:
        load_source(str(tmp_path / "one"))
    assert "b.png is 3x4 pixels" in one_line(error) and "scenario.image_size" in str(error.value)
    (tmp_path / "one" / "other" / "c.png").write_bytes(b"not a png")
    with pytest.raises(DatasetFileError, match="c.png: cannot read the image"):
        load_source(str(tmp_path / "one"), image_size=3)
    np.savez(tmp_path / "wrong.npz", pictures=np.zeros((2, 3, 3)), classes=np.zeros(2))
    with pytest.raises(DatasetFileError) as error:
        load_source(str(tmp_path / "wrong.npz"))
    assert f"{tmp_path / 'wrong.npz'}: an .npz source needs the arrays 'images' and 'labels'" in one_line(error)
    assert "found ['pictures', 'classes']" in str(error.value)
    with pytest.raises(DatasetFileError, match="needs the arrays"):
        build_scenario(ic_config(cache_dir, f"scenario.source={tmp_path / 'wrong.npz'}")).preflight()
    np.savez(tmp_path / "short.npz", images=np.zeros((3, 4, 4)), labels=np.zeros(2, dtype=int))
    with pytest.raises(DatasetFileError, match="'labels' must hold one label per image of 'images' \\(3 images\\)"):
        load_source(str(tmp_path / "short.npz"))
    np.savez(tmp_path / "one_class.npz", images=np.zeros((3, 4, 4)), labels=np.zeros(3, dtype=int))
    with pytest.raises(DatasetFileError, match="at least two classes"):
        load_source(str(tmp_path / "one_class.npz"))


def varied_images(count: int, size: int = 4) -> np.ndarray:
    """``count`` grey images of ``size x size`` floats in [0, 1), none constant."""
    return np.random.default_rng(1).random((count, size, size))


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"images": np.full((4, 3, 3), np.nan), "labels": np.array([0, 1, 0, 1])},
         r"'images' has NaN or infinite pixels in 4 of 4 images \(the first: image 0\); every pixel must be a finite"),
        ({"images": np.where(np.arange(4)[:, None, None] == 2, np.inf, varied_images(4, 3)), "labels": np.array([0, 1, 0, 1])},
         r"'images' has NaN or infinite pixels in 1 of 4 images \(the first: image 2\)"),
        ({"images": np.zeros((4, 3, 3)), "labels": np.array([0, 1, 0, 1])},
         r"'images' has only constant images \(each of the 4 is one value throughout\): they carry nothing"),
        ({"images": np.zeros((0, 4, 4)), "labels": np.zeros(0, dtype=int)}, r"'images' holds no images \(shape \(0, 4, 4\)\)$"),
    ],
    ids=["nan", "infinite", "constant", "empty"],
)
def test_npz_pixels_are_checked_for_what_they_mean(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DatasetFileError) as error:
        load_source(str(path))
    assert re.search(rf"^{re.escape(str(path))}: {message}", one_line(error)), str(error.value)


def test_a_few_constant_images_are_kept(tmp_path):
    images = varied_images(4)
    images[1] = 0.5
    np.savez(tmp_path / "some_flat.npz", images=images, labels=np.array([0, 1, 0, 1]))
    assert load_source(str(tmp_path / "some_flat.npz")).images.shape == (4, 1, 4, 4)


def test_a_file_that_is_not_an_npz_is_refused_saying_so(tmp_path, cache_dir):
    (tmp_path / "text.npz").write_text("label,pixels\n1,0 0 0\n")
    np.save(tmp_path / "array.npy", np.zeros((2, 2)))
    (tmp_path / "array.npy").rename(tmp_path / "array.npz")
    for name in ("text.npz", "array.npz"):
        with pytest.raises(DatasetFileError) as error:
            load_source(str(tmp_path / name))
        assert one_line(error) == f"{tmp_path / name} is not an .npz file (a zip archive of NumPy arrays, as numpy.savez writes)"
        assert "allow_pickle" not in str(error.value)
    with pytest.raises(DatasetFileError, match="text.npz is not an .npz file"):  # before the run folder is made
        build_scenario(ic_config(cache_dir, f"scenario.source={tmp_path / 'text.npz'}")).preflight()


def test_an_image_folder_of_blank_images_is_refused(tmp_path):
    for name in ("cat", "dog"):
        save_png(tmp_path / "blank" / name / "a.png", np.full((3, 3), 7, dtype=np.uint8))
    with pytest.raises(DatasetFileError, match=rf"^the ImageFolder {re.escape(str(tmp_path / 'blank'))} has only constant images"):
        load_source(str(tmp_path / "blank"))


@pytest.mark.slow  # three scenarios built and one dataset made: over a second on a busy machine
def test_preflight_reads_a_path_source_and_caches_it(tmp_path):
    cache = tmp_path / "cache"
    np.savez(tmp_path / "nan.npz", images=np.full((4, 3, 3), np.nan), labels=np.array([0, 1, 0, 1]))
    with pytest.raises(DatasetFileError, match="nan.npz: 'images' has NaN or infinite pixels"):
        build_scenario(ic_config(cache, f"scenario.source={tmp_path / 'nan.npz'}")).preflight()
    # Labels of one class once binarised: two images, random labels drawn equal.
    seed = next(seed for seed in range(100) if len(set(torch.randint(0, 2, (2,), generator=torch.Generator().manual_seed(seed)).tolist())) == 1)
    np.savez(tmp_path / "two.npz", images=varied_images(2), labels=np.array([0, 1]))
    one_label = ic_config(cache, f"scenario.source={tmp_path / 'two.npz'}", "scenario.binarisation=random",
                          f"scenario.binarisation_seed={seed}")
    with pytest.raises(ConfigError) as error:
        build_scenario(one_label).preflight()
    assert re.search(r"scenario.binarisation=random leaves (0 negative and 2|2 negative and 0) positive images of .*two.npz", one_line(error))
    # A good file is made into the dataset once, before the run folder; the run reads the cache.
    np.savez(tmp_path / "good.npz", images=varied_images(40), labels=np.arange(40) % 2)
    scenario = build_scenario(ic_config(cache, f"scenario.source={tmp_path / 'good.npz'}"))
    assert not scenario.data_cache_path().is_file()
    scenario.preflight()
    assert scenario.data_cache_path().is_file()


def test_bad_options_fail_in_one_line(cache_dir):
    with pytest.raises(ConfigError) as error:
        build_scenario(ic_config(cache_dir, "scenario.binarisation=select_two", "scenario.selected_classes=[4,4]"))
    assert "scenario.selected_classes must be two different classes for select_two, got [4, 4]" in one_line(error)
    with pytest.raises(ConfigError, match="scenario.patch_size must be in \\[1, 64\\], got 0"):
        build_scenario(ic_config(cache_dir, "scenario.patch_size=0"))
    scenario = build_scenario(ic_config(cache_dir, "scenario.binarisation=select_two", "scenario.selected_classes=[2,11]"))
    with pytest.raises(ConfigError, match="the source has 10 classes, 0 to 9"):
        scenario.splits()


# -------------------------------------------------------------------- cache
def test_the_cache_is_keyed_by_the_spec_and_reused(tmp_path, monkeypatch):
    np.savez(tmp_path / "toy.npz", images=np.arange(40, dtype=np.uint8).reshape(10, 2, 2), labels=np.arange(10) % 2)
    source = resolve_source(str(tmp_path / "toy.npz"))
    spec = ImageSpec(source=source, fingerprint=source_fingerprint(source))
    first = load_or_build_images(spec, tmp_path / "cache")
    assert cache_path(spec, tmp_path / "cache").is_file()
    # Read back, not built again.
    import nip_like.scenarios.image_classification.data as data

    monkeypatch.setattr(data, "build_images", lambda spec: pytest.fail("the cached images were built again"))
    again = load_or_build_images(spec, tmp_path / "cache")
    assert again.checksum() == first.checksum()
    monkeypatch.undo()
    # Another spec, or changed files, is another file.
    other = dataclasses.replace(spec, binarisation_seed=1)
    load_or_build_images(other, tmp_path / "cache")
    changed_images = np.zeros((10, 2, 2), dtype=np.uint8)
    changed_images[:, 0, 0] = 1
    np.savez(tmp_path / "toy.npz", images=changed_images, labels=np.arange(10) % 2)
    changed = dataclasses.replace(spec, fingerprint=source_fingerprint(source))
    assert changed.fingerprint != spec.fingerprint
    assert len({cache_path(s, tmp_path / "cache") for s in (spec, other, changed)}) == 3
    assert int(load_or_build_images(changed, tmp_path / "cache").images.sum()) == 10
    assert len(list((tmp_path / "cache").glob("images_*.pt"))) == 3


def test_the_scenario_keys_only_the_options_its_binarisation_reads(cache_dir):
    def key(scenario, **options) -> str:
        for name, value in options.items():
            scenario.config[name] = value
        return scenario.data_spec().key()

    merge = build_scenario(ic_config(cache_dir))
    assert key(merge) == key(merge, selected_classes=[5, 6]) != key(merge, binarisation_seed=3)  # merge reads no classes
    two = build_scenario(ic_config(cache_dir, "scenario.binarisation=select_two"))
    assert key(two) == key(two, binarisation_seed=3) != key(two, selected_classes=[1, 0])


# ------------------------------------------------------------- who sees what
def two_images() -> torch.Tensor:
    images = torch.randint(0, 256, (1, 1, 4, 4), dtype=torch.uint8).repeat(2, 1, 1, 1)
    images[1, 0, 3, 3] = 255 - images[0, 0, 3, 3]  # the images differ in one pixel, of patch 3 (with 2x2 patches)
    return images


def observe(env: ImageClassificationEnv, sent: torch.Tensor):
    state = env.new_state(torch.arange(env.num_images))
    state["round"] = torch.ones(env.num_images, dtype=torch.int64)
    state["sent"] = sent
    return env._observe_extra(state)


def test_the_verifier_sees_only_the_pixels_that_messages_revealed():
    env = tiny_env(protocol("nip", max_rounds=4), two_images(), patch_size=2)
    prover, verifier = 0, 1
    assert env.grid == (2, 2) and env.num_actions == 6
    sent = torch.full((2, env.num_steps, 2), -1)
    sent[:, 1, prover] = 0  # the prover revealed patch 0 (the top-left 2x2 pixels)
    seen = observe(env, sent)
    # The unrevealed pixel that differs leaves the verifier's input as it was; the prover sees it.
    for key in ("image", "visible", "messages"):
        assert torch.equal(seen[key][0, verifier], seen[key][1, verifier]), key
    assert not torch.equal(seen["image"][0, prover], seen["image"][1, prover])
    expected = torch.zeros(4, 4, dtype=torch.bool)
    expected[:2, :2] = True
    assert torch.equal(seen["visible"][0, verifier], expected) and seen["visible"][:, prover].all()
    assert torch.equal(seen["image"][0, verifier, 0], env.data["images"][0, 0].float() / 255 * expected)
    # Once the patch holding it is revealed (here by the verifier's own message), the pixel reaches the verifier.
    sent[:, 0, verifier] = 3
    seen = observe(env, sent)
    assert not torch.equal(seen["image"][0, verifier], seen["image"][1, verifier])
    assert seen["messages"][0, verifier, 0 * 2 + verifier].flatten().tolist() == [0, 0, 0, 1]
    assert seen["messages"][0, verifier, 1 * 2 + prover].flatten().tolist() == [1, 0, 0, 0]
    # With verifier_view: full the verifier sees the whole image, as in the NIP reference.
    full = observe(tiny_env(protocol("nip", max_rounds=4), two_images(), patch_size=2, verifier_view="full"), sent * 0 - 1)
    assert full["visible"].all() and not torch.equal(full["image"][0, verifier], full["image"][1, verifier])


def test_a_patch_cut_short_by_the_image_edge_reveals_only_its_pixels():
    env = tiny_env(protocol("nip", max_rounds=4), torch.zeros(1, 3, 5, 3, dtype=torch.uint8), patch_size=2)
    assert env.grid == (3, 2)
    sent = torch.full((1, env.num_steps, 2), -1)
    sent[0, 1, 0] = 5  # the bottom-right patch: one pixel
    visible = observe(env, sent)["visible"][0, 1]
    assert visible.nonzero().tolist() == [[4, 2]]


def test_private_channels_reveal_a_patch_to_those_who_read_it():
    env = tiny_env(protocol("mnip", max_rounds=4), two_images(), patch_size=2)
    sent = torch.full((2, env.num_steps, 3), -1)
    sent[:, 1, 0], sent[:, 1, 1] = 1, 2  # prover0 and prover1 each reveal one patch to the verifier
    messages = observe(env, sent)["messages"]
    read = lambda agent: (messages[0, agent].sum(0) > 0).flatten().nonzero().flatten().tolist()  # noqa: E731
    assert read(2) == [1, 2] and read(0) == [1] and read(1) == [2]


def random_policy(tensordict):
    """Uniform logits and a random legal action for every agent (a zero-knowledge step reads the logits)."""
    mask = tensordict["agents", "action_mask"]
    tensordict["agents", "logits"] = torch.zeros(mask.shape)
    tensordict["agents", "action"] = torch.multinomial(mask.flatten(0, 1).float(), 1).view(mask.shape[:-1])
    return tensordict


@pytest.mark.parametrize("name", ["nip", "merlin_arthur"])
def test_the_environment_passes_check_env_specs(name):
    options = {"max_rounds": 4} if name == "nip" else {}
    check_env_specs(tiny_env(protocol(name, **options), two_images(), patch_size=2))
    # The zero-knowledge version steps only with the policy's logits: its rollout stays in its specs.
    env = tiny_env(protocol(name, zero_knowledge=True, **options), two_images(), patch_size=2)
    rollout = env.rollout(6, policy=random_policy, break_when_any_done=False)
    for step in range(6):
        assert env.observation_spec.is_in(rollout[:, step]) and env.observation_spec.is_in(rollout[:, step]["next"])


def test_the_simulator_sees_only_its_own_patches():
    proto = protocol("nip", max_rounds=4, zero_knowledge=True)
    env = tiny_env(proto, two_images(), patch_size=2)
    state = env.new_state(torch.arange(2))
    state["round"] = torch.full((2,), 2)
    state["sent"][:, 0, 1], state["sent"][:, 1, 0] = 0, 1  # the verifier's patch 0, the prover's patch 1
    state["simulated"][:, 0] = 3
    visible = env._observe_extra(state)["visible"][0].flatten(1)  # (agents, pixels)
    patch_of_pixel = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3])
    revealed = lambda agent: sorted(set(patch_of_pixel[visible[agent]].tolist()))  # noqa: E731
    assert revealed(proto.verifier_index) == revealed(proto.adversarial_index) == [0, 1]
    assert revealed(proto.simulator_index) == [3]


# ----------------------------------------------------------- demonstrations
def test_an_honest_prover_reveals_the_most_telling_unseen_patch():
    evidence = torch.tensor([[0.5, 3.0, -2.0, 1.0]])
    seen = torch.tensor([[False, True, False, False]])
    assert honest_patches(evidence, seen, accept_side=True).item() == 3
    assert honest_patches(evidence, seen, accept_side=False).item() == 2
    # A pixel that is bright in the positive class only is evidence for it.
    images = torch.zeros(4, 1, 2, 2, dtype=torch.uint8)
    images[2:, 0, 0, 1] = 255
    model = PixelEvidence.fit(images, torch.tensor([False, False, True, True]))
    patch = model.patch_evidence(images.float() / 255, 1, (2, 2))
    assert patch[2].argmax().item() == 1 and patch[0].argmin().item() == 1


@pytest.mark.parametrize("name", tiered(PROOF_PROTOCOLS, fast=PROOF_PROTOCOLS[:3]))  # the first three in the fast tier
def test_demonstrations_follow_the_sides_and_show_the_label(cache_dir, name):
    scenario = build_scenario(ic_config(cache_dir, protocol=name))
    data = scenario.demonstrations("val", seed=0)
    assert sorted(data) == sorted(scenario.agent_names)
    env = scenario.make_env(1, "val", 0, "cpu")
    verifier = data["verifier"]
    deciding = verifier["target_mask"][:, : env.num_positions].any(-1).logical_not()
    decisions, looks = verifier[deciding], verifier[~deciding]
    accept = torch.where(decisions["label"], env.accept_action, env.reject_action)
    assert len(decisions) and torch.equal(decisions["target_action"], accept)
    # Before its last turn the verifier is shown looking: a patch it had not seen.
    index = scenario.protocol.verifier_index
    turns = int(scenario.protocol.active_agents(torch.arange(scenario.protocol.num_rounds))[:, index].sum())
    assert len(looks) == len(scenario.split("val")) * (turns - 1)
    seen = looks["agents", "messages"][:, index].sum(1).flatten(1) > 0
    assert not seen.gather(1, looks["target_action"].unsqueeze(1)).any()
    evidence = scenario.evidence()
    telling = evidence.patch_information(1, env.grid).expand(len(looks), -1)  # the patches most telling on average
    assert torch.equal(looks["target_action"], honest_patches(telling, seen, accept_side=True))
    for prover, side in scenario.protocol.prover_sides.items():
        shown = data[prover]
        index = scenario.agent_names.index(prover)
        images = shown["agents", "image"][:, index]
        seen = shown["agents", "messages"][:, index].sum(1).flatten(1) > 0
        expected = honest_patches(evidence.patch_evidence(images, 1, env.grid), seen, side)
        assert torch.equal(shown["target_action"], expected), prover


# ---------------------------------------------------------------- end to end
@pytest.mark.parametrize("name", PROOF_PROTOCOLS)
def test_every_proof_protocol_trains_one_ppo_iteration(tmp_path, cache_dir, name, run_probe):
    metrics = run_experiment(ic_config(cache_dir, protocol=name), tmp_path)
    assert run_probe.changed() == set(run_probe.trainer.agent_names)
    assert metrics["test/episodes"] == 16
    assert 0.0 <= metrics["test/accuracy"] <= 1.0 and 0.0 <= metrics["test/revealed_share"] <= 1.0
    assert 1.0 <= metrics["test/episode_length"] <= run_probe.trainer.scenario.protocol.num_rounds


def test_zero_knowledge_nip_trains(tmp_path, cache_dir, run_probe):
    config = ic_config(cache_dir, "protocol.zero_knowledge=true")
    metrics = run_experiment(config, tmp_path)
    assert run_probe.trainer.agent_names == ("prover", "verifier", "adversarial_verifier", "simulator")
    assert run_probe.changed() == set(run_probe.trainer.agent_names)
    assert 0.0 < metrics["test/zero_knowledge/adversarial_share"] < 1.0


#: Every registered RL objective but PPO (trained above); the slow tier runs them all.
OBJECTIVES = [name for name in TRAINERS.names(subclass_of=TensorDictRlTrainer) if name != "ppo"]


@pytest.mark.parametrize("trainer", tiered(OBJECTIVES, fast=["dpo", "reinforce"]))
def test_every_rl_trainer_runs_on_it(tmp_path, cache_dir, trainer):
    metrics = run_experiment(ic_config(cache_dir, f"trainer={trainer}"), tmp_path)
    assert "test/accuracy" in metrics


@pytest.mark.slow  # about a second or more: the fast tier keeps tests under ~0.8 s
def test_the_solo_agent_and_the_warm_start_run(tmp_path, cache_dir):
    solo = ("trainer=solo_agent", "scenario.verifier_view=full")
    metrics = run_experiment(ic_config(cache_dir, *solo, protocol="solo_verifier"), tmp_path / "solo")
    assert {"test/accuracy", "test/precision", "test/recall"} <= set(metrics)
    warm = (
        "trainer.pretrain.agents=[\"*\"]", "trainer.pretrain.epochs=1",
        "scenario.demonstration_episodes=1", f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
    )
    trainer = build_trainer(ic_config(cache_dir, *warm), tmp_path / "warm_run")
    assert {"pretrain/prover/train_accuracy", "pretrain/verifier/train_accuracy"} <= set(trainer.pretrain_metrics)


def test_the_splits_are_disjoint_and_stratified(cache_dir):
    scenario = build_scenario(ic_config(cache_dir))
    splits = scenario.splits()
    assert [len(part) for part in splits.values()] == [140, 20, 40]
    indices = [set(part.source_index.tolist()) for part in splits.values()]
    assert not (indices[0] & indices[1] or indices[0] & indices[2] or indices[1] & indices[2])
    assert all(int(part.label.sum()) * 2 == len(part) for part in splits.values())  # balanced, and stratified
    assert isinstance(splits["train"], LabelledImages) and splits["train"].image_shape == (1, 8, 8)


def test_a_dataset_file_replaces_a_split_if_its_images_fit(tmp_path, cache_dir):
    scenario = build_scenario(ic_config(cache_dir))
    val = scenario.split("val")
    val.save(tmp_path / "val.pt")
    assert scenario.use_dataset_file(tmp_path / "val.pt") == len(val)
    assert scenario.split("test").checksum() == val.checksum()
    wide = LabelledImages(torch.zeros(2, 1, 8, 9, dtype=torch.uint8), torch.tensor([True, False]), torch.zeros(2, dtype=torch.long), torch.arange(2))
    wide.save(tmp_path / "wide.pt")
    with pytest.raises(ConfigError, match="holds images of 1x8x9 \\(channels x height x width\\); this run's agents take 1x8x8"):
        scenario.use_dataset_file(tmp_path / "wide.pt")


@pytest.mark.slow
def test_the_nip_verifier_beats_the_solo_verifier_on_held_out_digits(tmp_path):
    """The image_quick result, shortened: seed 0, 40 of its 60 iterations (docs: image_classification, "Results").

    The solo verifier runs 2 iterations, without evaluation, tested on its final
    agents: its validation accuracy is flat from its first evaluation on (every
    evaluation of the docs' 60-iteration runs, seeds 0-2, lies between 0.46 and
    0.54), so more iterations would only spend CI time (it had 10 and one
    evaluation: 10.9 CPU seconds against 3.9, 0.494 either way). Seed 0, 2026-12-02: NIP 0.731
    (validation 0.46, 0.46, 0.65, 0.73 at iterations 10 to 40, so NIP keeps
    its 40), the solo verifier 0.494: a gap of 0.24 against the 0.15 asked
    for, and 0.19 against the highest solo accuracy those runs saw.
    """
    from tests.conftest import make_config

    accuracy = {}
    solo = ("trainer.eval.every=0", "trainer.eval.test_checkpoint=final")
    for protocol, iterations, options in (("nip", 40, ()), ("solo_verifier", 2, solo)):
        config = make_config(
            "preset=image_quick", f"protocol={protocol}", "run.progress_bar=false", "logger=none", "run.num_threads=1",
            f"scenario.cache_dir={tmp_path / 'data'}", f"trainer.pretrain.cache_dir={tmp_path / 'warm'}",
            f"trainer.num_iterations={iterations}", "trainer.num_test_episodes=512", *options,
        )
        accuracy[protocol] = run_experiment(config, tmp_path / protocol, handle_signals=False)["test/accuracy"]
    assert accuracy["nip"] >= accuracy["solo_verifier"] + 0.15, accuracy
    assert accuracy["nip"] >= 0.65, accuracy
