"""The image-classification scenario."""

from nip_like.scenarios.image_classification.scenario import ImageClassificationScenario

__all__ = ["ImageClassificationScenario"]
