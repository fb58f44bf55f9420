"""Evaluating our checkpoints, official releases and models saved for the hub with the preprocessing they declare,
and measuring throughput."""
import os
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import timm
import torch
from torch import Tensor, nn
from yacs.config import CfgNode as CN

from models.checkpoint import CheckpointError, held_weights, load_checkpoint_file
from models.onednn import convert_to_onednn

from .build import (autocast_dtype, check_model_name, checkpoint_weights, classifier_names, classifier_rows,
                    create_model, imagenet1k_difference, import_model_modules, narrows_to_imagenet1k,
                    official_weights, trained_as_another_model, weights_keys)
from .checkpoint import recorded_classes
from .compile import CompileTimer, compile_errors_reported, compile_model
from .config import (config_from_yaml_string, get_default_config, load_config, merge_dict, merge_opts, stored_config,
                     validate_config)
from .data import (build_eval_loader, check_images, check_trained_classes, eval_batch_size, eval_transform,
                   image_channels, image_mode, load_split, report_scan, resolve_data_root)
from .distributed import DistInfo
from .errors import UsageError
from .hub import hub_config, is_hub_name
from .loops import evaluate, measure_throughput

__all__ = ['eval_config', 'LoadedWeights', 'load_weights', 'evaluate_weights', 'throughput']


def _model_data_settings(pretrained_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The evaluation preprocessing a pretrained config declares (input size, crop, interpolation, mean, std)."""
    data = timm.data.resolve_data_config({}, pretrained_cfg=pretrained_cfg)
    settings: Dict[str, Any] = dict(
        DATA=dict(IMG_SIZE=int(data['input_size'][-1]), INTERPOLATION=data['interpolation'],
                  MEAN=list(data['mean']), STD=list(data['std'])),
        TEST=dict(CROP_PCT=float(data['crop_pct']), CROP_MODE=data.get('crop_mode') or 'center'))
    return settings


def _hub_settings(name: str, option: str) -> Dict[str, Any]:
    """The config of a `local-dir:` / `hf-hub:` model from its config.json: the architecture, the arguments it was
    built with (the attention among them) and the preprocessing of its pretrained config, at the input size it
    was built for. `option` (which gave the name) starts the one-line error where it cannot be used."""
    pretrained_cfg, architecture, model_args = hub_config(name, option)
    try:
        check_model_name(architecture)
    except UsageError as e:
        raise UsageError(f"{option} {name!r}: the architecture in its config.json: {e}") from None
    kwargs = dict(model_args)  # those the config holds under its own keys are moved there
    settings = _model_data_settings(pretrained_cfg)
    settings['MODEL'] = dict(NAME=architecture,
                             NUM_CLASSES=int(kwargs.pop('num_classes', pretrained_cfg.get('num_classes', 1000))))
    kwargs.pop('drop_path_rate', None)  # stochastic depth is off in evaluation (eval_config)
    img_size = kwargs.pop('img_size', None)
    if img_size is not None:
        sides = [img_size] * 2 if isinstance(img_size, int) else list(img_size)
        if len(set(sides)) != 1:
            raise UsageError(f"{option} {name!r} was built for {sides[0]}x{sides[-1]} images; expected a square "
                             f"input size (DATA.IMG_SIZE is one side)")
        settings['DATA']['IMG_SIZE'] = int(sides[0])
    settings['MODEL']['KWARGS'] = kwargs
    return settings


def eval_config(
        cfg_file: Optional[str],
        model_name: Optional[str],
        checkpoint: Optional[str],
        opts: Sequence[str] = (),
        overrides: Optional[Dict[str, Any]] = None,
        model_option: str = '--model',
        without_config: str = 'expected --cfg FILE or --model NAME',
) -> CN:
    """The evaluation config: `--cfg` file, or a registered `--model` with its own preprocessing, or a
    `local-dir:` / `hf-hub:` `--model` with the architecture and preprocessing of its config.json, or (none of
    these) the config stored in one of our checkpoints; then command-line overrides and `--opts`. `model_option`
    names the option that gave `model_name` in errors; `without_config` is the way on, in the script's options,
    for a checkpoint that stores no config."""
    if not cfg_file and model_name:  # a name a module of MODEL.IMPORTS registers is checked after it is imported
        imports = get_default_config()
        merge_opts(imports, list(opts))
        import_model_modules(imports)
    if cfg_file:
        cfg = load_config(cfg_file, opts, overrides)
        cfg.defrost()
    elif model_name and is_hub_name(model_name):
        cfg = get_default_config()
        merge_dict(cfg, _hub_settings(model_name, model_option), f"the config.json of {model_name}")
        merge_dict(cfg, overrides or {}, 'the command line')
        merge_opts(cfg, list(opts))
    elif model_name:
        check_model_name(model_name)
        cfg = get_default_config()
        cfg.MODEL.NAME = model_name
        pretrained_cfg = timm.models.get_pretrained_cfg(model_name)
        if pretrained_cfg is not None:  # a model registered without default_cfgs takes the engine's defaults
            settings = _model_data_settings(pretrained_cfg.to_dict())
            if pretrained_cfg.num_classes:  # an ImageNet-22k release classifies 21841 classes
                settings['MODEL'] = dict(NUM_CLASSES=int(pretrained_cfg.num_classes))
            merge_dict(cfg, settings, f"the pretrained config of {model_name}")
        merge_dict(cfg, overrides or {}, 'the command line')
        merge_opts(cfg, list(opts))
    elif checkpoint:
        stored = load_checkpoint_file(checkpoint)
        text = stored.get('config') if isinstance(stored, Mapping) else None
        if not isinstance(text, str):
            raise UsageError(f"checkpoint {checkpoint!r} stores no config of this engine; {without_config}")
        cfg = config_from_yaml_string(text, f"checkpoint {checkpoint!r}")
        cfg.defrost()
        merge_dict(cfg, overrides or {}, 'the command line')
        merge_opts(cfg, list(opts))
    else:
        raise UsageError("nothing to evaluate; expected --cfg FILE or --model NAME (with --checkpoint PATH)")
    # stochastic depth is off in evaluation; at 0 a model without a drop_path_rate argument builds too
    cfg.MODEL.DROP_PATH_RATE = 0.0
    validate_config(cfg)
    cfg.freeze()
    return cfg


class LoadedWeights(NamedTuple):
    cfg: CN
    weights: Dict[str, Tensor]
    classes: Optional[List[str]]
    kind: str  # 'model' or 'ema'


def load_weights(cfg: CN, checkpoint: str, ema: bool, adopt_classes: bool,
                 released: bool = False) -> LoadedWeights:
    """`cfg`, with MODEL.NUM_CLASSES taken from the checkpoint when `adopt_classes` (a `--model` evaluation), else
    checked against it (1000 classes take the ImageNet-1k rows of the ImageNet-22k classifier of a family that
    fine-tunes so: `narrows_to_imagenet1k`); the checkpoint's weights (of a `released` file, those
    `timm.create_model(name, pretrained=True)` takes: its EMA weights where it holds both); the class folder names
    it was trained on, where it records them; which weights they are."""
    stored = load_checkpoint_file(checkpoint)
    _check_trained_model(stored, checkpoint, cfg)
    classes = recorded_classes(stored)
    kind = held_weights(stored, weights_keys(stored, ema, released))
    weights = official_weights(cfg.MODEL.NAME, checkpoint_weights(stored, checkpoint, ema=ema, released=released))
    del stored  # a training checkpoint's optimizer state and EMA, not needed here
    rows = classifier_rows(cfg.MODEL.NAME, weights)
    classifiers = classifier_names(cfg.MODEL.NAME)
    if rows is None and classifiers:
        raise CheckpointError(f"checkpoint {checkpoint!r} holds no classifier "
                              f"({' or '.join(f'{name}.weight' for name in classifiers)}); expected the weights of a "
                              f"model that classifies")
    if rows is None or rows == cfg.MODEL.NUM_CLASSES or (
            not adopt_classes and cfg.MODEL.NUM_CLASSES == 1000 and narrows_to_imagenet1k(cfg.MODEL.NAME, weights)):
        return LoadedWeights(cfg, weights, classes, kind)
    if not adopt_classes:
        raise _class_count_error(checkpoint, rows, cfg.MODEL.NUM_CLASSES)
    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.NUM_CLASSES = rows
    cfg.freeze()
    return LoadedWeights(cfg, weights, classes, kind)


def _check_trained_model(stored: Any, checkpoint: str, cfg: CN) -> None:
    """A UsageError where `cfg` (from a model name, a config file or overrides) builds other attentions than one of
    our checkpoints was trained with (`trained_as_another_model`): another attention's weights of the same shapes
    (softmax's, SimA's, an attention of one's own) loaded without a word and were evaluated in the wrong
    attention."""
    trained = stored_config(stored, f"checkpoint {checkpoint!r}")
    changes = [] if trained is None else trained_as_another_model(trained, cfg)
    if changes:
        raise UsageError(f"checkpoint {checkpoint!r} was trained as another model: {'; '.join(changes)}; expected "
                         f"the checkpoint alone (its stored config builds its model), or a model name or config and "
                         f"MODEL.KWARGS that build the same")


def _class_count_error(checkpoint: str, rows: int, num_classes: int) -> CheckpointError:
    return CheckpointError(f"checkpoint {checkpoint!r} has a {rows}-class classifier but MODEL.NUM_CLASSES is "
                           f"{num_classes}; expected a checkpoint for {num_classes} classes")


def _for_val_folders(cfg: CN, weights: Mapping[str, Tensor], val_classes: Sequence[str], checkpoint: str,
                     folder: str) -> CN:
    """`cfg` for the classes `weights` score on the validation folder's `val_classes`: the 1000 ImageNet-1k
    classes where the ImageNet-22k classifier of `weights` has ImageNet-1k rows that the model's family takes
    (`narrows_to_imagenet1k`) and the folder holds 1000 classes, which must then be ImageNet-1k's synsets in order,
    or the rows would score the wrong classes. Any other classifier must have MODEL.NUM_CLASSES rows
    (`load_weights` lets the ImageNet-22k ones of 1000-class configs through for this)."""
    rows = classifier_rows(cfg.MODEL.NAME, weights)
    if len(val_classes) != 1000 or not narrows_to_imagenet1k(cfg.MODEL.NAME, weights):
        if rows is not None and rows != cfg.MODEL.NUM_CLASSES:
            raise _class_count_error(checkpoint, rows, cfg.MODEL.NUM_CLASSES)
        return cfg
    differ = imagenet1k_difference(val_classes)
    if differ is not None:
        raise UsageError(f"checkpoint {checkpoint!r} classifies the {rows} ImageNet-22k classes, of which it "
                         f"evaluates ImageNet-1k's on 1000 class folders, but those of {folder} are not "
                         f"ImageNet-1k's ({differ}); expected ImageNet-1k's class folders in order")
    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.NUM_CLASSES = 1000
    cfg.freeze()
    return cfg


def _inference_model(model: nn.Module, cfg: CN, onednn: bool, compile: bool) -> nn.Module:
    if onednn:
        convert_to_onednn(model)
    if compile:
        model = compile_model(model, cfg.TRAIN.COMPILE_MODE, cfg.TRAIN.COMPILE_BACKEND)
    return model


def evaluate_weights(cfg: CN, info: DistInfo, checkpoint: str, *, ema: bool = False, amp: bool = False,
                     adopt_classes: bool = False, check_data: bool = False, compile: bool = False,
                     onednn: bool = False, released: bool = False) -> Dict[str, Any]:
    """Top-1 / top-5 of the weights in `checkpoint` (the `released` weights of a model name: those
    `timm.create_model(name, pretrained=True)` takes) on the validation folder, exact over processes; with
    `check_data`, every image is decoded first; with `compile`, the model runs compiled (TRAIN.COMPILE_MODE,
    TRAIN.COMPILE_BACKEND), with `onednn` its products run through oneDNN (`check_onednn`).
    Under DATA.BAD_IMAGES 'skip' the bad files are left out of the counts."""
    cfg, weights, classes, kind = load_weights(cfg, checkpoint, ema, adopt_classes, released)
    source = f"checkpoint {checkpoint!r}"
    root = resolve_data_root(cfg, info)
    val_set = load_split(root, 'val', eval_transform(cfg), bad_images=cfg.DATA.BAD_IMAGES, image_mode=image_mode(cfg))
    cfg = _for_val_folders(cfg, weights, val_set.classes, checkpoint, os.path.join(root, 'val'))
    if len(val_set.classes) != cfg.MODEL.NUM_CLASSES:
        raise UsageError(f"{source} is for {cfg.MODEL.NUM_CLASSES} classes but {root}/val has "
                         f"{len(val_set.classes)} class folders; expected the dataset the checkpoint was trained on")
    check_trained_classes(classes, val_set.classes, source, os.path.join(root, 'val'))
    report_scan(val_set)
    if check_data:
        check_images(val_set, cfg, info)
    model = create_model(cfg, weights, source=source, classes=val_set.classes).to(info.device)
    del weights
    loader = build_eval_loader(cfg, val_set, info, eval_batch_size(cfg))
    dtype = autocast_dtype(cfg, info.device, amp)
    model = _inference_model(model, cfg, onednn, compile)
    with compile_errors_reported(cfg.MODEL.NAME):
        metrics = evaluate(model, loader, info, amp=amp, amp_dtype=dtype, desc='eval',
                           compile_timer=CompileTimer('evaluation', compile))
    return dict(model=cfg.MODEL.NAME, model_kwargs=dict(cfg.MODEL.KWARGS), checkpoint=checkpoint, weights=kind,
                data=root, img_size=cfg.DATA.IMG_SIZE, crop_pct=cfg.TEST.CROP_PCT, crop_mode=cfg.TEST.CROP_MODE,
                precision=dtype if amp else 'float32', world_size=info.world_size, compiled=compile,
                onednn=onednn, **metrics)


def throughput(cfg: CN, info: DistInfo, batch_size: int, checkpoint: Optional[str] = None, *, ema: bool = False,
               amp: bool = False, adopt_classes: bool = False, warmup: int = 50, timed: int = 30,
               compile: bool = False, onednn: bool = False) -> Dict[str, Any]:
    """Images/s of one process on a batch of `batch_size` images at DATA.IMG_SIZE (`warmup` forwards, then
    `timed` forwards timed; 50 and 30 as the official scripts), compiled with `compile`, the products through
    oneDNN with `onednn` (`models.convert_to_onednn`).

    The input is random: the time of a forward does not depend on the pixels.
    """
    weights = None
    if checkpoint:
        cfg, weights, _, _ = load_weights(cfg, checkpoint, ema, adopt_classes)
    model = create_model(cfg, weights, source=f"checkpoint {checkpoint!r}").to(info.device)
    generator = torch.Generator().manual_seed(cfg.SEED)
    images = torch.randn(batch_size, image_channels(cfg), cfg.DATA.IMG_SIZE, cfg.DATA.IMG_SIZE, generator=generator)
    dtype = autocast_dtype(cfg, info.device, amp)
    model = _inference_model(model, cfg, onednn, compile)
    with compile_errors_reported(cfg.MODEL.NAME):
        rate = measure_throughput(model, images, info, amp=amp, amp_dtype=dtype, warmup=warmup, timed=timed,
                                  compile_timer=CompileTimer('the forward pass', compile))
    return dict(model=cfg.MODEL.NAME, model_kwargs=dict(cfg.MODEL.KWARGS), batch_size=batch_size,
                img_size=cfg.DATA.IMG_SIZE,
                precision=dtype if amp else 'float32', device=str(info.device), warmup=warmup, timed=timed,
                compiled=compile, onednn=onednn, throughput=rate)
