"""Binary image datasets made from labelled images, cached on disk.

A source of labelled images (:func:`load_source`) is one of

* ``digits``: the 1797 8x8 grey digits bundled with scikit-learn
  (:func:`sklearn.datasets.load_digits`, no download), ten classes;
* a folder in torchvision's ImageFolder layout, ``root/<class>/<image>``:
  one sub-folder per class, the classes in sorted order of the folder names;
* an ``.npz`` file holding an image array and a label array
  (:data:`NPZ_KEYS`); the classes are the sorted distinct labels.

:func:`binarise` turns its classes into two labels by one of the NIP
reference's methods (:data:`BINARISATIONS`); :func:`build_images` makes the
whole dataset of an :class:`ImageSpec` (binarised, balanced, subsampled,
shuffled) and :func:`load_or_build_images` keeps it in a checked cache file
named by the spec's key. Images are stored as ``uint8`` in ``[0, 255]``,
channels first. This module registers nothing.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from nip_like.errors import ConfigError
from nip_like.interrupts import stop_point
from nip_like.scenarios.datasets import DatasetFileError, DatasetSpec, TensorDataset, apportion, load_or_build

#: Version of :func:`build_images`; it enters :meth:`ImageSpec.key`, so a change to
#: how images are made never reuses an old cache file.
GENERATOR_VERSION = 1

#: The bundled source (scikit-learn's digits); any other ``source`` is a path.
DIGITS = "digits"

#: How classes become two labels (:func:`binarise`).
BINARISATIONS = ("merge", "select_two", "random")

#: The array names an ``.npz`` source may use, images first, in the order they are tried.
#: ``x_train`` and ``y_train`` are joined by ``x_test`` and ``y_test`` when the file has them (Keras's MNIST).
NPZ_KEYS = (("images", "labels"), ("x", "y"), ("x_train", "y_train"))

#: File extensions read from an ImageFolder (case-insensitive), as torchvision's.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")

#: PIL modes read as one grey channel; a folder whose images are all of these is grey, any other is RGB.
GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")

WHAT_SOURCES_ARE = '"digits", a folder of class folders (the ImageFolder layout) or an .npz file'


@dataclass(frozen=True)
class ImageSpec(DatasetSpec):
    """What :func:`build_images` makes; every field enters :meth:`key`.

    Parameters
    ----------
    source : str
        ``"digits"``, or the absolute path of an ImageFolder or an ``.npz`` file.
    fingerprint : str
        For a path, a hash of its files' names, sizes and modification times
        (:func:`source_fingerprint`), so that changed files make a new cache
        file; empty for ``digits``.
    binarisation : str
        One of :data:`BINARISATIONS`.
    selected_classes : tuple of int
        ``select_two``'s two classes (the first negative, the second positive);
        empty for the other methods.
    binarisation_seed : int
        Seed of ``merge``'s shuffle of the classes and of ``random``'s labels; 0 for ``select_two``.
    make_balanced : bool
        Drop images of the more frequent label, drawn at random, until both are equally many.
    max_images : int
        Keep at most this many images (a label-stratified draw); 0 keeps all.
    image_size : int
        Resize every image to ``image_size x image_size`` pixels; 0 keeps the source's size.
    seed : int
        Seed of the balancing, the draw of ``max_images`` and the final shuffle (and of the splits).
    """

    source: str = DIGITS
    fingerprint: str = ""
    binarisation: str = "merge"
    selected_classes: tuple[int, ...] = ()
    binarisation_seed: int = 0
    make_balanced: bool = True
    max_images: int = 0
    image_size: int = 0
    seed: int = 0

    generator_version: ClassVar[int] = GENERATOR_VERSION

    def __post_init__(self) -> None:
        self._check_integers({"binarisation_seed": 0, "max_images": 0, "image_size": 0, "seed": 0})
        if self.binarisation not in BINARISATIONS:
            self._fail("binarisation", f"one of {list(BINARISATIONS)}", self.binarisation)
        classes = tuple(self.selected_classes)
        if self.binarisation == "select_two" and (len(classes) != 2 or classes[0] == classes[1] or min(classes) < 0):
            self._fail("selected_classes", "two different class indices >= 0 for select_two", self.selected_classes)
        object.__setattr__(self, "selected_classes", tuple(int(c) for c in classes))
        object.__setattr__(self, "make_balanced", bool(self.make_balanced))


@dataclass(eq=False)
class LabelledImages(TensorDataset):
    """``N`` images with a binary label each.

    Parameters
    ----------
    images : torch.Tensor
        ``(N, C, H, W)`` uint8 in ``[0, 255]``: ``C`` is 1 (grey) or 3 (RGB).
    label : torch.Tensor
        ``(N,)`` bool: the positive class (the verifier should accept).
    source_class : torch.Tensor
        ``(N,)`` long: the image's class in the source (0-based, as :func:`load_source` numbers them).
    source_index : torch.Tensor
        ``(N,)`` long: the image's position in the source.
    """

    images: torch.Tensor
    label: torch.Tensor
    source_class: torch.Tensor
    source_index: torch.Tensor

    FILE_KIND = "nip_like.labelled_images"
    DESCRIPTION = "labelled-images"

    def __post_init__(self) -> None:
        images = self.images
        size = images.shape[0] if isinstance(images, torch.Tensor) and images.ndim == 4 else -1
        shape = tuple(images.shape[1:]) if size >= 0 else (1, 1, 1)
        self._check_layout(
            {
                "images": ((size, *shape), torch.uint8),
                "label": ((size,), torch.bool),
                "source_class": ((size,), torch.long),
                "source_index": ((size,), torch.long),
            }
        )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of every image."""
        return tuple(self.images.shape[1:])


@dataclass
class SourceImages:
    """Every image of a source, with its class: what :func:`load_source` reads.

    Attributes
    ----------
    images : numpy.ndarray
        ``(N, C, H, W)`` uint8.
    classes : numpy.ndarray
        ``(N,)`` int64 class indices ``0 .. K-1``.
    class_names : list of str
        The name of each class (the folder name, or the label value).
    """

    images: np.ndarray
    classes: np.ndarray
    class_names: list[str]


# ------------------------------------------------------------------ sources
def resolve_source(source: str) -> str:
    """``"digits"``, or ``source`` as an absolute path that exists and is a folder or an ``.npz`` file.

    Raises
    ------
    ConfigError
        If the path is missing or is neither a folder nor an ``.npz`` file.
    """
    if source == DIGITS:
        return DIGITS
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"scenario.source: {path} does not exist; give {WHAT_SOURCES_ARE}")
    if not path.is_dir() and path.suffix.lower() != ".npz":
        raise ConfigError(f"scenario.source: {path} is neither a folder nor an .npz file; give {WHAT_SOURCES_ARE}")
    return str(path)


def _image_files(root: Path) -> list[tuple[str, list[Path]]]:
    """Each class folder of ``root`` (sorted, hidden ones skipped) with its image files (sorted, recursively)."""
    classes = []
    for folder in sorted(entry for entry in root.iterdir() if entry.is_dir() and not entry.name.startswith(".")):
        files = sorted(
            path
            for path in folder.rglob("*")
            if path.is_file() and not path.name.startswith(".") and path.suffix.lower() in IMAGE_EXTENSIONS
        )
        classes.append((folder.name, files))
    return classes


def check_source(source: str) -> None:
    """Refuse, in one line and without reading any pixel, a source that cannot hold two classes.

    ``source`` is what :func:`resolve_source` returns. An ImageFolder needs
    two class folders holding images; an ``.npz`` file one of the pairs of
    :data:`NPZ_KEYS` (only its table of contents is read). What needs the
    pixels (sizes, unreadable images, array shapes) is checked by
    :func:`load_source`.

    Raises
    ------
    DatasetFileError
        Naming the file and what is expected.
    """
    if source == DIGITS:
        return
    path = Path(source)
    if path.is_dir():
        found = [name for name, files in _image_files(path) if files]
        if len(found) < 2:
            raise DatasetFileError(
                f"{path}: an ImageFolder needs at least two class folders holding images "
                f"({', '.join(IMAGE_EXTENSIONS)}), found {len(found)} {found}"
            )
        return
    with open_npz(path) as archive:
        names = list(archive.files)
    if not any(x in names and y in names for x, y in NPZ_KEYS):
        expected = " or ".join(f"'{x}' and '{y}'" for x, y in NPZ_KEYS)
        raise DatasetFileError(f"{path}: an .npz source needs the arrays {expected}, found {names}")


def open_npz(path: Path) -> np.lib.npyio.NpzFile:
    """Open an ``.npz`` file for reading its arrays (no pickled objects); close it after use.

    Raises
    ------
    DatasetFileError
        If the file is not an ``.npz`` archive (a zip file of NumPy arrays) or cannot be read.
    """
    try:
        if not zipfile.is_zipfile(path):
            raise DatasetFileError(f"{path} is not an .npz file (a zip archive of NumPy arrays, as numpy.savez writes)")
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise DatasetFileError(f"{path}: cannot read the .npz file ({error})") from error


def check_pixels(images: np.ndarray, where: str) -> None:
    """Refuse, in one line, pixels that are not finite numbers, or images that are all constant.

    ``images`` is ``(N, ...)`` with ``N >= 1``; ``where`` names the file and
    the array (or the folder) in the message. A few constant images are
    kept; when every image is one value throughout, the images carry
    nothing a verifier could read, and are refused.

    Raises
    ------
    DatasetFileError
        If a pixel is NaN or infinite (naming how many images hold one, and
        the first), or every image is constant.
    """
    flat = images.reshape(len(images), -1)
    if np.issubdtype(flat.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(flat).all(axis=1))
        if len(bad):
            raise DatasetFileError(
                f"{where} has NaN or infinite pixels in {len(bad)} of {len(flat)} images (the first: image {bad[0]}); "
                "every pixel must be a finite number"
            )
    if flat.shape[1] and bool((flat.min(axis=1) == flat.max(axis=1)).all()):
        raise DatasetFileError(
            f"{where} has only constant images (each of the {len(flat)} is one value throughout): "
            "they carry nothing to classify"
        )


def source_fingerprint(source: str) -> str:
    """16 hex digits from the names, sizes and modification times of a source's files; ``""`` for ``digits``.

    ``source`` is what :func:`resolve_source` returns. Cheap: the files are
    listed and stat-ed, not read.
    """
    if source == DIGITS:
        return ""
    path = Path(source)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else [file for _, group in _image_files(path) for file in group]
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(path.parent)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


def to_uint8(array: np.ndarray) -> np.ndarray:
    """Pixel values as uint8 in ``[0, 255]``.

    ``uint8`` is kept; other integers in ``[0, 255]`` are cast; floats in
    ``[0, 1]`` are scaled by 255; anything else is mapped linearly from its
    ``[min, max]`` onto ``[0, 255]``.
    """
    if array.dtype == np.uint8:
        return array
    low, high = (float(array.min()), float(array.max())) if array.size else (0.0, 0.0)
    if np.issubdtype(array.dtype, np.integer) and low >= 0 and high <= 255:
        return array.astype(np.uint8)
    if np.issubdtype(array.dtype, np.floating) and low >= 0 and high <= 1:
        return np.rint(array * 255).astype(np.uint8)
    scale = 255.0 / (high - low) if high > low else 0.0
    return np.rint((array.astype(np.float64) - low) * scale).astype(np.uint8)


def _load_digits() -> SourceImages:
    from sklearn.datasets import load_digits  # imported here: it is slow to import and only this source needs it

    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # values 0..16
    return SourceImages(images, digits.target.astype(np.int64), [str(name) for name in digits.target_names])


def _load_folder(root: Path, image_size: int) -> SourceImages:
    from PIL import Image, UnidentifiedImageError  # Pillow comes with matplotlib

    check_source(str(root))
    found = [(name, files) for name, files in _image_files(root) if files]
    # First the modes and sizes (headers only, each file closed at once), then the pixels.
    headers = []
    for index, (_, files) in enumerate(found):
        for file in files:
            try:
                with Image.open(file) as image:
                    headers.append((file, index, image.mode, image.size))
            except (OSError, UnidentifiedImageError) as error:
                raise DatasetFileError(f"{file}: cannot read the image ({error})") from error
    grey = all(mode in GREY_MODES for _, _, mode, _ in headers)
    first_file, _, _, first_size = headers[0]
    images, classes = [], []
    for file, index, _, size in headers:
        stop_point("the reading of the images")
        if not image_size and size != first_size:
            raise DatasetFileError(
                f"{file} is {size[0]}x{size[1]} pixels and {first_file} {first_size[0]}x{first_size[1]}; "
                f"set scenario.image_size to resize them all to one size"
            )
        try:
            with Image.open(file) as image:
                converted = image.convert("L" if grey else "RGB")
            if image_size:
                converted = converted.resize((image_size, image_size), Image.Resampling.BILINEAR)
            array = np.asarray(converted, dtype=np.uint8)
        except (OSError, UnidentifiedImageError) as error:
            raise DatasetFileError(f"{file}: cannot read the image ({error})") from error
        images.append(array[None] if grey else array.transpose(2, 0, 1))
        classes.append(index)
    stacked = np.stack(images)
    check_pixels(stacked, f"the ImageFolder {root}")
    return SourceImages(stacked, np.asarray(classes, dtype=np.int64), [name for name, _ in found])


def _channels_first(images: np.ndarray, path: Path) -> np.ndarray:
    """``(N, H, W)``, ``(N, H, W, C)`` or ``(N, C, H, W)`` (``C`` 1 or 3) as ``(N, C, H, W)``."""
    if images.ndim == 3:
        return images[:, None]
    if images.ndim == 4 and images.shape[-1] in (1, 3):
        return images.transpose(0, 3, 1, 2)
    if images.ndim == 4 and images.shape[1] in (1, 3):
        return images
    raise DatasetFileError(
        f"{path}: the images must be an array (N, H, W), (N, H, W, C) or (N, C, H, W) with C 1 or 3, "
        f"got shape {tuple(images.shape)}"
    )


def _load_npz(path: Path) -> SourceImages:
    with open_npz(path) as archive:
        names = list(archive.files)
        pair = next(((x, y) for x, y in NPZ_KEYS if x in names and y in names), None)
        if pair is None:
            check_source(str(path))  # raises, naming the arrays expected
        try:
            images, labels = archive[pair[0]], archive[pair[1]]
            if pair == ("x_train", "y_train") and "x_test" in names and "y_test" in names:
                images = np.concatenate([images, archive["x_test"]])
                labels = np.concatenate([labels, archive["y_test"]])
        except (OSError, ValueError) as error:
            raise DatasetFileError(f"{path}: cannot read the arrays {list(pair)} ({error})") from error
    if images.ndim == 0 or len(images) == 0:
        raise DatasetFileError(f"{path}: '{pair[0]}' holds no images (shape {tuple(images.shape)})")
    labels = labels.reshape(-1) if labels.ndim == 2 and 1 in labels.shape else labels
    if labels.ndim != 1 or len(labels) != len(images) or not len(labels):
        raise DatasetFileError(
            f"{path}: '{pair[1]}' must hold one label per image of '{pair[0]}' "
            f"({len(images)} images), got shape {tuple(labels.shape)}"
        )
    if not (np.issubdtype(labels.dtype, np.integer) or np.issubdtype(labels.dtype, np.str_) or labels.dtype == bool):
        raise DatasetFileError(f"{path}: '{pair[1]}' must hold integer or string labels, got {labels.dtype}")
    if not (np.issubdtype(images.dtype, np.integer) or np.issubdtype(images.dtype, np.floating)):
        raise DatasetFileError(f"{path}: '{pair[0]}' must hold numbers, got {images.dtype}")
    values, classes = np.unique(labels, return_inverse=True)
    if len(values) >= 2:  # one class is refused by load_source, before the pixels are looked at
        check_pixels(images, f"{path}: '{pair[0]}'")
    return SourceImages(to_uint8(_channels_first(images, path)), classes.astype(np.int64), [str(v) for v in values])


def load_source(source: str, image_size: int = 0) -> SourceImages:
    """Read every image of a source, with its class.

    Parameters
    ----------
    source : str
        ``"digits"`` or a path (see the module docstring); :func:`resolve_source` checks it first.
    image_size : int
        Resize every image to ``image_size x image_size`` (bilinear, with
        Pillow for an ImageFolder, with torch for the others); 0 keeps the
        source's size, which must then be the same for every image.

    Raises
    ------
    ConfigError
        If the path is missing or of another kind.
    DatasetFileError
        In one line naming the file and what is expected: an ImageFolder with
        fewer than two classes or an unreadable image, images of different
        sizes, a file that is not an ``.npz`` archive, an ``.npz`` without the
        arrays, without images or with arrays of the wrong shape, NaN or
        infinite pixels, or images that are all constant (:func:`check_pixels`).
    """
    resolved = resolve_source(source)
    if resolved == DIGITS:
        loaded = _load_digits()
    elif Path(resolved).is_dir():
        loaded = _load_folder(Path(resolved), image_size)
    else:
        loaded = _load_npz(Path(resolved))
    if len(loaded.class_names) < 2:
        raise DatasetFileError(f"{resolved}: the images need at least two classes, found {loaded.class_names}")
    if image_size and loaded.images.shape[-2:] != (image_size, image_size):
        resized = torch.nn.functional.interpolate(
            torch.from_numpy(loaded.images).float(), size=(image_size, image_size), mode="bilinear", antialias=True
        )
        loaded.images = resized.round().clamp(0, 255).to(torch.uint8).numpy()
    return loaded


# ------------------------------------------------------------ binarisation
def merge_positive_classes(num_classes: int, seed: int) -> torch.Tensor:
    """``(K,)`` bool: which classes ``merge`` makes positive.

    The classes are shuffled by ``torch.randperm(K)`` under a generator
    seeded with ``seed``; class ``c`` is positive when its place
    ``randperm[c]`` is at least ``K // 2``, so ``K - K // 2`` classes are
    positive (as the NIP reference merges them).
    """
    order = torch.randperm(num_classes, generator=torch.Generator().manual_seed(seed))
    return order >= num_classes // 2


def binarise(
    classes: np.ndarray, num_classes: int, method: str, selected: tuple[int, ...] = (), seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Turn class indices into binary labels by one of :data:`BINARISATIONS`.

    * ``select_two``: keep only the images of ``selected = (a, b)``; the label
      is true for class ``b``.
    * ``merge``: keep every image; the label is true for the classes of
      :func:`merge_positive_classes`.
    * ``random``: keep every image; the labels are drawn independently, true
      with probability 1/2 (``torch.randint`` under a generator seeded with
      ``seed``), and carry nothing of the image: a control.

    Parameters
    ----------
    classes : numpy.ndarray
        ``(N,)`` class indices in ``0 .. num_classes-1``.
    num_classes : int
        ``K``.
    method : str
        One of :data:`BINARISATIONS`.
    selected : tuple of int
        ``select_two``'s classes.
    seed : int
        The seed of ``merge`` and ``random``.

    Returns
    -------
    tuple of numpy.ndarray
        ``(N,)`` bool: which images are kept; ``(N,)`` bool: their labels (meaningful where kept).

    Raises
    ------
    ConfigError
        If a selected class is not one of the source's.
    """
    if method == "select_two":
        if max(selected) >= num_classes:
            raise ConfigError(
                f"scenario.selected_classes {list(selected)}: the source has {num_classes} classes, 0 to {num_classes - 1}"
            )
        return np.isin(classes, selected), classes == selected[1]
    if method == "merge":
        positive = merge_positive_classes(num_classes, seed).numpy()
        return np.ones(len(classes), dtype=bool), positive[classes]
    if method == "random":
        drawn = torch.randint(0, 2, (len(classes),), generator=torch.Generator().manual_seed(seed)).numpy()
        return np.ones(len(classes), dtype=bool), drawn.astype(bool)
    raise ConfigError(f"scenario.binarisation must be one of {list(BINARISATIONS)}, got {method!r}")


# ------------------------------------------------------------------ dataset
def build_images(spec: ImageSpec) -> LabelledImages:
    """Make the dataset of ``spec``: read, binarise, balance, subsample, shuffle.

    The source is read (:func:`load_source`) and binarised (:func:`binarise`);
    with ``make_balanced`` images of the more frequent label are dropped at
    random until both labels are equally many; with ``max_images`` a
    label-stratified draw keeps that many; then the images are shuffled. All
    draws come from a NumPy generator seeded with ``spec.seed``: the same spec
    and source give the same tensors.

    Raises
    ------
    ConfigError
        If the binarised images do not hold both labels.
    """
    source = load_source(spec.source, spec.image_size)
    kept, label = binarise(
        source.classes, len(source.class_names), spec.binarisation, spec.selected_classes, spec.binarisation_seed
    )
    rng = np.random.default_rng(spec.seed)
    groups = [rng.permutation(np.flatnonzero(kept & (label == value))) for value in (False, True)]
    if min(len(group) for group in groups) == 0:
        raise ConfigError(
            f"scenario.binarisation={spec.binarisation} leaves {len(groups[0])} negative and {len(groups[1])} "
            f"positive images of {spec.source}; both labels need images"
        )
    if spec.make_balanced:
        smallest = min(len(group) for group in groups)
        groups = [group[:smallest] for group in groups]
    total = sum(len(group) for group in groups)
    if spec.max_images and total > spec.max_images:
        counts = apportion(spec.max_images, [len(group) for group in groups])
        groups = [group[:count] for group, count in zip(groups, counts)]
    order = rng.permutation(np.concatenate(groups))
    return LabelledImages(
        images=torch.from_numpy(np.ascontiguousarray(source.images[order])),
        label=torch.from_numpy(label[order]),
        source_class=torch.from_numpy(source.classes[order]),
        source_index=torch.from_numpy(order.astype(np.int64)),
    )


def cache_path(spec: ImageSpec, cache_dir: Path) -> Path:
    """The cache file of ``spec`` in ``cache_dir``: ``images_<spec.key()>.pt``."""
    return Path(cache_dir) / f"images_{spec.key()}.pt"


def load_or_build_images(spec: ImageSpec, cache_dir: Path) -> LabelledImages:
    """The images of ``spec`` from the cache, made and cached if needed (:func:`~nip_like.scenarios.datasets.load_or_build`)."""
    return load_or_build(LabelledImages, cache_path(spec, Path(cache_dir).expanduser()), spec, lambda: build_images(spec))

