"""The yacs configuration tree, YAML files that inherit with `BASE`, and `--opts KEY VALUE ...` overrides.

The defaults hold the DeiT recipe (facebookresearch/deit `main.py`), its learning rate stepped once per epoch
(`TRAIN.LR_SCHEDULER.STEP previous_epoch`).
A YAML file may name base files in a top-level `BASE: [path, ...]` list, resolved relative to the including file
and merged first, in order. Unknown keys and values of the wrong type fail with a `ConfigError` naming the key.
"""
import argparse
import collections.abc
import difflib
import math
import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import yaml
from timm.data import create_transform
from timm.data.auto_augment import rand_augment_choices
from yacs.config import CfgNode as CN

from .errors import UsageError

__all__ = [
    'ConfigError', 'get_default_config', 'load_config', 'config_from_yaml_string', 'merge_dict', 'merge_opts',
    'parse_args_with_opts',
    'validate_config', 'config_changes', 'compile_backends', 'mixup_active', 'total_batch_size', 'scaled_lrs',
    'ema_decay', 'model_kwargs', 'describe_model', 'stored_config', 'trained_model_changes',
]


class ConfigError(UsageError):
    """A configuration file or override that names an unknown key or holds an invalid value."""


_C = CN()
_C.SEED = 0
_C.DEVICE = 'auto'  # 'auto' (cuda when available), 'cuda' or 'cpu'
_C.OUTPUT = ''  # '' -> output/<config folder>/<config file stem>, or output/<model name> without a file
_C.PRINT_FREQ = 10  # progress-bar refresh, in iterations
_C.SAVE_FREQ = 1  # write last.pth every this many epochs (and always after the last one)

_C.DATA = CN()
_C.DATA.DATASET = 'imagefolder'  # 'imagefolder' (DATA_PATH/train, DATA_PATH/val) or 'digits' (embedded demo set)
_C.DATA.DATA_PATH = ''  # for 'digits': where the image-folder cache is written ('' -> the user cache folder)
_C.DATA.BATCH_SIZE = 64  # per process
_C.DATA.IMG_SIZE = 224
_C.DATA.INTERPOLATION = 'bicubic'
_C.DATA.MEAN = [0.485, 0.456, 0.406]
_C.DATA.STD = [0.229, 0.224, 0.225]
_C.DATA.NUM_WORKERS = 8
_C.DATA.PIN_MEMORY = True
# Files that are not images that can be read (broken links, FIFOs, empty, truncated, non-image): 'error' stops with
# one line naming the file (before training where the scan can tell), 'skip' leaves them out and logs each one.
_C.DATA.BAD_IMAGES = 'error'

_C.MODEL = CN()
_C.MODEL.NAME = 'softmax_deit_tiny'
_C.MODEL.NUM_CLASSES = 1000
_C.MODEL.DROP_PATH_RATE = 0.1
_C.MODEL.LABEL_SMOOTHING = 0.1
# weights to start from (fine-tuning): a file, a model name for its released weights, or the 'local-dir:FOLDER' /
# 'hf-hub:REPO' name of a model saved by timm.models.save_for_hf
_C.MODEL.PRETRAINED = ''
# False: load only the tensors MODEL.PRETRAINED shares with the model (another attention's weights), naming the rest
_C.MODEL.PRETRAINED_STRICT = True
# True: the EMA weights of a MODEL.PRETRAINED checkpoint file (our `model_ema`, an official `state_dict_ema`), as
# eval.py --ema takes them; False: its model weights
_C.MODEL.PRETRAINED_EMA = False
_C.MODEL.RESUME = ''  # a training checkpoint to resume; '' -> OUTPUT/last.pth when TRAIN.AUTO_RESUME
# Constructor keywords passed verbatim to timm.create_model (the official lower-case names: embed_dim, depths, ...).
_C.MODEL.KWARGS = CN(new_allowed=True)
# Python modules imported before the model is built: those that register a user's own attentions or families
# (`register_attention`, `register_model`) outside the package, e.g. ['my_attention']; looked up on the import path
# with the working directory appended.
_C.MODEL.IMPORTS = []

_C.TRAIN = CN()
_C.TRAIN.EPOCHS = 300
_C.TRAIN.WARMUP_EPOCHS = 5
_C.TRAIN.COOLDOWN_EPOCHS = 0  # extra epochs at MIN_LR after EPOCHS
_C.TRAIN.EPOCHS_PER_RUN = 0  # stop (resumable) after this many epochs in one invocation; 0 = run to the end
_C.TRAIN.BASE_LR = 5e-4
_C.TRAIN.WARMUP_LR = 1e-6
_C.TRAIN.MIN_LR = 1e-5
_C.TRAIN.LR_SCALING = 'base'  # scale by total batch / 512: 'base' (DeiT: BASE_LR only), 'all' (Swin), 'none'
# the peak learning rate of every parameter outside the classifier, as a fraction of the classifier's (CSwin's
# fine-tuning --lr-scale); each follows the schedule from its own peak to the same WARMUP_LR and MIN_LR
_C.TRAIN.BACKBONE_LR_SCALE = 1.0
_C.TRAIN.WEIGHT_DECAY = 0.05
_C.TRAIN.CLIP_GRAD = None  # max gradient norm; None = no clipping
_C.TRAIN.ACCUMULATION_STEPS = 1
_C.TRAIN.USE_CHECKPOINT = False  # gradient checkpointing
# BatchNorm statistics over all processes (torch's SyncBatchNorm, as timm's --sync-bn; CUDA only): SimA's XCiT nets
_C.TRAIN.SYNC_BN = False
# torch.compile(fullgraph=True) of the whole model for training and validation; MODE and BACKEND are
# torch.compile's `mode` and `backend` ('aot_eager' traces without generating kernels, to check a model quickly)
_C.TRAIN.COMPILE = False
_C.TRAIN.COMPILE_MODE = 'default'
_C.TRAIN.COMPILE_BACKEND = 'inductor'
# the float32 CPU products of the linear layers and of the attentions (softmax's and MultiMax's fused kernel, the
# linear attentions' batched products) through oneDNN
# (models.convert_to_onednn), training and validation: up to twice as fast on CPUs where the BLAS library runs a
# narrow vector path; CPU only, AMP off
_C.TRAIN.ONEDNN = False
_C.TRAIN.AUTO_RESUME = True
_C.TRAIN.MAX_NONFINITE_STEPS = 0  # updates skipped for a non-finite loss before the run stops with an error
_C.TRAIN.LR_SCHEDULER = CN()
_C.TRAIN.LR_SCHEDULER.NAME = 'cosine'  # a timm scheduler: cosine, tanh, step, multistep, poly
# when the learning rate moves (engine.loops.step_schedule): 'update' (Swin, InLine, FLatten), 'epoch' (timm's
# train.py, CSwin: epoch e at the schedule's value for e) or 'previous_epoch' (DeiT, PVT, SimA: stepped after each
# epoch with that epoch's index, so epoch e >= 1 runs at the value for e - 1)
_C.TRAIN.LR_SCHEDULER.STEP = 'previous_epoch'
_C.TRAIN.LR_SCHEDULER.WARMUP_PREFIX = False  # the decay starts after the warm-up (Swin); both within EPOCHS
_C.TRAIN.LR_SCHEDULER.DECAY_EPOCHS = 30
_C.TRAIN.LR_SCHEDULER.DECAY_RATE = 0.1
_C.TRAIN.LR_SCHEDULER.MILESTONES = [90, 180, 270]
_C.TRAIN.OPTIMIZER = CN()
_C.TRAIN.OPTIMIZER.NAME = 'adamw'  # any timm optimizer name
# None: the optimizer's own, as timm's train.py leaves them (AdamW: 1e-8 and (0.9, 0.999), every recipe's values;
# LAMB's eps is 1e-6, Lion's betas (0.9, 0.99), the Adan family takes three betas)
_C.TRAIN.OPTIMIZER.EPS = None
_C.TRAIN.OPTIMIZER.BETAS = None
_C.TRAIN.OPTIMIZER.MOMENTUM = 0.9
# torch's fused kernel for Adam, AdamW and SGD (one pass over all parameters, CPU and CUDA); other optimizers keep
# their own update
_C.TRAIN.OPTIMIZER.FUSED = True

_C.AUG = CN()
_C.AUG.SCALE = [0.08, 1.0]
_C.AUG.RATIO = [3. / 4., 4. / 3.]
_C.AUG.HFLIP = 0.5
_C.AUG.COLOR_JITTER = 0.3  # no effect while AUTO_AUGMENT is set (timm drops colour jitter then)
_C.AUG.AUTO_AUGMENT = 'rand-m9-mstd0.5-inc1'  # '' = none
_C.AUG.REPROB = 0.25
_C.AUG.REMODE = 'pixel'
_C.AUG.RECOUNT = 1
_C.AUG.MIXUP = 0.8
_C.AUG.CUTMIX = 1.0
_C.AUG.CUTMIX_MINMAX = None
_C.AUG.MIXUP_PROB = 1.0
_C.AUG.MIXUP_SWITCH_PROB = 0.5
_C.AUG.MIXUP_MODE = 'batch'
# random erasing of the mixed batch, not of each image before mixup: CSwin's loader (timm's prefetching one) mixes
# in its collate and erases after normalising, so the erased noise is not blended with the other image
_C.AUG.ERASE_AFTER_MIXUP = False
_C.AUG.REPEATED_AUG = 3  # draws of each image an epoch (DeiT's RASampler, on any number of processes); 1 = off

_C.TEST = CN()
_C.TEST.BATCH_SIZE = 0  # per process; 0 -> 1.5 x DATA.BATCH_SIZE (DeiT)
_C.TEST.CROP_PCT = 0.875  # resize to floor(IMG_SIZE / CROP_PCT) = int(IMG_SIZE * 256 / 224), then crop IMG_SIZE
# 'center' (shorter side, DeiT/Swin), 'squash' (square resize, InLine/FLatten) or 'border' (longer side, padded)
_C.TEST.CROP_MODE = 'center'

_C.AMP = CN()
_C.AMP.ENABLED = True
_C.AMP.DTYPE = 'float16'  # 'float16' (with a gradient scaler) or 'bfloat16'
_C.AMP.EVAL = True  # validate under autocast too, as DeiT, Swin, PVT and CSwin do (InLine / FLatten: float32)

_C.EMA = CN()
_C.EMA.ENABLED = True
_C.EMA.DECAY = 0.99996
_C.EMA.REFERENCE_BATCH = 0  # > 0: decay ** (total batch / REFERENCE_BATCH) (InLine CSwin: 4096)
_C.EMA.FORCE_CPU = False
_C.EMA.EVAL = True  # validate the EMA weights each epoch too (not with FORCE_CPU)
# best.pth is the epoch of the best EMA top-1, where the EMA is validated, not the model's: timm's train.py, and so
# CSwin's, takes the EMA's validation as the run's metric when it has an EMA
_C.EMA.SELECTS_BEST = False

_C.DIST = CN()
_C.DIST.BACKEND = ''  # '' -> nccl on CUDA, gloo on CPU
_C.DIST.TIMEOUT_MIN = 30
_C.DIST.FIND_UNUSED_PARAMETERS = False

# Keys whose default is None take values of this type (or None).
_NULLABLE_TYPES = {'TRAIN.CLIP_GRAD': float, 'AUG.CUTMIX_MINMAX': list, 'TRAIN.OPTIMIZER.EPS': float,
                   'TRAIN.OPTIMIZER.BETAS': list}

_CHOICES = {
    'DEVICE': ('auto', 'cuda', 'cpu'),
    'DATA.DATASET': ('imagefolder', 'digits'),
    'DATA.INTERPOLATION': ('bicubic', 'bilinear', 'nearest', 'random'),
    'DATA.BAD_IMAGES': ('error', 'skip'),
    'TRAIN.LR_SCALING': ('base', 'all', 'none'),
    'TRAIN.LR_SCHEDULER.NAME': ('cosine', 'tanh', 'step', 'multistep', 'poly', 'constant'),
    'TRAIN.LR_SCHEDULER.STEP': ('update', 'epoch', 'previous_epoch'),
    'TEST.CROP_MODE': ('center', 'squash', 'border'),
    'AMP.DTYPE': ('float16', 'bfloat16'),
    'AUG.MIXUP_MODE': ('batch', 'pair', 'elem'),
    'AUG.REMODE': ('pixel', 'rand', 'const'),
    'DIST.BACKEND': ('', 'nccl', 'gloo'),
    'TRAIN.COMPILE_MODE': ('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs'),
}

_POSITIVE = ('DATA.BATCH_SIZE', 'DATA.IMG_SIZE', 'MODEL.NUM_CLASSES', 'TRAIN.EPOCHS', 'TRAIN.ACCUMULATION_STEPS',
             'TRAIN.BASE_LR', 'TRAIN.BACKBONE_LR_SCALE', 'TRAIN.LR_SCHEDULER.DECAY_EPOCHS',
             'TRAIN.LR_SCHEDULER.DECAY_RATE', 'PRINT_FREQ', 'SAVE_FREQ', 'DIST.TIMEOUT_MIN', 'AUG.REPEATED_AUG',
             'AUG.RECOUNT')
_NON_NEGATIVE = ('SEED', 'DATA.NUM_WORKERS', 'TRAIN.WARMUP_EPOCHS', 'TRAIN.COOLDOWN_EPOCHS', 'TRAIN.EPOCHS_PER_RUN',
                 'TRAIN.MAX_NONFINITE_STEPS', 'TRAIN.WARMUP_LR', 'TRAIN.MIN_LR', 'TRAIN.WEIGHT_DECAY',
                 'TRAIN.OPTIMIZER.MOMENTUM', 'TEST.BATCH_SIZE', 'EMA.REFERENCE_BATCH',
                 'MODEL.DROP_PATH_RATE', 'MODEL.LABEL_SMOOTHING', 'AUG.COLOR_JITTER', 'AUG.MIXUP', 'AUG.CUTMIX',
                 'AUG.REPROB')
MAX_TIMEOUT_MIN = 365 * 24 * 60
_UNIT_INTERVAL = ('MODEL.DROP_PATH_RATE', 'MODEL.LABEL_SMOOTHING', 'AUG.HFLIP', 'AUG.REPROB', 'AUG.MIXUP_PROB',
                  'AUG.MIXUP_SWITCH_PROB', 'EMA.DECAY')


def get_default_config() -> CN:
    """A mutable copy of the default tree (the DeiT recipe)."""
    return _C.clone()


def _all_keys(node: CN, prefix: str = '') -> List[str]:
    keys = []
    for key, value in node.items():
        keys.append(prefix + key)
        if isinstance(value, CN):
            keys.extend(_all_keys(value, prefix + key + '.'))
    return keys


def _unknown_key(full_key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(full_key, _all_keys(_C), n=1, cutoff=0.75)
    hint = f"; did you mean {close[0]}?" if close else ''
    return ConfigError(f"unknown config key {full_key} in {source}{hint}")


def _type_name(kind: type) -> str:
    return {float: 'a number', int: 'an integer', bool: 'true or false', str: 'a string', list: 'a list',
            tuple: 'a list'}.get(kind, kind.__name__)


def _coerce(value: Any, default: Any, full_key: str, source: str) -> Any:
    """`value` converted to the type of `default`, or a `ConfigError` naming the key and the expected type."""
    kind = _NULLABLE_TYPES.get(full_key, type(default))
    text, value = value, CN._decode_cfg_value(value)
    if kind is str and isinstance(text, str) and not isinstance(value, str):
        return text  # text that reads as a number, a bool or a list ('2024', 'None', '1e-3') is text for this key
    if value is None and (default is None or full_key in _NULLABLE_TYPES):
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and isinstance(value, str) and value.lower() in ('true', 'false'):  # YAML's spelling, in --opts
        return value.lower() == 'true'
    if kind in (list, tuple) and isinstance(value, (list, tuple)):
        return list(value)
    if kind is type(None) or type(value) is kind:
        return value
    if kind in (list, tuple) and isinstance(value, str) and value.lstrip().startswith('['):
        raise ConfigError(f"config key {full_key} expects a list, got {value!r} in {source}, which does not read as "
                          f"one; expected a Python literal with its strings quoted, e.g. \"['name']\"")
    raise ConfigError(f"config key {full_key} expects {_type_name(kind)}, got {value!r} in {source}")


def _free_form_value(value: Any) -> Any:
    """A value of a node that takes any keys: read as a Python literal where it parses (from --opts), with YAML's
    true / false, and a dict (from a file, or a literal from --opts) as a node that takes any keys too, its values
    read the same way at every depth (`--opts MODEL.KWARGS.attn_kwargs.focusing_factor 2`)."""
    value = CN._decode_cfg_value(value)
    if isinstance(value, dict):
        node = CN(new_allowed=True)
        for key, item in value.items():
            node[key] = _free_form_value(item)
        return node
    if isinstance(value, str) and value.lower() in ('true', 'false'):
        return value.lower() == 'true'
    return value


def merge_dict(cfg: CN, updates: Dict[str, Any], source: str, prefix: str = '') -> None:
    """Merge a nested dict into `cfg`, checking each key exists (unless its node allows new keys) and each type."""
    if not isinstance(updates, dict):
        raise ConfigError(f"{source} must hold a mapping of config keys, got {type(updates).__name__}")
    for key, value in updates.items():
        full_key = prefix + str(key)
        free_form = cfg.is_new_allowed()  # MODEL.KWARGS: the constructor's keywords, of any type, at any depth
        if key not in cfg or (free_form and not (isinstance(cfg[key], CN) and isinstance(value, dict))):
            if not free_form:
                raise _unknown_key(full_key, source)
            cfg[key] = _free_form_value(value)
        elif isinstance(cfg[key], CN):
            if not isinstance(value, dict):
                raise ConfigError(f"config key {full_key} is a group of keys, got {value!r} in {source}")
            merge_dict(cfg[key], value, source, full_key + '.')
        else:
            cfg[key] = _coerce(value, cfg[key], full_key, source)


def _misplaced_option(opts: Sequence[str]) -> Optional[str]:
    """The error for an option written after `--opts`, which takes the rest of the command line; None if none is."""
    misplaced = next((item for item in opts if re.match(r'--[A-Za-z]', item)), None)
    if misplaced is None:
        return None
    return (f"--opts takes KEY VALUE pairs up to the end of the command, got the option {misplaced} among them; "
            f"expected {misplaced} before --opts")


def parse_args_with_opts(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)` for a parser whose `--opts` takes the rest of the line: a `ConfigError` names an
    option written after `--opts` as misplaced, where argparse would call it missing (`required: --out`)."""
    argv = list(argv)
    if '--opts' in argv:
        problem = _misplaced_option(argv[argv.index('--opts') + 1:])
        if problem:
            raise ConfigError(problem)
    return parser.parse_args(argv)


def merge_opts(cfg: CN, opts: Sequence[str], source: str = '--opts') -> None:
    """Merge `--opts KEY VALUE [KEY VALUE ...]` overrides; values are read as Python literals when they parse.
    `source` names the overrides in errors."""
    problem = _misplaced_option(opts)
    if problem:
        raise ConfigError(problem)
    if len(opts) % 2:
        raise ConfigError(f"{source} needs KEY VALUE pairs, got an odd number of items: {' '.join(opts)}")
    for key, value in zip(opts[0::2], opts[1::2]):
        nested: Dict[str, Any] = value
        for part in reversed(key.split('.')):
            nested = {part: nested}
        merge_dict(cfg, nested, source)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """Where a YAML error is and what it is: 'at line L, column C: <problem> (<context> from line K)'."""
    mark, problem = getattr(error, 'problem_mark', None), getattr(error, 'problem', None)
    if mark is None or problem is None:
        return f"({str(error).splitlines()[0]})"
    context, context_mark = getattr(error, 'context', None), getattr(error, 'context_mark', None)
    within = f" ({context} from line {context_mark.line + 1})" if context and context_mark else ''
    return f"at line {mark.line + 1}, column {mark.column + 1}: {problem}{within}"


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key that appears twice in one mapping: plain YAML keeps the last one, which
    silently drops a whole block of keys written before it."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Dict[Any, Any]:
        first_seen: Dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, collections.abc.Hashable):
                continue  # the safe loader refuses it below, with its own message
            if key in first_seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping (the first from line "
                                f"{first_seen[key].line + 1})", key_node.start_mark)
            first_seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML {_yaml_problem(e)}") from None


def _read_yaml(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        problem = ('is a folder; expected a YAML file (such as configs/inline/swin_tiny.yaml)' if os.path.isdir(path)
                   else 'is not a regular file; expected a YAML file' if os.path.exists(path)
                   else 'does not exist; expected a YAML file')
        raise ConfigError(f"config file {path!r} {problem}")
    try:
        with open(path, 'rb') as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read ({e.strerror}); expected a readable YAML "
                          f"file") from None
    try:
        text = raw.decode('utf-8')
    except UnicodeDecodeError as e:
        line = raw.count(b'\n', 0, e.start) + 1
        raise ConfigError(f"config file {path!r} is not UTF-8 text: byte 0x{raw[e.start]:02x} on line {line} is "
                          f"not valid UTF-8; expected a UTF-8 YAML file") from None
    data = _parse_yaml(text, f"config file {path!r}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def _merge_file(cfg: CN, path: str, chain: Sequence[str] = ()) -> None:
    path = os.path.abspath(path)
    if path in chain:
        raise ConfigError(f"config file {path!r} includes itself through BASE")
    data = _read_yaml(path)
    bases = data.pop('BASE', [])
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"BASE in {path!r} must be a list of file paths, got {bases!r}")
    for base in bases:
        if base:
            _merge_file(cfg, os.path.join(os.path.dirname(path), base), (*chain, path))
    merge_dict(cfg, data, path)


def _check(cond: bool, key: str, value: Any, expected: str) -> None:
    if not cond:
        raise ConfigError(f"config key {key} is {value!r}; expected {expected}")


def _get(cfg: CN, full_key: str) -> Any:
    node = cfg
    for part in full_key.split('.'):
        node = node[part]
    return node


def validate_config(cfg: CN) -> None:
    """Check the values beyond their types: choices, ranges and combinations."""
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        _check(value in choices, key, value, 'one of ' + ', '.join(repr(c) for c in choices))
    for key in _POSITIVE + _NON_NEGATIVE:
        value = _get(cfg, key)
        _check(not math.isinf(value), key, value, 'a finite value')
    for key in _POSITIVE:
        value = _get(cfg, key)
        _check(value > 0, key, value, 'a value > 0')
    for key in _NON_NEGATIVE:
        value = _get(cfg, key)
        _check(value >= 0, key, value, 'a value >= 0')
    for key in _UNIT_INTERVAL:
        value = _get(cfg, key)
        _check(0 <= value <= 1, key, value, 'a value in [0, 1]')
    # each process seeds torch with SEED + its rank, which torch takes up to 2**64 - 1
    _check(cfg.SEED < 2 ** 63, 'SEED', cfg.SEED, 'a value below 2**63')
    # torch holds the timeout in nanoseconds of a signed 64-bit count (about 292 years); a year is beyond any wait
    _check(cfg.DIST.TIMEOUT_MIN <= MAX_TIMEOUT_MIN, 'DIST.TIMEOUT_MIN', cfg.DIST.TIMEOUT_MIN,
           f'at most {MAX_TIMEOUT_MIN} (a year)')
    _check(cfg.TRAIN.CLIP_GRAD is None or cfg.TRAIN.CLIP_GRAD > 0, 'TRAIN.CLIP_GRAD', cfg.TRAIN.CLIP_GRAD,
           'None or a value > 0')
    eps = cfg.TRAIN.OPTIMIZER.EPS
    _check(eps is None or 0 <= eps < math.inf, 'TRAIN.OPTIMIZER.EPS', eps, "None (the optimizer's own) or a value >= 0")
    train = cfg.TRAIN
    _check(not train.LR_SCHEDULER.WARMUP_PREFIX or train.WARMUP_EPOCHS < train.EPOCHS, 'TRAIN.WARMUP_EPOCHS',
           train.WARMUP_EPOCHS, f'fewer than TRAIN.EPOCHS ({train.EPOCHS}) with TRAIN.LR_SCHEDULER.WARMUP_PREFIX')
    # above 1 the centre crop is larger than the resized image and padded, as timm does for some models (1.15); the
    # resize must leave a pixel, and 16 times the crop's side is far beyond any recipe (and memory at 1e-4)
    size = cfg.DATA.IMG_SIZE
    _check(1 / 16 <= cfg.TEST.CROP_PCT <= size, 'TEST.CROP_PCT', cfg.TEST.CROP_PCT,
           f"a value in [1/16, {size}]: images are resized to floor(DATA.IMG_SIZE / TEST.CROP_PCT) before the "
           f"{size}-pixel crop, at most 16 times the crop and at least 1 pixel")
    for key in ('DATA.MEAN', 'DATA.STD'):
        value = _get(cfg, key)
        _check(len(value) in (1, 3) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in value), key,
               value, 'one or three finite numbers')
    for key in ('AUG.SCALE', 'AUG.RATIO'):
        value = _get(cfg, key)
        _check(len(value) == 2 and all(isinstance(v, (int, float)) for v in value), key, value, 'two numbers')
    _check(all(v > 0 for v in cfg.DATA.STD), 'DATA.STD', cfg.DATA.STD, 'standard deviations > 0')
    for key in ('AUG.SCALE', 'AUG.RATIO'):
        low, high = _get(cfg, key)
        _check(0 < low <= high, key, [low, high], 'a range [min, max] with 0 < min <= max')
    milestones = train.LR_SCHEDULER.MILESTONES
    _check(all(isinstance(m, (int, float)) and not isinstance(m, bool) and 0 < m < math.inf for m in milestones)
           and list(milestones) == sorted(milestones), 'TRAIN.LR_SCHEDULER.MILESTONES', milestones,
           'epochs > 0 in increasing order, where the multistep schedule decays')
    betas = train.OPTIMIZER.BETAS
    _check(betas is None or (len(betas) in (2, 3) and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)),
           'TRAIN.OPTIMIZER.BETAS', betas, "None (the optimizer's own) or two values in [0, 1) (three for the Adan "
           "family)")
    minmax = cfg.AUG.CUTMIX_MINMAX
    _check(minmax is None or (len(minmax) == 2 and all(isinstance(v, (int, float)) for v in minmax)
                              and 0 < minmax[0] <= minmax[1] <= 1),
           'AUG.CUTMIX_MINMAX', minmax, "None or [min, max], cutmix's box side as a share of the image's, "
                                    "0 < min <= max <= 1")
    _check(_augmentation_policy_parses(cfg.AUG.AUTO_AUGMENT), 'AUG.AUTO_AUGMENT', cfg.AUG.AUTO_AUGMENT,
           "'' (none) or a policy timm's transforms take, e.g. 'rand-m9-mstd0.5-inc1', 'augmix-m5-w3' or 'original', "
           "each section after its name a key and a number (RandAugment's 't' a transform set: 'tweights', 't3a', "
           "'t3aw')")
    _check(cfg.EMA.DECAY < 1, 'EMA.DECAY', cfg.EMA.DECAY,
           'a value in [0, 1) (at 1 the EMA weights never leave their start)')
    for key, engine_key in (('num_classes', 'MODEL.NUM_CLASSES'), ('img_size', 'DATA.IMG_SIZE')):
        given, engine_value = cfg.MODEL.KWARGS.get(key), _get(cfg, engine_key)
        if given is not None and _same_size(given) != _same_size(engine_value):
            raise ConfigError(f"config key MODEL.KWARGS.{key} is {given!r} but {engine_key} is {engine_value!r}; "
                              f"expected {engine_key} {given!r} alone (the engine passes it as {key})")
    if mixup_active(cfg):
        _check(cfg.DATA.BATCH_SIZE % 2 == 0, 'DATA.BATCH_SIZE', cfg.DATA.BATCH_SIZE,
               'an even batch size while mixup/cutmix is on')
    _check(all(isinstance(k, str) and k.islower() for k in cfg.MODEL.KWARGS), 'MODEL.KWARGS',
           list(cfg.MODEL.KWARGS), 'lower-case constructor keyword names')
    _check(bool(cfg.MODEL.NAME), 'MODEL.NAME', cfg.MODEL.NAME, 'a registered model name')
    _check(all(isinstance(m, str) and re.fullmatch(r'[A-Za-z_]\w*(\.[A-Za-z_]\w*)*', m) for m in cfg.MODEL.IMPORTS),
           'MODEL.IMPORTS', cfg.MODEL.IMPORTS, "a list of module names, e.g. ['my_attention']")
    if cfg.TRAIN.COMPILE_BACKEND != 'inductor':  # the registry is read only when another backend is asked for
        backends = compile_backends()
        _check(cfg.TRAIN.COMPILE_BACKEND in backends, 'TRAIN.COMPILE_BACKEND', cfg.TRAIN.COMPILE_BACKEND,
               'one of ' + ', '.join(repr(b) for b in backends))
        _check(cfg.TRAIN.COMPILE_MODE == 'default', 'TRAIN.COMPILE_MODE', cfg.TRAIN.COMPILE_MODE,
               f"'default' with TRAIN.COMPILE_BACKEND {cfg.TRAIN.COMPILE_BACKEND!r} (the other modes are inductor's)")


def _same_size(value: Any) -> Any:
    """An int as (n, n) and a list as a tuple, so that an image size given either way (224, [224, 224]) compares
    equal; a class count (an int on both sides) compares as before."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _augmentation_policy_parses(policy: str) -> bool:
    """Whether timm's transform factory builds the auto-augmentation `policy` ('' for none), every section after
    the policy's name a key with a number, or in RandAugment 't' and a transform set timm knows: timm skips a
    section without a number and takes its default set for an unknown one, so a typo ('incl' for 'inc1') would
    change the recipe in silence."""
    if not policy:
        return True
    name, *sections = policy.split('-')
    for section in sections:
        if name == 'rand' and section.startswith('t'):
            if rand_augment_choices(section[1:]) is rand_augment_choices(''):  # timm's fallback: not a set it knows
                return False
        elif not re.search(r'\d', section):
            return False
    try:
        create_transform(32, is_training=True, auto_augment=policy)
    except (AssertionError, ValueError, KeyError, IndexError, TypeError):
        return False
    return True


def _leaves(node: Dict[str, Any], prefix: str = '') -> Dict[str, Any]:
    """'A.B.C': value of every leaf of a config, or of the nested mappings its YAML holds."""
    leaves: Dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, dict):
            leaves.update(_leaves(value, f'{prefix}{key}.'))
        else:
            leaves[prefix + key] = value
    return leaves


def config_changes(
        before: CN,
        after: CN,
        ignore: Sequence[str] = (),
        compared: Optional[Callable[[str], bool]] = None,
) -> List[str]:
    """'KEY old (this run: new)' for every value `after` holds otherwise than `before`, keys of `ignore` and keys
    `compared` rejects aside; a key only one of them holds (such as one of MODEL.KWARGS) is 'unset' in the other."""
    old, new = _leaves(before), _leaves(after)

    def shown(values: Dict[str, Any], key: str) -> str:
        return repr(values[key]) if key in values else 'unset'
    keys = list(new) + [key for key in old if key not in new]
    return [f"{key} {shown(old, key)} (this run: {shown(new, key)})" for key in keys
            if key not in ignore and (compared is None or compared(key))
            and (key not in old or key not in new or old[key] != new[key])]


def compile_backends() -> List[str]:
    """The backends `torch.compile` accepts by name here, those only for debugging included."""
    import torch._dynamo
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


def mixup_active(cfg: CN) -> bool:
    return cfg.AUG.MIXUP > 0 or cfg.AUG.CUTMIX > 0 or cfg.AUG.CUTMIX_MINMAX is not None


def load_config(
        cfg_file: Optional[str] = None,
        opts: Sequence[str] = (),
        overrides: Optional[Dict[str, Any]] = None,
        opts_source: str = '--opts',
) -> CN:
    """Defaults, then `cfg_file` (with its BASE chain), then `overrides` (nested dict from CLI flags), then `opts`
    (named `opts_source` in errors).

    `OUTPUT` '' resolves to `output/<config folder>/<config file stem>` (or `output/<MODEL.NAME>` without a
    file): configs/inline/deit_tiny.yaml and configs/softmax/deit_tiny.yaml run into folders of their own. Frozen.
    """
    cfg = get_default_config()
    if cfg_file:
        _merge_file(cfg, cfg_file)
    if overrides:
        merge_dict(cfg, overrides, 'the command line')
    merge_opts(cfg, list(opts), opts_source)
    if not cfg.OUTPUT:
        if cfg_file:
            folder = os.path.basename(os.path.dirname(os.path.abspath(cfg_file)))
            cfg.OUTPUT = os.path.join('output', folder, os.path.splitext(os.path.basename(cfg_file))[0])
        else:
            cfg.OUTPUT = os.path.join('output', cfg.MODEL.NAME)
    validate_config(cfg)
    cfg.freeze()
    return cfg


# Keys added after runs were first saved, with how the engine trained before them where that differs from their
# default: a stored config, a whole dump, that lacks one was trained that way.
_BEFORE_THE_KEY = {'TRAIN.LR_SCHEDULER.STEP': 'update'}


def config_from_yaml_string(text: str, source: str = 'the checkpoint') -> CN:
    """Rebuild a config from the YAML text `cfg.dump()` wrote (as stored in checkpoints); a key it lacks because
    the run predates it takes the engine's behaviour then (`_BEFORE_THE_KEY`), not today's default."""
    cfg = get_default_config()
    data = _parse_yaml(text, f"the config stored in {source}")
    stored = _leaves(data) if isinstance(data, dict) else {}
    for key, value in _BEFORE_THE_KEY.items():
        if key not in stored:
            parent, leaf = key.rsplit('.', 1)
            setattr(_get(cfg, parent), leaf, value)
    merge_dict(cfg, data or {}, source)
    validate_config(cfg)
    cfg.freeze()
    return cfg


def total_batch_size(cfg: CN, world_size: int) -> int:
    """Images per optimizer update over all processes."""
    return cfg.DATA.BATCH_SIZE * world_size * cfg.TRAIN.ACCUMULATION_STEPS


def scaled_lrs(cfg: CN, world_size: int) -> Dict[str, float]:
    """BASE_LR, WARMUP_LR and MIN_LR scaled by total batch / 512 as `TRAIN.LR_SCALING` says."""
    factor = total_batch_size(cfg, world_size) / 512.0
    base, warmup, minimum = cfg.TRAIN.BASE_LR, cfg.TRAIN.WARMUP_LR, cfg.TRAIN.MIN_LR
    if cfg.TRAIN.LR_SCALING in ('base', 'all'):
        base *= factor
    if cfg.TRAIN.LR_SCALING == 'all':
        warmup *= factor
        minimum *= factor
    return dict(lr=base, warmup_lr=warmup, min_lr=minimum)


def ema_decay(cfg: CN, world_size: int) -> float:
    """The EMA decay per update, rescaled to the total batch when `EMA.REFERENCE_BATCH` is set (InLine CSwin)."""
    if cfg.EMA.REFERENCE_BATCH > 0:
        return math.pow(cfg.EMA.DECAY, total_batch_size(cfg, world_size) / cfg.EMA.REFERENCE_BATCH)
    return cfg.EMA.DECAY


def _plain(value: Any) -> Any:
    if isinstance(value, CN):
        return {k: _plain(v) for k, v in value.items()}
    return value


# Model keywords that change no weight and nothing an evaluation computes.
_WEIGHT_NEUTRAL_KWARGS = frozenset(
    {'drop_rate', 'pos_drop_rate', 'proj_drop_rate', 'attn_drop_rate', 'drop_path_rate', 'dynamic_img_size'})


def stored_config(checkpoint: Any, source: str) -> Optional[CN]:
    """The config one of our checkpoints stores, None for weights without one (a release, a timm or hub file, an
    official training file) or with one this engine no longer reads."""
    text = checkpoint.get('config') if isinstance(checkpoint, Mapping) else None
    if not isinstance(text, str) or not text.strip():  # blank text would read as the defaults
        return None
    try:
        return config_from_yaml_string(text, source)
    except ConfigError:
        return None


def trained_model_changes(trained: CN, cfg: CN) -> List[str]:
    """'KEY old (this run: new)' for each MODEL.NAME / MODEL.KWARGS value by which `cfg` builds another model than
    the config `trained` of a checkpoint, keywords that change no weight (dropout, stochastic depth) aside."""
    return config_changes(trained, cfg, compared=_builds_another_model)


def _builds_another_model(key: str) -> bool:
    parts = key.split('.')
    return key == 'MODEL.NAME' or (parts[:2] == ['MODEL', 'KWARGS'] and parts[2] not in _WEIGHT_NEUTRAL_KWARGS)


def describe_model(cfg: CN) -> str:
    """The model name and keywords of `cfg`: 'NAME', or 'NAME with MODEL.KWARGS {key: value, ...}'."""
    if not cfg.MODEL.KWARGS:
        return cfg.MODEL.NAME
    kwargs = ', '.join(f"{key}: {value}" for key, value in sorted(_plain(cfg.MODEL.KWARGS).items()))
    return f"{cfg.MODEL.NAME} with MODEL.KWARGS {{{kwargs}}}"


def model_kwargs(cfg: CN) -> Dict[str, Any]:
    """Keyword arguments for `timm.create_model(cfg.MODEL.NAME, **kwargs)`."""
    kwargs: Dict[str, Any] = dict(
        num_classes=cfg.MODEL.NUM_CLASSES, img_size=cfg.DATA.IMG_SIZE, drop_path_rate=cfg.MODEL.DROP_PATH_RATE)
    kwargs.update(_plain(cfg.MODEL.KWARGS))
    return kwargs

