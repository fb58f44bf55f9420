"""Models and images for the attention-analysis scripts: a checkpoint (ours, with its stored config), a
registered model name or a model saved for the hub, the evaluation preprocessing of its config, and images from a
file or an image folder."""
import argparse
import os
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import timm
import torch
from torch import Tensor, nn
from yacs.config import CfgNode as CN

from models.analysis import attention_layers
from models.checkpoint import has_released_weights

from .build import create_model
from .data import IMAGE_EXTENSIONS, BadImage, eval_transform, image_mode, read_image
from .errors import UsageError
from .evaluation import eval_config, load_weights
from .hub import is_hub_name, weights_file

__all__ = ['IMAGE_EXTENSIONS', 'refuse_unreleased', 'load_analysis_model', 'find_images', 'load_images']



def refuse_unreleased(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """`parser.error` (one line, status 2) for the first registered model name of `names` without released weights
    to load with `--pretrained`; unknown names are left to the model check, hub names carry their weights."""
    for name in names:
        if not is_hub_name(name) and timm.is_model(name) and not has_released_weights(name):
            parser.error(f"--pretrained: model {name!r} has no released weights; expected a name that "
                         f"timm.list_pretrained() lists")


def load_analysis_model(model_name: Optional[str], checkpoint: Optional[str], opts: Sequence[str] = (),
                        ema: bool = False, model_option: str = '--model', pretrained: bool = False,
                        without_config: str = 'expected --model NAME with it, the model whose weights it holds',
                        check: Callable[[CN], None] = lambda cfg: None) -> Tuple[nn.Module, CN]:
    """The model in eval mode and its config: `model_name` with its pretrained config, else the config stored in
    our `checkpoint`. Its weights: the checkpoint's when given, else those saved with a `local-dir:` / `hf-hub:`
    `model_name`, else with `pretrained` the released weights of registered `model_name` (downloaded once into the
    cache), else random ones. Weights load as eval.py loads them: an official release's layout and derived buffers
    through the family's filter, the class count of a `model_name` from the weights. `opts` override the config;
    `model_option`, the script's option that gave `model_name`, starts the errors about it; `without_config` is
    the way on for a `checkpoint` alone that stores no config (an official release); `check`, a script's check of
    its options against the config (a UsageError), runs as soon as the config is known: before the model is built
    and its weights read or downloaded."""
    if checkpoint and not os.path.isfile(checkpoint):
        raise UsageError(f"checkpoint {checkpoint!r} not found")
    cfg = eval_config(None, model_name, None if model_name else checkpoint, opts, model_option=model_option,
                      without_config=without_config)
    asked = dict(zip(opts[::2], opts[1::2])).get('DEVICE', 'cpu')  # a checkpoint's own DEVICE is its training's
    if asked not in ('auto', 'cpu'):  # else ignored without a word
        raise UsageError(f"DEVICE {asked!r}: the analysis scripts run on the CPU; expected DEVICE cpu (or auto)")
    check(cfg)
    # on the meta device, which allocates nothing: before any weights are read or downloaded
    if not attention_layers(create_model(cfg, device='meta')):
        raise UsageError(f"model {cfg.MODEL.NAME!r} has no attention layer of this zoo; expected one of the zoo's "
                         f"models (timm.list_models('*_deit_*') and friends)")
    released = bool(not checkpoint and model_name and (pretrained or is_hub_name(model_name)))
    if released:
        checkpoint = weights_file(model_name, model_option)
    if not checkpoint:
        return create_model(cfg).eval(), cfg
    cfg, weights, _, _ = load_weights(cfg, checkpoint, ema, adopt_classes=model_name is not None, released=released)
    return create_model(cfg, weights, source=f"checkpoint {checkpoint!r}").eval(), cfg


def find_images(path: str, limit: Optional[int] = None) -> List[str]:
    """`path` itself, or the image files under the folder `path` (those train.py and eval.py read) in sorted order;
    with `limit`, that many spread evenly over them, so that a folder of class folders gives images of every class
    rather than of the first."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise UsageError(f"image {path!r} not found; expected an image file or an image folder")
    files = sorted(_image_files(path))
    if not files:
        raise UsageError(f"no image files ({', '.join(IMAGE_EXTENSIONS)}) under {path!r}")
    if limit is None or limit >= len(files):
        return files
    return [files[i * len(files) // limit] for i in range(limit)]


def _image_files(top: str) -> Iterator[str]:
    """The image files under `top`, following links as the dataset scan does, each folder entered once (a link
    loop ends where it returns)."""
    entered = set()
    for root, folders, names in os.walk(top, followlinks=True):
        status = os.stat(root)
        if (status.st_dev, status.st_ino) in entered:
            folders.clear()
            continue
        entered.add((status.st_dev, status.st_ino))
        yield from (os.path.join(root, name) for name in names if name.lower().endswith(IMAGE_EXTENSIONS))


def load_images(files: Sequence[str], cfg: CN) -> Tuple[Tensor, List[np.ndarray]]:
    """The (B, C, S, S) model inputs of `files` with the config's evaluation preprocessing (C = 1 for grey-scale
    models), and each image as the model sees it before normalisation ((S, S, 3) floats in [0, 1]) for drawing."""
    transform = eval_transform(cfg)
    mean = torch.tensor(cfg.DATA.MEAN).view(-1, 1, 1)
    std = torch.tensor(cfg.DATA.STD).view(-1, 1, 1)
    inputs, shown = [], []
    mode = image_mode(cfg)
    for file in files:
        image = read_image(file, mode)
        if isinstance(image, BadImage):
            raise UsageError(f"{image}; expected an image that can be read")
        x = transform(image)
        inputs.append(x)
        shown.append((x * std + mean).clamp(0, 1).expand(3, -1, -1).permute(1, 2, 0).numpy())
    return torch.stack(inputs), shown
