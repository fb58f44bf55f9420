"""The shipped ImageNet recipes as training builds them: augmentation that survives every RandAugment draw."""
import random
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from engine.config import load_config
from engine.data import posterize, train_transform

CONFIGS = Path(__file__).resolve().parents[1] / 'configs'
RECIPES = sorted(p for p in CONFIGS.rglob('*.yaml') if p.parent.name != 'demo')
RAND_AUGMENT_DRAWS = 10_000  # per distinct recipe
FULL_DRAWS = 200  # of the whole transform (crop to IMG_SIZE, ..., random erasing) per distinct recipe
MAX_MAGNITUDE = 10.0  # timm clamps RandAugment magnitudes to [0, 10]


def _images(size: int = 40) -> List[Image.Image]:
    """Small RGB images: noise, gradients, a checkerboard and flat colours (black, white, grey)."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, size, dtype=np.uint8)
    images = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(3)]
    images.append(np.stack([np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size)),
                            np.full((size, size), 128, np.uint8)], axis=-1))
    checker = ((np.indices((size, size)).sum(0) // 5) % 2 * 255).astype(np.uint8)
    images.append(np.stack([checker] * 3, axis=-1))
    images += [np.full((size, size, 3), v, np.uint8) for v in (0, 255, 128)]
    return [Image.fromarray(a, mode='RGB') for a in images]


def _distinct_transforms() -> Dict[str, list]:
    """One transform per distinct recipe (keyed by its description), with the configs that build it."""
    transforms: Dict[str, list] = {}
    for path in RECIPES:
        transform = train_transform(load_config(str(path)))
        transforms.setdefault(repr(transform), [transform, []])[1].append(path.name)
    return transforms


def _rand_augment(transform):
    return next(t for t in transform.transforms if type(t).__name__ == 'RandAugment')


def _record(rand_augment, magnitudes: Dict[str, List[float]], bits: Set[int]) -> List[str]:
    """Wrap each op of `rand_augment` so its magnitudes (and posterize bits) are recorded; return the op names."""
    for op in rand_augment.ops:
        def level_fn(magnitude, hparams, name=op.name, inner=op.level_fn):
            magnitudes[name].append(magnitude)
            return inner(magnitude, hparams) if inner is not None else ()

        def aug_fn(img, *args, name=op.name, inner=op.aug_fn, **kwargs):
            if name == 'PosterizeIncreasing':
                bits.add(args[0])
            return inner(img, *args, **kwargs)

        op.level_fn, op.aug_fn = level_fn, aug_fn
    return [op.name for op in rand_augment.ops]


def test_posterize_keeps_the_top_bits_and_gives_black_for_zero_bits():
    img = _images()[0]
    pixels = np.asarray(img)
    assert np.array_equal(np.asarray(posterize(img, 0)), np.zeros_like(pixels))
    assert np.array_equal(np.asarray(posterize(img, -1)), np.zeros_like(pixels))
    assert np.array_equal(np.asarray(posterize(img, 1)), pixels & 0b10000000)
    assert np.array_equal(np.asarray(posterize(img, 3)), np.asarray(ImageOps.posterize(img, 3)))
    assert posterize(img, 8) is img
    grey = img.convert('L')
    assert posterize(grey, 0).mode == 'L' and np.asarray(posterize(grey, 0)).max() == 0


def test_every_recipe_train_transform_survives_every_randaugment_op_and_magnitude():
    """Each distinct recipe's transform, built by the engine, runs end to end; its RandAugment (the stage that
    crashed, 1 image in about 660) runs 10,000 draws on the small images, reaching every op at the top magnitude."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    images = _images()
    transforms = _distinct_transforms()
    assert sum(len(names) for _, names in transforms.values()) == len(RECIPES) >= 40
    for transform, names in transforms.values():
        magnitudes: Dict[str, List[float]] = defaultdict(list)
        bits: Set[int] = set()
        rand_augment = _rand_augment(transform)
        op_names = _record(rand_augment, magnitudes, bits)
        assert len(op_names) == 15 and rand_augment.num_layers == 2
        for i in range(FULL_DRAWS):
            out = transform(images[i % len(images)])
            assert out.dtype == torch.float32 and torch.isfinite(out).all()
        for i in range(RAND_AUGMENT_DRAWS):
            out = rand_augment(images[i % len(images)])
            assert out.size == (40, 40) and out.mode == 'RGB'
        # every op ran many times and reached the top magnitude, where posterize asks for 0 bits
        assert {name for name in op_names if len(magnitudes[name]) >= 500} == set(op_names), names
        assert {name for name in op_names if max(magnitudes[name]) == MAX_MAGNITUDE} == set(op_names), names
        assert {0, 1} <= bits, (names, bits)
