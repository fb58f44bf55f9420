"""Model, weights, optimizer, scheduler and loss from a config, through timm's factories."""
import difflib
import importlib
import inspect
import logging
import os
import re
import sys
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import timm
import torch
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import (create_optimizer_v2, get_optimizer_class, get_optimizer_info, list_optimizers,
                        param_groups_weight_decay)
from timm.scheduler import create_scheduler_v2
from torch import Tensor, nn
from yacs.config import CfgNode as CN

import models  # noqa: F401  (registers the zoo's families with timm)
from models.attention import Mixer, UnknownAttentionError, list_attentions
from models.attention.registry import close_attention_name
from models.checkpoint import (EMA_KEYS, IMAGENET22K_CLASSES, PRETRAINED_KEYS, CheckpointError,
                               checkpoint_state_dict, file_weights_keys, has_released_weights, imagenet1k_classes,
                               load_checkpoint_file, load_shared_weights, narrow_imagenet22k_classifier, official_keys,
                               unknown_pretrained_tag)
from models.onednn import convert_to_onednn, onednn_available

from .config import ConfigError, mixup_active, model_kwargs, trained_model_changes
from .distributed import DistInfo
from .errors import UsageError
from .hub import is_hub_name, weights_file

__all__ = ['import_model_modules', 'import_modules', 'trained_as_another_model', 'check_model_name',
           'check_model_config', 'check_pretrained', 'official_weights', 'classifier_names', 'classifier_rows',
           'imagenet1k_difference', 'narrows_to_imagenet1k', 'read_weights', 'weights_keys', 'checkpoint_weights',
           'create_model', 'weight_changes', 'create_optimizer', 'create_scheduler', 'create_criterion',
           'cpu_has_bfloat16_kernels', 'autocast_dtype', 'check_onednn', 'create_training_model']

# optimizers whose `fused=True` kernel runs on every device the engine trains on (CPU, CUDA); Adagrad's is CPU only
FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
logger = logging.getLogger('engine')


def import_model_modules(cfg: CN) -> None:
    """Import the modules of MODEL.IMPORTS (`import_modules`)."""
    import_modules(cfg.MODEL.IMPORTS)


def import_modules(modules: Sequence[str], option: str = 'MODEL.IMPORTS') -> None:
    """Import `modules`, which register a user's attentions or families, with the working directory on the import
    path (after the rest); `UsageError` for one that cannot be imported or fails on import, naming the `option`
    that gave it and the line of its own code that raised."""
    if modules and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not (module == e.name or module.startswith(f'{e.name}.')):  # one it imports
                raise UsageError(f"{option} module {module!r} failed on import ({e}; at {_raised_at(e)}); "
                                 f"expected a module whose own imports are installed") from None
            raise UsageError(f"{option} module {module!r} cannot be imported ({e}); expected a module on the "
                             f"import path: in the working directory, on PYTHONPATH or installed") from None
        except Exception as e:  # the registry refusing a name or class, a syntax error, a bug in the module
            text = ' '.join(str(e.msg if isinstance(e, SyntaxError) else e).split())  # one line; msg: no place
            raise UsageError(f"{option} module {module!r} failed on import ({type(e).__name__}: {text}; at "
                             f"{_raised_at(e)}); expected a module that imports and registers cleanly") from None


def _raised_at(error: BaseException) -> str:
    """Where the failed import of a module raised `error`: the line of the module's own code (a package's
    `__init__` for a dotted name) that raised it or called the raiser, the first past the import machinery; a
    syntax error's own line."""
    if isinstance(error, SyntaxError) and error.filename:
        return f"{error.filename}, line {error.lineno}"
    frames = traceback.extract_tb(error.__traceback__)
    machinery = (os.path.abspath(__file__), os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep)
    own = [frame for frame in frames if not frame.filename.startswith('<frozen')
           and not os.path.abspath(frame.filename).startswith(machinery)]
    frame = (own or frames)[0]
    return f"{frame.filename}, line {frame.lineno}"


def _attentions_built(cfg: CN) -> Optional[List[Tuple[str, str, str]]]:
    """Each attention of the model `cfg` builds (on the meta device): its module path, class and options; None where
    the model cannot be built here (a checkpoint's config of an older engine, an attention of one's own whose module
    is not imported), so that nothing can be compared."""
    try:
        with torch.device('meta'):
            model = timm.create_model(cfg.MODEL.NAME, **model_kwargs(cfg))
    except (TypeError, ValueError, RuntimeError, KeyError):
        return None
    return [(name, type(module).__name__, module.extra_repr()) for name, module in model.named_modules()
            if isinstance(module, Mixer)]


def trained_as_another_model(trained: CN, cfg: CN) -> List[str]:
    """The config differences (`trained_model_changes`) by which `cfg` builds other attentions than `trained`, the
    config stored in a checkpoint: another attention's weights of the same shapes load strictly. Empty where the
    attentions are the same however the configs spell them (an explicit `attn_type` or default, `img_size`), or
    where they cannot be compared."""
    changes = trained_model_changes(trained, cfg)
    if not changes:
        return []
    before, after = _attentions_built(trained), _attentions_built(cfg)
    return changes if before is not None and after is not None and before != after else []


def check_model_name(name: str) -> None:
    """Raise `UsageError` unless timm knows `name` (after `import models`), and its pretrained tag if it has one."""
    if timm.is_model(name):
        tag_problem = unknown_pretrained_tag(name)
        if tag_problem:
            raise UsageError(tag_problem)
        return
    if is_hub_name(name):
        raise UsageError(f"model {name!r} is a saved model, not an architecture; expected the architecture's "
                         f"registered name, with --pretrained {name} (train.py) for its weights, or --model {name} "
                         f"(eval.py) alone")
    for attention in list_attentions():  # one registered outside the package has no entrypoints of its own
        architecture = f"softmax_{name[len(attention) + 1:]}"
        if name.startswith(f'{attention}_') and timm.is_model(architecture) and not timm.list_models(f'{attention}_*'):
            raise UsageError(f"unknown model {name!r}: attention {attention!r} has no entrypoints of its own (it is "
                             f"registered outside the package); expected {architecture} with attn_type {attention!r}: "
                             f"--opts MODEL.KWARGS.attn_type {attention}")
    close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; see timm.list_models('*_deit_*') and friends"
    raise UsageError(f"unknown model {name!r}: expected a model registered with timm{hint}")


def check_pretrained(value: str, ema: bool = False) -> None:
    """Raise `UsageError` unless MODEL.PRETRAINED `value` is empty, a file, a registered model name with released
    weights (which the trainer downloads), a `local-dir:` folder with weights or an `hf-hub:` repository; with
    MODEL.PRETRAINED_EMA (`ema`), unless it is a file, the only kind that holds EMA weights beside the model's."""
    if ema and not os.path.isfile(value):
        given = f"MODEL.PRETRAINED {value!r} is no file" if value else "MODEL.PRETRAINED is empty"
        raise UsageError(f"MODEL.PRETRAINED_EMA True takes the EMA weights of a checkpoint file, but {given}; "
                         f"expected a checkpoint with EMA weights, or MODEL.PRETRAINED_EMA False")
    if not value or os.path.isfile(value):
        return
    if is_hub_name(value):
        if value.startswith('local-dir:'):
            weights_file(value, 'MODEL.PRETRAINED')
        return
    expected = ("expected a checkpoint file, the name of a model with released weights, or 'local-dir:FOLDER' / "
                "'hf-hub:REPO' of a model saved by timm.models.save_for_hf")
    if not timm.is_model(value):
        released = [name for name in timm.list_models() if has_released_weights(name)]
        close = difflib.get_close_matches(value, released, n=3, cutoff=0.8)
        hint = f"; did you mean {', '.join(close)}?" if close else ''
        raise UsageError(f"MODEL.PRETRAINED {value!r} is neither a file nor a registered model name; {expected}{hint}")
    tag_problem = unknown_pretrained_tag(value)
    if tag_problem:
        raise UsageError(f"MODEL.PRETRAINED {value!r}: {tag_problem}")
    if not has_released_weights(value):
        raise UsageError(f"MODEL.PRETRAINED {value!r} has no released weights; {expected}")


def classifier_names(name: str) -> Tuple[str, ...]:
    """The state-dict names of model `name`'s classifier (its pretrained cfg's `classifier`)."""
    cfg = timm.models.get_pretrained_cfg(name)
    classifier = getattr(cfg, 'classifier', None) if cfg is not None else None
    if not classifier:
        return ()
    return (classifier,) if isinstance(classifier, str) else tuple(classifier)


def official_weights(name: str, weights: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """`weights` under the official key names of model `name`'s family (timm's own layouts renamed, as the
    checkpoint filter renames them), so that class counts and shape changes are read where the model has them."""
    with torch.device('meta'):
        model = timm.create_model(name)
    return official_keys(model, dict(weights))


def classifier_rows(name: str, state_dict: Mapping[str, Tensor]) -> Optional[int]:
    """The class count of the classifier weights in `state_dict` for model `name`, None when it has none."""
    for classifier in classifier_names(name):
        weight = state_dict.get(f'{classifier}.weight')
        if weight is not None:
            return int(weight.shape[0])
    return None


def imagenet1k_difference(classes: Sequence[str]) -> Optional[str]:
    """How class folder names `classes` differ from ImageNet-1k's synsets in order ("class 3 is 'x', not
    'n01491361'"); None where they are the same."""
    if tuple(classes) == imagenet1k_classes():
        return None
    index = next((i for i, (found, synset) in enumerate(zip(classes, imagenet1k_classes())) if found != synset), None)
    return f"{len(classes)} classes" if index is None else \
        f"class {index} is {classes[index]!r}, not {imagenet1k_classes()[index]!r}"


def narrows_to_imagenet1k(name: str, weights: Mapping[str, Tensor]) -> bool:
    """Whether `weights` (official key names) hold an ImageNet-22k classifier whose ImageNet-1k rows a 1000-class
    model `name` takes (`models.checkpoint.narrow_imagenet22k_classifier`: Swin's family)."""
    if classifier_rows(name, weights) != IMAGENET22K_CLASSES:  # every other classifier: no model to build
        return False
    with torch.device('meta'):
        target = timm.create_model(name, num_classes=1000)
    given = dict(weights)
    return narrow_imagenet22k_classifier(target, given) is not given


def _with_imagenet1k_classifier(name: str, model: nn.Module, weights: Dict[str, Tensor], source: str,
                                classes: Optional[Sequence[str]]) -> Dict[str, Tensor]:
    """`weights` (official key names) with an ImageNet-22k classifier narrowed to the ImageNet-1k rows where
    `model`'s family fine-tunes so (`models.checkpoint.narrow_imagenet22k_classifier`), said in the log; not where
    the data's `classes` (class folder names, None: unknown) are other than ImageNet-1k's, which start a new one."""
    narrowed = narrow_imagenet22k_classifier(model, weights)
    if narrowed is weights:
        return weights
    given_rows, rows = classifier_rows(name, weights), classifier_rows(name, narrowed)
    differ = None if classes is None else imagenet1k_difference(classes)
    if differ is not None:
        logger.info(f"{source}: kept none of the weights' {given_rows} ImageNet-22k classifier rows: the data's "
                    f"classes are not ImageNet-1k's ({differ}), so those rows would start the wrong classes")
        return weights
    logger.info(f"{source}: took the classifier rows of the {rows} ImageNet-1k classes from the weights' "
                f"{given_rows} ImageNet-22k classes, as the family's official fine-tuning does")
    return narrowed


def read_weights(path: str, ema: bool = False, without_ema: str = 'drop --ema', released: bool = False
                 ) -> Dict[str, Tensor]:
    """Model weights from a checkpoint file: ours (`model` / `model_ema`), an official release (`model`,
    `state_dict`, `state_dict_ema`) or a flat state dict. `ema` picks the EMA weights and fails without them,
    naming `without_ema` as the way to the model weights. A `released` file (the weights of a model name) gives
    what `timm.create_model(name, pretrained=True)` takes from it: its EMA weights where it holds both."""
    return checkpoint_weights(load_checkpoint_file(path), path, ema, without_ema, released)


def weights_keys(checkpoint: Any, ema: bool = False, released: bool = False) -> Tuple[str, ...]:
    """The keys the loaded contents of a checkpoint file give their weights from, in order, for `ema` and a
    `released` file: `file_weights_keys` unless one of them is set."""
    return EMA_KEYS if ema else PRETRAINED_KEYS if released else file_weights_keys(checkpoint)


def checkpoint_weights(checkpoint: Any, path: str, ema: bool = False, without_ema: str = 'drop --ema',
                       released: bool = False) -> Dict[str, Tensor]:
    """`read_weights` of the loaded contents of the checkpoint file `path`."""
    if ema and (not isinstance(checkpoint, Mapping)
                or not any(isinstance(checkpoint.get(k), Mapping) for k in EMA_KEYS)):
        raise CheckpointError(f"checkpoint {path!r} has no EMA weights; expected one of the keys "
                              f"{', '.join(EMA_KEYS)} ({without_ema} to use the model weights)")
    return checkpoint_state_dict(checkpoint, weights_keys(checkpoint, ema, released), f"checkpoint {path!r}")


def _check_channels(cfg: CN, in_chans: int) -> None:
    """The data pipeline feeds grey-scale ('L') or RGB images, normalised with one mean and std per channel."""
    if in_chans not in (1, 3):
        raise ConfigError(f"config key MODEL.KWARGS.in_chans is {in_chans!r}; expected 1 (grey-scale images, read as "
                          f"'L') or 3 (RGB)")
    example = 'DATA.MEAN [0.5] DATA.STD [0.5] for grey-scale images' if in_chans == 1 else \
        "DATA.MEAN [0.485, 0.456, 0.406] DATA.STD [0.229, 0.224, 0.225] for RGB images"
    for key, values in (('DATA.MEAN', cfg.DATA.MEAN), ('DATA.STD', cfg.DATA.STD)):
        if len(values) != in_chans:
            raise ConfigError(f"config key {key} holds {len(values)} value{'s' if len(values) > 1 else ''} but the "
                              f"model takes {in_chans} channel{'s' if in_chans > 1 else ''} (MODEL.KWARGS.in_chans "
                              f"{in_chans}); expected one mean and one std per channel, e.g. {example}")


# How torch's CPU allocator, where the engine builds models, refuses a tensor too large for the memory left
_ALLOCATION_FAILURE = re.compile(r"you tried to allocate (\d+) bytes")


def _unknown_attention_hint(error: UnknownAttentionError, imports: Sequence[str]) -> str:
    """The way on from an attention name that is not registered and close to no registered one (the error says
    "did you mean" there): an attention of the user's own registers when its module is imported (a local-dir:
    model saved with one too); where MODEL.IMPORTS imported modules, none of them registers the name."""
    if close_attention_name(error.name):
        return ''
    if not imports:
        return ('; an attention of your own is registered by importing its module first: --opts MODEL.IMPORTS '
                '"[\'your_module\']"')
    return (f"; the modules of MODEL.IMPORTS {list(imports)!r} register no attention {error.name!r}: expected "
            f"@register_attention({error.name!r}) on its mixer class")


def _model_settings(cfg: CN) -> str:
    """The config values the engine builds the model from, as `KEY value, ...`."""
    given = {'MODEL.NUM_CLASSES': cfg.MODEL.NUM_CLASSES, 'DATA.IMG_SIZE': cfg.DATA.IMG_SIZE,
             'MODEL.DROP_PATH_RATE': cfg.MODEL.DROP_PATH_RATE}
    given.update({f'MODEL.KWARGS.{key}': value for key, value in cfg.MODEL.KWARGS.items()})
    return ', '.join(f'{key} {value!r}' for key, value in given.items())


def _unexpected_keywords(error: TypeError) -> List[str]:
    """The keywords a constructor refused, read from its message: Python's "unexpected keyword argument 'x'"
    (Python 3.13 appends a guess), or "unexpected keyword argument(s): ['x', 'y']" of timm models that take
    **kwargs."""
    listed = re.search(r"unexpected keyword argument\(s\): \[([^\]]*)\]", str(error))
    if listed:
        return re.findall(r"'(\w+)'", listed.group(1))
    single = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    return [single.group(1)] if single else []


def _timm_create_model(cfg: CN, kwargs: Dict[str, Any]) -> nn.Module:
    """`timm.create_model(MODEL.NAME, **kwargs)`, leaving out the engine's own keywords that a model has no argument
    for and does not need: img_size (a convolutional net takes any input size) and a drop_path_rate of 0 (a net
    without stochastic depth), unless MODEL.KWARGS gives them."""
    name = cfg.MODEL.NAME
    while True:
        try:
            return timm.create_model(name, **kwargs)
        except TypeError as e:
            keywords = _unexpected_keywords(e)
            if not keywords or any(k not in ('img_size', 'drop_path_rate') or k not in kwargs or k in cfg.MODEL.KWARGS
                                   for k in keywords):
                raise
            if 'drop_path_rate' in keywords and kwargs['drop_path_rate']:
                raise ConfigError(f"model {name!r} has no stochastic depth (no drop_path_rate argument); expected "
                                  f"MODEL.DROP_PATH_RATE 0.0, not {kwargs['drop_path_rate']}") from None
            for keyword in keywords:
                kwargs.pop(keyword)


def create_model(cfg: CN, weights: Optional[Dict[str, Tensor]] = None, source: str = 'checkpoint',
                 device: Optional[str] = None, strict: bool = True,
                 classes: Optional[Sequence[str]] = None) -> nn.Module:
    """`timm.create_model(MODEL.NAME, num_classes, img_size, drop_path_rate, **MODEL.KWARGS)`, its parameters
    created on `device` (None: the default device); without `img_size` or a `drop_path_rate` of 0 for a model that
    has no such argument (a convolutional net, a net without stochastic depth), unless MODEL.KWARGS gives them.

    `weights` go through the family's checkpoint filter (official layouts, derived buffers, resizing), so our
    checkpoints and official releases load alike. A classifier for another class count is re-initialised (for
    fine-tuning); callers that evaluate check the class count first. Without `strict`, only the tensors the
    weights share with the model load (`models.checkpoint.load_shared_weights`), and the log names the others.
    A 1000-class Swin takes the ImageNet-1k rows of ImageNet-22k weights unless the data's `classes` (class folder
    names, where known) are other than ImageNet-1k's.
    """
    if weights is not None and not strict:
        model = create_model(cfg, source=source, device=device)
        weights = _with_imagenet1k_classifier(cfg.MODEL.NAME, model, official_keys(model, dict(weights)), source,
                                              classes)
        try:
            report = load_shared_weights(model, weights, source)
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None
        logger.info(f"{source}: {report}")
        return model
    import_model_modules(cfg)
    name = cfg.MODEL.NAME
    check_model_name(name)
    kwargs: Dict[str, Any] = model_kwargs(cfg)
    if device is not None:
        kwargs['device'] = device
    if weights is not None:
        with torch.device('meta'):
            target = timm.create_model(name, num_classes=cfg.MODEL.NUM_CLASSES)
        weights = _with_imagenet1k_classifier(name, target, official_keys(target, dict(weights)), source, classes)
        rows = classifier_rows(name, weights) or cfg.MODEL.NUM_CLASSES
        overlay: Dict[str, Any] = dict(state_dict=weights, num_classes=rows)
        # the weights' own input channels, which timm's loader compares with the model's (a one-channel checkpoint
        # under the release's 3 logged that its stem 'already matches' on every load)
        first_conv = target.pretrained_cfg.get('first_conv')
        stem = weights.get(f'{first_conv}.weight') if isinstance(first_conv, str) else None
        if stem is not None and stem.ndim == 4 and target.pretrained_cfg.get('input_size'):
            overlay['input_size'] = (stem.shape[1], *target.pretrained_cfg['input_size'][1:])
        kwargs.update(pretrained=True, pretrained_cfg_overlay=overlay)
    try:
        model = _timm_create_model(cfg, kwargs)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None
    except UsageError:
        raise
    except TypeError as e:
        keywords = _unexpected_keywords(e)
        if keywords:
            keyword = keywords[0]
            raise ConfigError(f"model {name!r} does not accept the keyword {keyword!r} (MODEL.KWARGS.{keyword}); "
                              f"expected the constructor's own argument names") from e
        raise
    except ValueError as e:
        hint = _unknown_attention_hint(e, cfg.MODEL.IMPORTS) if isinstance(e, UnknownAttentionError) else ''
        raise ConfigError(f"cannot build model {name!r} from {_model_settings(cfg)}: {e}{hint}") from e
    except RuntimeError as e:
        tried = _ALLOCATION_FAILURE.search(str(e))
        if tried is None:
            raise
        raise ConfigError(f"cannot build model {name!r} from {_model_settings(cfg)}: not enough memory for its "
                          f"parameters (one tensor needs {int(tried.group(1)) / 2 ** 30:.1f} GiB); expected "
                          f"settings of a model that fits") from e
    _check_channels(cfg, getattr(model, 'in_chans', 0) or 3)
    if weights is not None:
        model.pretrained_cfg.pop('state_dict', None)  # do not keep a second copy of the weights alive
        for change in weight_changes(name, weights, model):
            logger.info(f"{source}: {change}")
    return model


def weight_changes(name: str, weights: Mapping[str, Tensor], model: nn.Module) -> List[str]:
    """What loading `weights` into `model` changed, one sentence each: a classifier re-initialised for another
    class count, the first convolution adapted to another channel count (as timm's loader adapts it), and tensors
    resized to the model's resolution (position embeddings and tables)."""
    own = model.state_dict()
    classifier_keys = {f'{c}.{part}' for c in classifier_names(name) for part in ('weight', 'bias')}
    first_conv = getattr(model, 'pretrained_cfg', {}).get('first_conv')
    changes = []
    rows = classifier_rows(name, weights)
    if rows is not None and rows != getattr(model, 'num_classes', rows):
        changes.append(f"re-initialised the classifier for {model.num_classes} classes (the weights have {rows})")
    for key, value in weights.items():
        if key not in own or key in classifier_keys or own[key].shape == value.shape:
            continue
        if key == f'{first_conv}.weight' and own[key].shape[1] != value.shape[1]:
            how = 'summed over' if own[key].shape[1] == 1 else 'repeated from'
            changes.append(f"adapted {key} to {own[key].shape[1]} input channel(s), {how} the weights' "
                           f"{value.shape[1]}")
        else:
            changes.append(f"resized {key} from {tuple(value.shape)} to {tuple(own[key].shape)}")
    return changes


def check_model_config(cfg: CN) -> nn.Module:
    """Build the model on the meta device, which allocates nothing, so that a name, keyword or value it refuses fails
    on one line before any data is read; returns that model."""
    return create_model(cfg, device='meta')


def create_training_model(cfg: CN, device: torch.device, weights: Optional[Dict[str, Tensor]] = None,
                          source: str = 'checkpoint', strict: bool = True,
                          classes: Optional[Sequence[str]] = None) -> nn.Module:
    """`create_model` as training runs it, on `device`, for the data's `classes`: through oneDNN with
    TRAIN.ONEDNN, with gradient checkpointing with TRAIN.USE_CHECKPOINT."""
    model = create_model(cfg, weights, source=source, strict=strict, classes=classes)
    if cfg.TRAIN.ONEDNN:
        convert_to_onednn(model)
    if cfg.TRAIN.USE_CHECKPOINT:
        model.set_grad_checkpointing(True)
    return model.to(device)


# the devices torch's SyncBatchNorm has kernels for
SYNC_BN_DEVICES = ('cuda', 'xpu', 'hpu')


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def check_sync_bn(cfg: CN, model: nn.Module, info: DistInfo) -> None:
    """Refuse TRAIN.SYNC_BN with TRAIN.COMPILE where the BatchNorm layers of `model` would be synchronized:
    torch.compile(fullgraph=True) cannot trace SyncBatchNorm's collectives as one graph."""
    if cfg.TRAIN.SYNC_BN and cfg.TRAIN.COMPILE and info.distributed and info.device.type in SYNC_BN_DEVICES \
            and _has_batchnorm(model):
        raise UsageError("TRAIN.SYNC_BN with TRAIN.COMPILE: torch.compile(fullgraph=True) cannot trace the "
                         "collectives of torch's SyncBatchNorm as one graph; expected one of them off "
                         "(TRAIN.SYNC_BN False keeps BatchNorm statistics per process)")


def synchronize_batchnorm(model: nn.Module, info: DistInfo) -> nn.Module:
    """`model` with its BatchNorm layers as torch's SyncBatchNorm (TRAIN.SYNC_BN, under several processes), which
    computes training statistics over all processes' batches, as the official SimA code trains its XCiT nets: same
    parameters, buffers and state-dict keys, converted in place. torch's SyncBatchNorm runs on CUDA, XPU and HPU
    devices only: elsewhere (the CPU) the layers stay per process, and rank 0 says so once."""
    if not _has_batchnorm(model):
        return model
    if info.device.type not in SYNC_BN_DEVICES:
        if info.is_main:
            logger.warning(f"TRAIN.SYNC_BN: torch's SyncBatchNorm runs on CUDA, XPU and HPU devices only; on "
                           f"{info.device.type} each process keeps BatchNorm statistics of its own batches")
        return model
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def check_onednn(device: torch.device, amp: Optional[str], setting: str) -> None:
    """oneDNN's products (`setting`: the flag or config key that asks for them, `models.convert_to_onednn`) speed
    up float32 on the CPU only (`amp`: the setting that turned autocast on, None if off): say so before any work."""
    if device.type != 'cpu':
        raise UsageError(f"{setting} runs the model's products on the CPU, but the device is {device}; expected "
                         f"DEVICE cpu")
    if amp:
        raise UsageError(f"{setting} with {amp}: the model's products would take autocast's path; expected float32 "
                         f"(leave out {amp} or {setting})")
    if not onednn_available():
        raise UsageError(f"{setting}: this PyTorch build has no oneDNN, or torch.backends.mkldnn.enabled is False; "
                         f"expected torch.backends.mkldnn.is_available()")


def check_optimizer_config(cfg: CN) -> type:
    """The optimizer class TRAIN.OPTIMIZER names, after checking that BETAS, where given to an optimizer that takes
    betas, are as many as it takes; a `ConfigError` otherwise, before any data is read. EPS and BETAS go to the
    optimizers that take them and are left out for the others (SGD's eps), as timm's factory does."""
    opt = cfg.TRAIN.OPTIMIZER
    if opt.NAME not in list_optimizers():
        close = difflib.get_close_matches(opt.NAME, list_optimizers(), n=3)
        raise ConfigError(f"config key TRAIN.OPTIMIZER.NAME is {opt.NAME!r}; expected a timm optimizer name"
                          + (f" such as {', '.join(close)}" if close else ''))
    info = get_optimizer_info(opt.NAME)
    try:
        kind = get_optimizer_class(info, bind_defaults=False)
    except (AssertionError, ImportError) as e:  # bitsandbytes' optimizers need it installed, and CUDA
        raise ConfigError(f"config key TRAIN.OPTIMIZER.NAME is {opt.NAME!r}, which cannot be built here ({e}); "
                          f"expected an optimizer such as 'adamw'") from None
    if info.has_betas and opt.BETAS is not None and len(opt.BETAS) != info.num_betas:
        own = _own_settings(kind).get('betas')
        raise ConfigError(f"config key TRAIN.OPTIMIZER.BETAS is {opt.BETAS}; {opt.NAME!r} takes {info.num_betas} "
                          f"betas ({f'its own: {list(own)}, ' if own else ''}or None for its own)")
    return kind


def _own_settings(kind: type) -> Dict[str, Any]:
    """The eps and betas an optimizer class takes by default, where its signature gives them."""
    parameters = inspect.signature(kind).parameters
    return {name: parameters[name].default for name in ('eps', 'betas')
            if name in parameters and parameters[name].default is not inspect.Parameter.empty}


def optimizer_settings(cfg: CN) -> Dict[str, Any]:
    """The eps and betas the optimizer of `cfg` updates with: TRAIN.OPTIMIZER's where given, else its own (absent
    where it takes none), so that two configs compare by what they train with (EPS 1e-8 and None are the same
    AdamW)."""
    opt = cfg.TRAIN.OPTIMIZER
    info = get_optimizer_info(opt.NAME)
    own = _own_settings(check_optimizer_config(cfg))
    settings = {}
    if info.has_eps:
        settings['eps'] = opt.EPS if opt.EPS is not None else own.get('eps')
    if info.has_betas:
        betas = opt.BETAS if opt.BETAS is not None else own.get('betas')
        settings['betas'] = None if betas is None else list(betas)
    return settings


def create_optimizer(cfg: CN, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """timm's optimizer factory; no weight decay on 1-D parameters, biases and `model.no_weight_decay()` names;
    TRAIN.OPTIMIZER's EPS and BETAS where given, else the optimizer's own, as timm's train.py passes them.

    With `TRAIN.OPTIMIZER.FUSED` torch's Adam, AdamW and SGD update all parameters in one fused kernel: the same
    update to float rounding, 2.1-2.9x faster than the per-tensor loop torch uses on the CPU by default.
    """
    opt = cfg.TRAIN.OPTIMIZER
    kind = check_optimizer_config(cfg)
    extra: Dict[str, Any] = {}
    if opt.EPS is not None:
        extra['eps'] = opt.EPS
    if opt.BETAS is not None:
        extra['betas'] = tuple(opt.BETAS)
    if opt.FUSED and kind in FUSED_OPTIMIZERS:
        extra['fused'] = True
    if cfg.TRAIN.BACKBONE_LR_SCALE != 1:
        extra['param_group_fn'] = _backbone_scaled_groups(cfg.TRAIN.WEIGHT_DECAY, lr * cfg.TRAIN.BACKBONE_LR_SCALE)
    return create_optimizer_v2(model, opt=opt.NAME, lr=lr, weight_decay=cfg.TRAIN.WEIGHT_DECAY,
                               momentum=opt.MOMENTUM, **extra)


def _backbone_scaled_groups(weight_decay: float, backbone_lr: float) -> Callable[[nn.Module], List[Dict[str, Any]]]:
    """A `param_group_fn` for timm's factory: its weight-decay groups, each split into the classifier's parameters
    (`model.get_classifier()`, first, so the first group's lr is the schedule of BASE_LR) and the rest, which peak
    at `backbone_lr`. timm's schedulers keep one peak per group and share the warm-up start and the minimum, as
    CSwin's fine-tuning does with its --lr-scale."""
    def groups(model: nn.Module) -> List[Dict[str, Any]]:
        classifier = model.get_classifier()
        modules = classifier if isinstance(classifier, tuple) else (classifier,)  # DeiT's distilled heads
        in_classifier = {id(p) for module in modules for p in module.parameters()}
        no_decay = getattr(model, 'no_weight_decay', lambda: set())()
        heads, backbone = [], []
        for group in param_groups_weight_decay(model, weight_decay, no_weight_decay_list=no_decay):
            params = group.pop('params')
            heads.append({**group, 'params': [p for p in params if id(p) in in_classifier]})
            backbone.append({**group, 'params': [p for p in params if id(p) not in in_classifier], 'lr': backbone_lr})
        return [group for group in heads + backbone if group['params']]
    return groups


def create_scheduler(cfg: CN, optimizer: torch.optim.Optimizer, lrs: Mapping[str, float],
                     updates_per_epoch: int) -> Tuple[Any, int]:
    """timm's scheduler, counting in updates or in epochs as TRAIN.LR_SCHEDULER.STEP steps it
    (`engine.loops.step_schedule`); returns it and the number of epochs to run (EPOCHS + COOLDOWN_EPOCHS, at MIN_LR
    after EPOCHS).

    The warm-up is always inside EPOCHS. With `WARMUP_PREFIX` the decay starts after it (Swin), so the decay
    spans EPOCHS - WARMUP_EPOCHS: timm adds a prefixed warm-up to the epochs it is given, while Swin subtracts it.
    """
    sched = cfg.TRAIN.LR_SCHEDULER
    train = cfg.TRAIN
    schedule_epochs = train.EPOCHS - train.WARMUP_EPOCHS if sched.WARMUP_PREFIX else train.EPOCHS
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=sched.NAME, num_epochs=schedule_epochs, decay_epochs=sched.DECAY_EPOCHS,
        decay_milestones=list(sched.MILESTONES), cooldown_epochs=train.COOLDOWN_EPOCHS,
        decay_rate=sched.DECAY_RATE, min_lr=lrs['min_lr'], warmup_lr=lrs['warmup_lr'],
        warmup_epochs=train.WARMUP_EPOCHS, warmup_prefix=sched.WARMUP_PREFIX, step_on_epochs=sched.STEP != 'update',
        updates_per_epoch=updates_per_epoch)
    return scheduler, train.EPOCHS + train.COOLDOWN_EPOCHS


def create_criterion(cfg: CN) -> nn.Module:
    """Soft-target cross entropy under mixup/cutmix (smoothing is in the targets), else label smoothing."""
    if mixup_active(cfg):
        return SoftTargetCrossEntropy()
    if cfg.MODEL.LABEL_SMOOTHING > 0:
        return LabelSmoothingCrossEntropy(smoothing=cfg.MODEL.LABEL_SMOOTHING)
    return nn.CrossEntropyLoss()


def cpu_has_bfloat16_kernels() -> bool:
    """Whether oneDNN has bfloat16 kernels for this CPU (AVX-512 BW, VL and DQ, AMX, or Arm's bfloat16). Without
    them torch multiplies and convolves bfloat16 in slow fallbacks: a tiny DeiT trained 5x slower under bfloat16
    autocast than in float32 on a CPU with AVX2 only."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def autocast_dtype(cfg: CN, device: torch.device, enabled: bool) -> str:
    """AMP.DTYPE for autocast on `device`, except float16 on the CPU, which becomes bfloat16 (logged when `enabled`,
    with a warning where the CPU has no bfloat16 kernels).

    CPU float16 autocast runs several times slower than float32; bfloat16 has float32's range, so it needs no
    gradient scaler either.
    """
    dtype = cfg.AMP.DTYPE
    if device.type == 'cpu' and dtype == 'float16':
        if enabled:
            logger.info("AMP.DTYPE float16 runs as bfloat16 on the CPU (float16 autocast is slower there than float32)")
        dtype = 'bfloat16'
    if enabled and device.type == 'cpu' and not cpu_has_bfloat16_kernels():
        logger.warning("this CPU has no bfloat16 kernels (oneDNN's need AVX-512 or AMX): autocast runs several times "
                       "slower than float32 here; AMP.ENABLED False (eval.py: leave out --amp) runs faster")
    return dtype
