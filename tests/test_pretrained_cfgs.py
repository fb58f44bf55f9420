"""Evaluation preprocessing resolved from the registered pretrained configs matches the official pipelines and
the configs' evaluation."""
from pathlib import Path

import pytest
import timm
import torch
from timm.data import create_transform, resolve_data_config
from torchvision import transforms

import models  # noqa: F401
from engine.config import load_config

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


# The license each official repository declares (its LICENSE file or its files' headers); the InLine and FLatten
# repositories and the MultiMax code declare none.
LICENSES = {'https://github.com/facebookresearch/deit': 'apache-2.0', 'https://github.com/whai362/PVT': 'apache-2.0',
            'https://github.com/microsoft/Swin-Transformer': 'mit',
            'https://github.com/microsoft/CSWin-Transformer': 'mit', 'https://github.com/UCDvision/sima': 'mit'}


def test_every_cfg_of_an_official_origin_carries_its_license():
    cfgs = [timm.models.get_pretrained_cfg(name) for name in timm.list_models(module=['vit', 'pvt', 'pvt_v2', 'swin',
                                                                                       'cswin', 'xcit_sima'])]
    licenses = {(cfg.origin_url, cfg.license) for cfg in cfgs if cfg is not None and cfg.origin_url}
    assert licenses == {(origin, LICENSES.get(origin)) for origin, _ in licenses}
    assert {origin for origin, _ in licenses} >= set(LICENSES)


CONFIGS = sorted(path for path in (Path(__file__).resolve().parents[1] / 'configs').glob('*/*.yaml')
                 if path.parent.name not in ('base', 'demo'))


@pytest.mark.parametrize('path', CONFIGS, ids=lambda path: f'{path.parent.name}/{path.name}')
def test_a_config_evaluates_as_its_model_s_pretrained_cfg(path):
    """`eval.py --cfg CONFIG` and `eval.py --model NAME` preprocess alike: size, crop, crop mode, interpolation."""
    cfg = load_config(str(path), [])
    pretrained = timm.models.get_pretrained_cfg(cfg.MODEL.NAME)
    interpolation = 'bicubic' if cfg.DATA.INTERPOLATION == 'random' else cfg.DATA.INTERPOLATION
    assert (cfg.DATA.IMG_SIZE, cfg.TEST.CROP_PCT, cfg.TEST.CROP_MODE, interpolation) == (
        pretrained.input_size[-1], pretrained.crop_pct, pretrained.crop_mode, pretrained.interpolation)
