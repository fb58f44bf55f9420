"""Evaluation preprocessing resolved from the registered pretrained configs matches the official pipelines."""
import pytest
import timm
import torch
from timm.data import create_transform, resolve_data_config
from torchvision import transforms

import models  # noqa: F401

PAPERS = ('https://github.com/LeapLabTHU/InLine', 'https://github.com/LeapLabTHU/FLatten-Transformer')
# The official models carry their paper's pretrained cfg; `flatten_deit_*` is DeiT with that attention, not one of them.
OFFICIAL = sorted(name for name in timm.list_models(['inline_*', 'flatten_*'])
                  if timm.models.get_pretrained_cfg(name).origin_url in PAPERS)


def test_every_official_inline_and_flatten_variant_is_registered():
    assert len(OFFICIAL) == 32


@pytest.mark.parametrize('name', OFFICIAL)
def test_official_variants_resize_to_a_square_then_centre_crop(name):
    """InLine / FLatten evaluate with Resize((int(S·256/224),)*2) then CenterCrop(S) (no crop for Swin-B-384;
    CSwin-B-384 keeps it)."""
    with torch.device('meta'):
        model = timm.create_model(name)
    size = model.pretrained_cfg['input_size'][-1]
    steps = create_transform(**resolve_data_config({}, model=model)).transforms
    resize, crop = steps[0], steps[1]
    assert isinstance(resize, transforms.Resize) and isinstance(crop, transforms.CenterCrop)
    expected = size if name.endswith('_swin_base_384') else int(size * 256 / 224)
    assert tuple(resize.size) == (expected, expected)
    assert resize.interpolation == transforms.InterpolationMode.BICUBIC
    assert tuple(crop.size) == (size, size)
