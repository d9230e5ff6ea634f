"""The image-classification scenario: data, environments, convolutional agents and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from nip_like.agent_modules import AgentModules
from nip_like.allowed import Allowed, checked
from nip_like.distributions import masked_log_softmax
from nip_like.errors import ConfigError
from nip_like.folders import check_writable_folder
from nip_like.protocols.multi_channel import MultiChannelTestProtocol, message_visibility
from nip_like.protocols.zero_knowledge import ADVERSARIAL_KEY
from nip_like.registry import register_scenario, typed_entry
from nip_like.scenarios.base import Demonstrating, GeneratedData, Labelled, ScenarioConfig, TensorGame
from nip_like.scenarios.messaging import MessageFeatures, Messaging, one_hot_messages
from nip_like.scenarios.decisions import check_proof_scenario, decision_metrics, precision_recall
from nip_like.scenarios.graph_isomorphism.scenario import zero_knowledge_metrics
from nip_like.scenarios.image_classification.agents import ImageAgentConfig, build_image_agents
from nip_like.scenarios.image_classification.data import (
    BINARISATIONS,
    DIGITS,
    ImageSpec,
    LabelledImages,
    build_images,
    cache_path,
    check_source,
    resolve_source,
    source_fingerprint,
)
from nip_like.scenarios.image_classification.demonstrations import PixelEvidence, play_demonstrations
from nip_like.scenarios.image_classification.environment import (
    VERIFIER_VIEWS,
    ImageClassificationEnv,
    grid_shape,
    revealed_patches,
)

SPLITS = ("train", "val", "test")


@dataclass
class ImageClassificationConfig(ScenarioConfig):
    """The image-classification scenario (see :mod:`nip_like.scenarios.image_classification`)."""

    name: str = "image_classification"  # scenario name
    source: str = DIGITS  # "digits" (scikit-learn's 8x8 digits), a folder of class folders (ImageFolder layout) or an .npz file
    binarisation: str = checked("merge", choices=BINARISATIONS)  # how classes become two labels: merge, select_two or random
    selected_classes: list[int] = checked(factory=lambda: [0, 1], length=2, each=Allowed(ge=0))  # select_two's classes: negative, positive
    binarisation_seed: int = checked(0, ge=0)  # seed of merge's shuffle of the classes and of random's labels
    make_balanced: bool = True  # drop images of the more frequent label until both are equally many
    max_images: int = checked(0, ge=0)  # keep at most this many images (a label-stratified draw); 0 keeps all
    image_size: int = checked(0, ge=0, le=512)  # resize every image to this many pixels a side; 0 keeps the source's size
    dataset_seed: int = checked(0, ge=0)  # seed of the balancing, the draw of max_images, the shuffle and the splits
    val_fraction: float = checked(0.1, gt=0, lt=1)  # share of images in the validation split (periodic evaluation)
    test_fraction: float = checked(0.2, gt=0, lt=1)  # share of images in the held-out test split
    cache_dir: str = "~/.cache/nip_like/datasets"  # where built datasets are cached
    patch_size: int = checked(1, ge=1, le=64)  # a message names a patch of patch_size x patch_size pixels
    verifier_view: str = checked("revealed", choices=VERIFIER_VIEWS)  # revealed: the verifier sees only revealed patches; full: the whole image
    demonstration_episodes: int = checked(1, ge=1)  # honest-play episodes per image in the warm start's demonstrations (they differ only where the protocol draws, as merlin_arthur's speaker)
    agents: dict[str, Any] = field(default_factory=dict)  # per-agent ImageAgentConfig entries; others use default_agent
    default_agent: ImageAgentConfig = field(default_factory=ImageAgentConfig)  # network size of agents not in agents


@register_scenario("image_classification", ImageClassificationConfig)
class ImageClassificationScenario(GeneratedData, TensorGame, Demonstrating, Labelled, Messaging):
    """Decide whether an image is of the positive class, seeing only the patches that messages reveal.

    The dataset is made once per spec from a source of labelled images and
    cached (:meth:`generate`, :meth:`data_cache_path`), then split into
    disjoint, label-stratified train, validation and test images. Periodic
    evaluation plays the validation split, the final test loop the test split.
    It plays every interactive-proof protocol, their zero-knowledge versions
    and ``multi_channel_test``.
    """

    dataset_class = LabelledImages
    split_names = SPLITS
    eval_split = "val"
    supports_zero_knowledge = True
    #: Version of :meth:`demonstrations` (part of the warm-start cache key); for a path
    #: source, each instance adds the fingerprint of its files (``"1:<fingerprint>"``).
    pretrain_data_version = 1

    def __init__(self, config, protocol) -> None:
        super().__init__(config, protocol)
        if isinstance(protocol, MultiChannelTestProtocol):
            check_multi_channel(config, protocol)
        else:
            check_proof_scenario("image_classification", config, protocol)
        classes = list(config.selected_classes)
        if config.binarisation == "select_two" and classes[0] == classes[1]:
            raise ConfigError(f"scenario.selected_classes must be two different classes for select_two, got {classes}")
        self.spec = self.data_spec()
        if self.spec.fingerprint:
            # Files of a path source can change under the same config: a warm start is keyed by them too.
            self.pretrain_data_version = f"{type(self).pretrain_data_version}:{self.spec.fingerprint}"
        check_writable_folder(Path(config.cache_dir), "scenario.cache_dir")
        self._evidence: PixelEvidence | None = None

    # -------------------------------------------------------------------- data
    def data_spec(self) -> ImageSpec:
        """What :meth:`generate` makes, from the config (``self.spec``); its ``key()`` names the cache file.

        Options a binarisation does not read are left out of the spec (so they
        do not change its key), and a path source is fingerprinted
        (:func:`~nip_like.scenarios.image_classification.data.source_fingerprint`).
        """
        config = self.config
        source = resolve_source(str(config.source))
        method = str(config.binarisation)
        return ImageSpec(
            source=source,
            fingerprint=source_fingerprint(source),
            binarisation=method,
            selected_classes=tuple(int(c) for c in config.selected_classes) if method == "select_two" else (),
            binarisation_seed=int(config.binarisation_seed) if method != "select_two" else 0,
            make_balanced=bool(config.make_balanced),
            max_images=int(config.max_images),
            image_size=int(config.image_size),
            seed=int(config.dataset_seed),
        )

    def preflight(self) -> None:
        """Refuse, before the run folder is made, a source that cannot make the dataset.

        First its layout (its files listed, no pixel read: two classes, the
        arrays of an ``.npz``); then, for a path source whose dataset is not
        cached yet, the dataset is made, checked and cached here (:meth:`splits`:
        its pixels, its labels, both binary labels, non-empty splits), so that
        what is wrong with the files is said before the run folder exists and
        the run itself reads the cache. ``digits`` is bundled and checked by the tests.
        """
        check_source(self.spec.source)
        if self.spec.source != DIGITS and not self.data_cache_path().is_file():
            self.splits()

    def generate(self, spec: ImageSpec) -> LabelledImages:
        """The whole dataset of ``spec``, before the splits (:func:`~nip_like.scenarios.image_classification.data.build_images`)."""
        return build_images(spec)

    def base_cache_path(self) -> Path:
        """The images' cache file: ``images_<spec key>.pt`` in ``scenario.cache_dir``."""
        return cache_path(self.spec, Path(self.config.cache_dir).expanduser())

    def splits(self) -> dict:
        """The label-stratified splits (:meth:`GeneratedData.splits`); a split without images is refused in one line."""
        splits = super().splits()
        empty = [name for name, part in splits.items() if len(part) == 0]
        if empty:
            total = sum(len(part) for part in splits.values())
            raise ConfigError(
                f"the {empty[0]} split of scenario.source={self.config.source} holds no image ({total} in all); "
                "use more images or larger scenario.val_fraction and scenario.test_fraction"
            )
        return splits

    def check_dataset(self, data: LabelledImages, path: Path) -> None:
        """Refuse, in one line, a dataset file whose images are not of this run's size (``evaluate --data``)."""
        if data.image_shape != self.image_shape:
            raise ConfigError(
                f"{path} holds images of {'x'.join(map(str, data.image_shape))} (channels x height x width); "
                f"this run's agents take {'x'.join(map(str, self.image_shape))}"
            )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the images (reads the data)."""
        return self.split("train").image_shape

    def make_env(
        self, num_envs: int, split: str, seed: int, device: torch.device | str, group_size: int = 1
    ) -> ImageClassificationEnv:
        images = self.split(split)
        return ImageClassificationEnv(
            self.protocol,
            images.images,
            images.label,
            num_envs=num_envs,
            device=device,
            seed=seed,
            group_size=group_size,
            patch_size=int(self.config.patch_size),
            verifier_view=str(self.config.verifier_view),
        )

    # ------------------------------------------------------------------ agents
    def agent_sizes(self) -> dict[str, ImageAgentConfig]:
        """Each agent's network sizes (``scenario.agents.<name>`` or ``scenario.default_agent``)."""
        return {
            name: typed_entry(ImageAgentConfig, self.config.agents[name], f"scenario.agents.{name}")
            if name in self.config.agents
            else self.config.default_agent
            for name in self.agent_names
        }

    def make_agents(self) -> AgentModules:
        steps = self.protocol.num_rounds
        return build_image_agents(
            self.agent_names,
            self.image_shape,
            int(self.config.patch_size),
            steps * len(self.protocol.transcript_agent_names),
            steps + 1,
            self.agent_sizes(),
        )

    # ---------------------------------------------------------------- messages
    def message_features(self, episodes: TensorDictBase, policy: Any) -> list[MessageFeatures]:
        """Each prover's patches laid out on the patch grid, one channel per step (``T, G_h, G_w``): an image a CNN reads."""
        grid = grid_shape(*self.image_shape[-2:], int(self.config.patch_size))
        sent = episodes["state", "sent"]
        names = self.protocol.transcript_agent_names
        flat = one_hot_messages(sent, names, self.protocol.prover_indices, grid[0] * grid[1])
        steps = sent.shape[1]
        return [MessageFeatures(item.who, "image", item.values.reshape(-1, steps, *grid)) for item in flat]

    # -------------------------------------------------------- supervised data
    def supervised_data(self, split: str) -> TensorDict:
        """Labelled first observations of every image of ``split``, for the solo-agent trainer.

        Returns
        -------
        TensorDict
            Batch ``(images,)``: each agent's observation entries at the first
            step (no messages yet: with ``verifier_view: revealed`` the
            verifier sees nothing), ``"target_action"`` (accept for the
            positive class), ``"target_mask"`` (the two decisions) and ``"label"``.
        """
        images = self.split(split)
        env = self.make_env(1, split, 0, "cpu")
        count = len(images)
        state = env.new_state(torch.arange(count))
        state["round"] = torch.zeros(count, dtype=torch.int64)
        observation, _ = env._observe(state)
        active = torch.ones(count, env.num_agents, dtype=torch.bool)  # every agent acting: each one's decision can be read
        agents = TensorDict(
            {**env._observe_extra(state), "observation": observation, "active": active}, batch_size=[count, env.num_agents]
        )
        target_mask = torch.zeros(count, env.num_actions, dtype=torch.bool)
        target_mask[:, [env.reject_action, env.accept_action]] = True
        target = torch.where(self.verifier_accepts(images), env.accept_action, env.reject_action)
        return TensorDict(
            {"agents": agents, "target_mask": target_mask, "target_action": target, "label": images.label},
            batch_size=[count],
        )

    def supervised_metrics(self, predicted: torch.Tensor, data: TensorDictBase) -> dict[str, float]:
        """Precision and recall (accept = positive) of supervised predictions."""
        return precision_recall(predicted == data["target_mask"].shape[-1] - 1, data["label"])

    # ------------------------------------------------------ demonstrations
    def verifier_accepts(self, images: LabelledImages) -> torch.Tensor:
        """``(len(images),)`` bool: the decision the warm start teaches the verifier (and the supervised target); the label."""
        return images.label

    def evidence(self) -> PixelEvidence:
        """The per-pixel class model that the honest provers' patches come from, fitted on the train split."""
        if self._evidence is None:
            train = self.split("train")
            self._evidence = PixelEvidence.fit(train.images, train.label)
        return self._evidence

    def demonstration_agents(self) -> list[str]:
        """The verifier, and every prover that has a turn (each shows the evidence for its side)."""
        active = self.protocol.active_agents(torch.arange(self.protocol.num_rounds)).any(0)
        verifier = self.protocol.verifier_index
        return [
            name
            for index, name in enumerate(self.protocol.transcript_agent_names)
            if index == verifier or bool(active[index])
        ]

    def demonstrations(self, split: str, seed: int = 0) -> dict[str, TensorDictBase]:
        """Honest play on every image of ``split``, as decision datapoints per agent, for a warm start.

        Each image is played ``scenario.demonstration_episodes`` times
        (:func:`~nip_like.scenarios.image_classification.demonstrations.play_demonstrations`):
        until its last turn, when it decides, the verifier reveals the patch
        it has not seen on which the classes differ most, and it is shown the
        right decision (:meth:`verifier_accepts`) wherever it may decide (so
        it learns both to look until its last turn and what to decide); a prover arguing for *accept* reveals the
        unseen patch with the most evidence for the positive class, one arguing
        for *reject* the patch with the least (:meth:`evidence`). With no
        prover and one step (``solo_verifier``) each image is played once.

        Returns
        -------
        dict of str to TensorDict
            Per agent of :meth:`demonstration_agents`: ``"agents"``,
            ``"target_action"``, ``"target_mask"`` and ``"label"``, as
            :meth:`supervised_data` lays them out.
        """
        generator = torch.Generator().manual_seed(seed)
        env = self.make_env(1, split, 0, "cpu")
        episodes = int(self.config.demonstration_episodes) if self.protocol.num_rounds > 1 else 1
        images = self.split(split)
        return play_demonstrations(
            env, self.protocol, images, episodes, generator, self.evidence(), accepts=self.verifier_accepts(images)
        )

    # ----------------------------------------------------------------- metrics
    def policy_metrics(self, batch: TensorDictBase) -> dict[str, float]:
        """Message and decision entropies of the collecting policy.

        ``agents/<name>/policy/message_entropy``: entropy of the patch an
        agent sends, given that it sends one, over its active steps.
        ``agents/verifier/policy/decision_entropy``: entropy of the verifier's
        three-way choice (reject, accept, continue with any patch) over the
        steps where it may decide.
        """
        logits = batch.get(("agents", "logits"))
        mask = batch.get(("agents", "action_mask"))
        active = batch.get(("agents", "active"))
        patches = logits.shape[-1] - 2
        patch_mask = mask[..., :patches]
        patch_log_p = masked_log_softmax(logits[..., :patches], patch_mask)
        entropy = -(patch_log_p.exp() * torch.where(patch_mask, patch_log_p, torch.zeros_like(patch_log_p))).sum(-1)
        sends = patch_mask.any(-1) & active
        metrics = {
            f"agents/{name}/policy/message_entropy": entropy[..., index][sends[..., index]].mean().item()
            for index, name in enumerate(self.agent_names)
            if sends[..., index].any()
        }
        verifier = self.protocol.verifier_index
        deciding = mask[..., verifier, patches:].any(-1) & active[..., verifier]
        if deciding.any():
            probs = masked_log_softmax(logits[..., verifier, :], mask[..., verifier, :]).exp()
            three = torch.stack([probs[..., patches], probs[..., patches + 1], probs[..., :patches].sum(-1)], -1)
            three = three[deciding].clamp_min(1e-12)
            metrics["agents/verifier/policy/decision_entropy"] = (-(three * three.log()).sum(-1)).mean().item()
        return metrics

    def episode_metrics(self, episodes: TensorDictBase) -> dict[str, float]:
        """Verifier accuracy (per episode, per image, worst image), precision, recall, length and revealed share.

        ``revealed_share``: the share of the image's patches revealed to the
        verifier by the end of the episode. Precision and recall treat
        *accept* (the positive class) as the positive class. Under a
        zero-knowledge protocol the decision metrics count the verifier's
        episodes only, and the simulator's distance is added.
        """
        metrics = super().episode_metrics(episodes)
        state = episodes.get("state")
        metrics["episode_length"] = state["round"].float().mean().item()
        sent = state["sent"]
        _, height, width = self.image_shape
        grid = grid_shape(height, width, int(self.config.patch_size))
        visibility = message_visibility(self.protocol).to(sent.device)
        seen = revealed_patches(sent, visibility, grid)[:, self.protocol.verifier_index]
        metrics["revealed_share"] = seen.flatten(1).float().mean().item()
        if self.protocol.zero_knowledge:
            metrics.update(zero_knowledge_metrics(state))
            state = state[~state[ADVERSARIAL_KEY]]
            if not state.batch_size[0]:
                return metrics
        metrics.update(decision_metrics(state["decision"], state["label"], state["image_index"]))
        return metrics



def check_multi_channel(config, protocol: MultiChannelTestProtocol) -> None:
    """Refuse, in one line, ``scenario.agents`` entries that ``multi_channel_test`` lacks or split sizes that leave no image.

    What :func:`~nip_like.scenarios.decisions.check_proof_scenario` checks of
    a proof protocol, for the one protocol here that is not one.
    """
    unknown = sorted(set(config.get("agents", {})) - set(protocol.agent_names))
    if unknown:
        raise ConfigError(
            f"scenario.agents names {unknown}, which protocol {protocol.name!r} does not have; "
            f"its agents are {list(protocol.agent_names)}"
        )
    if config.val_fraction + config.test_fraction >= 1:
        raise ConfigError(
            f"scenario.val_fraction and scenario.test_fraction must sum to less than 1, "
            f"got {config.val_fraction} and {config.test_fraction}"
        )
