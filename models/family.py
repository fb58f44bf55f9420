"""What the backbone families share: the timm model API (`ZooModel`), variant registration, the pre-norm block, the
official init, block running, head and input checks, and the pieces of their pretrained cfgs."""
import contextlib
import errno
import functools
import inspect
import itertools
import os
import re
import sys
import weakref
from typing import Any, Callable, ClassVar, Collection, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, Mlp, global_pool_nlc, register_notrace_function, to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, register_model, resolve_pretrained_cfg
from timm.models._features import FeatureGetterNet, feature_take_indices
from timm.models._input import update_model_input_size

from .attention import list_attention_options, stage_attentions
from .attention.layout import Grid, tokens_to_image
from .attention.mixer import is_integer, is_number
from .checkpoint import (HUB_SOURCES, IMAGENET22K_CLASSES, cached_file_name, download_checkpoint, is_derived_buffer,
                         load_checkpoint_file, loaded_key_names, rename_loaded_keys, set_tensor_slot)

__all__ = [
    'ZooModel', 'create_variant', 'register_variants', 'Block', 'BlockStack', 'init_weights', 'OfficialKeys',
    'NumberedStageKeys', 'new_classifier',
    'check_arguments', 'split_drop_rates', 'take_feature_indices', 'refuse_causal', 'check_global_pool',
    'check_input', 'check_sides', 'check_output_fmt', 'format_intermediate',
    'imagenet_cfg', 'tag_weights',
    'tsinghua_url', 'INLINE_META', 'FLATTEN_META',
]

# Pretrained-cfg entries of the InLine and FLatten releases, which several families ship. Their evaluation resizes
# the image to a square of int(S / crop_pct) before the centre crop, which is timm's 'squash' crop mode.
INLINE_META = dict(paper_ids='arXiv:2412.06590', origin_url='https://github.com/LeapLabTHU/InLine', crop_mode='squash')
FLATTEN_META = dict(paper_ids='arXiv:2308.00442', origin_url='https://github.com/LeapLabTHU/FLatten-Transformer',
                    crop_mode='squash')


class Block(nn.Module):
    """Pre-norm transformer block around a given attention: x + attn(norm1(x)), then x + mlp(norm2(x)).

    Args:
        dim: channels C.
        attn: an attention module called as `attn(x, size)` on (B, N, C) tokens.
        mlp_ratio: hidden width of the MLP relative to `dim`.
        drop: dropout after the MLP layers.
        drop_path: stochastic depth rate of both residual branches.
        norm_layer: normalisation of the attention and MLP inputs.
    """

    def __init__(
            self,
            dim: int,
            attn: nn.Module,
            mlp_ratio: float = 4.,
            drop: float = 0.,
            drop_path: float = 0.,
            norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
    ):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn
        self.drop_path = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)

    def forward(self, x: Tensor, size: Grid) -> Tensor:
        """x: (B, N, C), the last H*W tokens forming the grid `size` = (H, W) -> (B, N, C)."""
        x = x + self.drop_path(self.attn(self.norm1(x), size))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def init_weights(module: nn.Module) -> None:
    """The official initialisation: Linear trunc-normal(.02) with zero bias, LayerNorm 1 and 0. Parameters on the
    meta device hold no values and are left alone (a truncated normal there costs milliseconds per layer for
    nothing, and models are built on it to check a configuration)."""
    if getattr(module, 'weight', None) is not None and module.weight.is_meta:
        return
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class BlockStack(nn.Sequential):
    """Blocks applied in turn as `block(x, grid)`; with `grad_checkpointing` each block's activations are
    recomputed in the backward pass instead of kept. A Sequential, so the keys stay `<name>.{j}.…` and TorchScript
    unrolls the loop."""

    def forward(self, x: Tensor, grid: Grid, grad_checkpointing: bool = False) -> Tensor:
        for block in self:
            if grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(block, x, grid, use_reentrant=False)
            else:
                x = block(x, grid)
        return x


class OfficialKeys:
    """Keeps a model's state-dict keys official while its submodules are laid out for the forward pass (stages in
    a ModuleList, which TorchScript can loop over).

    `state_dict` renames every key below the model with `to_official` (then orders them stably by `official_rank`,
    when given), and `load_state_dict` renames official keys back with `to_module`; module and parameter names
    (`named_parameters`, `group_matcher`, `feature_info`) stay the module's own. A class rather than closures, so
    that models with these hooks still pickle.
    """

    def __init__(
            self,
            to_official: Callable[[str], str],
            to_module: Callable[[str], str],
            official_rank: Optional[Callable[[str], Any]] = None,
    ):
        self.to_official = to_official
        self.to_module = to_module
        self.official_rank = official_rank

    def register(self, module: nn.Module) -> None:
        # partials, not bound methods: the hook registry marks its hooks with an attribute
        module.register_state_dict_post_hook(functools.partial(OfficialKeys.rename_saved, self))
        module.register_load_state_dict_pre_hook(functools.partial(OfficialKeys.rename_loaded, self))
        module.official_keys = self

    def rename_saved(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        entries = [(prefix + self.to_official(key[len(prefix):]), state_dict.pop(key))
                   for key in [k for k in state_dict if k.startswith(prefix)]]
        if self.official_rank is not None:
            rank = self.official_rank
            entries.sort(key=lambda entry: rank(entry[0][len(prefix):]))
        state_dict.update(entries)

    def rename_loaded(self, module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        renamed = {key: prefix + self.to_module(key[len(prefix):]) for key in state_dict if key.startswith(prefix)}
        rename_loaded_keys(module, state_dict, {key: new for key, new in renamed.items() if new != key})


class NumberedStageKeys:
    """Official keys that number each stage's parts from 1 (`patch_embed1.…`, `block1.…`, `norm4.…`) for the
    module names `stages.{i}.{part}.…`; `parts` maps a stage part's module name to its official stem
    ({'blocks': 'block'}). `to_official` and `to_module` serve `OfficialKeys`; other keys pass unchanged."""

    def __init__(self, parts: Mapping[str, str]):
        self.parts = dict(parts)
        self.module_parts = {official: part for part, official in self.parts.items()}
        self.stage_key = re.compile(rf"^stages\.(\d+)\.({'|'.join(map(re.escape, self.parts))})(?=\.|$)")
        self.official_key = re.compile(rf"^({'|'.join(map(re.escape, self.module_parts))})(\d+)(?=\.|$)")

    def to_official(self, key: str) -> str:
        """'stages.0.blocks.1.attn.q.weight' -> 'block1.1.attn.q.weight' (for parts {'blocks': 'block'})."""
        return self.stage_key.sub(lambda m: f'{self.parts[m.group(2)]}{int(m.group(1)) + 1}', key)

    def to_module(self, key: str) -> str:
        """The inverse of `to_official`."""
        return self.official_key.sub(lambda m: f'stages.{int(m.group(2)) - 1}.{self.module_parts[m.group(1)]}', key)


def new_classifier(model: nn.Module, num_features: int, num_classes: int) -> nn.Module:
    """A `num_classes`-way Linear head (Identity for 0) on `model`'s device and dtype, in its train / eval mode."""
    ref = next(model.parameters())
    head = (nn.Linear(num_features, num_classes, device=ref.device, dtype=ref.dtype)
            if num_classes > 0 else nn.Identity())
    return head.train(model.training)


_ARGUMENT_KINDS = (
    ('sizes', 'an integer > 0', lambda v: is_integer(v) and v > 0),
    ('counts', 'an integer >= 0', lambda v: is_integer(v) and v >= 0),
    ('ratios', 'a number > 0', lambda v: is_number(v) and v > 0),
    ('rates', 'a number in [0, 1]', lambda v: is_number(v) and 0 <= v <= 1),
    ('flags', 'True or False', lambda v: isinstance(v, bool)),
)


# arguments that are an image size, one side for both or an (H, W) pair
_IMAGE_SIZES = ('img_size', 'window_img_size', 'split_img_size')


def check_arguments(
        sizes: Optional[Mapping[str, Any]] = None,
        counts: Optional[Mapping[str, Any]] = None,
        ratios: Optional[Mapping[str, Any]] = None,
        rates: Optional[Mapping[str, Any]] = None,
        flags: Optional[Mapping[str, Any]] = None,
        per_stage: Collection[str] = (),
) -> None:
    """A ValueError naming the first constructor argument out of range, before any layer is built (a layer would
    fail later with a message about tensors): `sizes` (widths, heads, patch and window sizes) take integers > 0,
    `counts` (depths, classes) integers >= 0, `ratios` numbers > 0, `rates` (dropout, drop path) numbers in
    [0, 1] and `flags` (qkv_bias, dynamic_img_size, ...) True or False, not a string that reads as one. Each
    argument is one value, the image sizes also an (H, W) pair, and those named in `per_stage` a list with a value
    per stage (None: not used)."""
    given = dict(sizes=sizes, counts=counts, ratios=ratios, rates=rates, flags=flags)
    for kind, expected, valid in _ARGUMENT_KINDS:
        for name, value in (given[kind] or {}).items():
            if value is None:
                continue
            listed = isinstance(value, (list, tuple))
            if name in per_stage and not listed:
                raise ValueError(f"{name} {value!r} is not a list; expected {expected} per stage, as a list")
            if name in _IMAGE_SIZES and listed and len(value) != 2:
                raise ValueError(f"{name} {value!r} is not an (H, W) pair; expected {expected} or a pair of them")
            if listed and name not in per_stage and name not in _IMAGE_SIZES:
                raise ValueError(f"{name} {value!r} is not one value; expected {expected}")
            entries = list(value) if listed else [value]
            if not entries or not all(valid(v) for v in entries):
                if kind == 'flags':
                    raise ValueError(f"{name} {value!r} is not a bool; expected {expected}")
                each = ' each' if listed else ''
                raise ValueError(f"{name} {value!r} is out of range; expected {expected}{each}")


def split_drop_rates(drop_rate: float, pos_drop_rate: Optional[float] = None,
                     proj_drop_rate: Optional[float] = None) -> Tuple[float, float]:
    """The dropout after the position embedding and the dropout after the attention projections and MLP layers:
    `pos_drop_rate` and `proj_drop_rate` (timm's keywords for them) where given, else `drop_rate`, which the
    official models apply at all of these places."""
    return (drop_rate if pos_drop_rate is None else pos_drop_rate,
            drop_rate if proj_drop_rate is None else proj_drop_rate)


def refuse_causal(attn_kwargs: Mapping[str, Any], stages: str) -> None:
    """A ValueError for `causal=True` in a family whose `stages` (what they do to the grid, named in the message)
    leave no sequence of tokens in order, even where each attention is global."""
    if attn_kwargs.get('causal'):
        raise ValueError(f"causal=True needs one sequence of tokens in order; {stages}, where token order has no "
                         f"meaning")


def check_global_pool(global_pool: str, supported: Sequence[str]) -> str:
    """`global_pool` when it is one of `supported`, else a ValueError naming them."""
    if global_pool not in supported:
        raise ValueError(f"global_pool {global_pool!r} is not supported; expected one of "
                         f"{', '.join(map(repr, supported))}")
    return global_pool


def check_sides(H: int, W: int, divisor: int, least: int, what: str) -> None:
    """A ValueError, naming the size as `what`, unless its sides are positive multiples of `divisor` and at least
    `least`."""
    if H < divisor or W < divisor or H % divisor != 0 or W % divisor != 0:
        raise ValueError(f"{what} {H}x{W} must have sides that are positive multiples of {divisor}")
    if H < least or W < least:
        raise ValueError(f"{what} {H}x{W} must have sides of at least {least}, the smallest the model's stages take")


@register_notrace_function
def check_input(x: Tensor, img_size: Grid, divisor: int, dynamic: bool, least: int = 1, in_chans: int = 0) -> None:
    """A ValueError unless `x` is (B, C, H, W) images the model takes: of `in_chans` channels (any for 0), of its
    (H, W) `img_size`, or with `dynamic` of any size whose sides are positive multiples of `divisor` and at least
    `least`. A leaf of symbolic traces."""
    if x.dim() != 4:
        raise ValueError(f"expected images (B, C, H, W), got a tensor with {x.dim()} dimensions")
    if in_chans and x.shape[1] != in_chans:
        hint = '; channels-last images (B, H, W, C) go in as x.permute(0, 3, 1, 2)' if x.shape[-1] == in_chans else ''
        raise ValueError(f"input of shape {list(x.shape)} has dimension 1 (channels) {x.shape[1]}, but the model "
                         f"takes {in_chans} channels; expected images (B, {in_chans}, H, W){hint}")
    H, W = x.shape[-2], x.shape[-1]
    if dynamic:
        check_sides(H, W, divisor, least, 'input image size')
    elif H != img_size[0] or W != img_size[1]:
        raise ValueError(f"input image size {H}x{W} does not match the model's img_size {img_size[0]}x{img_size[1]}; "
                         f"build the model with img_size=({H}, {W}) instead of ({img_size[0]}, {img_size[1]}), or "
                         f"with dynamic_img_size=True")


torch.fx.wrap('check_input')


def take_feature_indices(num_features: int, indices: Optional[Union[int, Sequence[int]]]) -> Tuple[List[int], int]:
    """timm's `feature_take_indices` (the last n of `num_features` levels for an int, the given ones for a list,
    all for None), with a ValueError naming the index as given where timm asserts on its converted value."""
    if is_integer(indices):
        if not 0 < indices <= num_features:
            raise ValueError(f"feature indices {indices} (the last {indices}) is out of range; expected 1 to "
                             f"{num_features}, the model's feature levels")
    elif indices is not None:
        if not isinstance(indices, (list, tuple)) or not indices:
            raise ValueError(f"feature indices {indices!r} is neither a count nor a list of indices; expected an int "
                             f"or a non-empty list of ints")
        for i in indices:
            if not is_integer(i) or not -num_features <= i < num_features:
                raise ValueError(f"feature index {i!r} is out of range; expected an int from {-num_features} to "
                                 f"{num_features - 1}, of the model's {num_features} feature levels")
    return feature_take_indices(num_features, indices)


def check_output_fmt(output_fmt: str) -> None:
    """A ValueError unless `output_fmt` is a layout `forward_intermediates` returns: 'NCHW', 'NHWC' or 'NLC'."""
    if output_fmt not in ('NCHW', 'NHWC', 'NLC'):
        raise ValueError(f"output_fmt {output_fmt!r} is not supported; expected 'NCHW', 'NHWC' or 'NLC'")


def format_intermediate(tokens: Tensor, grid: Grid, output_fmt: str) -> Tensor:
    """(B, H*W, C) grid tokens as `output_fmt`: (B, C, H, W), (B, H, W, C) or as they are ('NLC')."""
    if output_fmt == 'NCHW':
        return tokens_to_image(tokens, grid)
    if output_fmt == 'NHWC':
        return tokens.reshape(tokens.shape[0], grid[0], grid[1], tokens.shape[-1])
    return tokens


def imagenet_cfg(url: str = '', **kwargs: Any) -> Dict[str, Any]:
    """Pretrained cfg of an ImageNet-1k classifier evaluated at 224 (resize, 0.875 centre crop, bicubic) with a
    `head` Linear; `kwargs` add to or override it."""
    return {
        'url': url, 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': None, 'crop_pct': 0.875,
        'interpolation': 'bicubic', 'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'classifier': 'head', **kwargs,
    }


def tag_weights(cfgs: Dict[str, Dict[str, Any]], tags: Optional[Mapping[str, str]] = None) -> Dict[str, Dict[str, Any]]:
    """`cfgs` with every cfg that has weights keyed 'name.tag', as timm keys released weights: the tag of the
    first prefix in `tags` that the name starts with (timm's own tag where timm keeps the same weights, such as
    'fb_in1k' for DeiT's), else 'in1k'. A name given with its tag ('name.ms_in22k') keeps it, and a name's cfg
    without weights goes where the name has tagged ones. `timm.create_model(name)` takes the first tagged
    weights of `name`, in `cfgs`' order."""
    def key(name: str, cfg: Dict[str, Any]) -> str:
        if '.' in name or not (cfg.get('url') or cfg.get('file')):
            return name
        tag = next((t for prefix, t in (tags or {}).items() if name.startswith(prefix)), 'in1k')
        return f'{name}.{tag}'
    tagged = {key(name, cfg): cfg for name, cfg in cfgs.items()}
    with_weights = {name.split('.')[0] for name in tagged if '.' in name}
    return {name: cfg for name, cfg in tagged.items() if '.' in name or name not in with_weights}


def tsinghua_url(file_id: str) -> str:
    """Download address of an official InLine / FLatten release file."""
    return f'https://cloud.tsinghua.edu.cn/f/{file_id}/?dl=1'


def _from_other_layouts(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook: keys of timm's own layout below `prefix` renamed to the official ones, so that
    `load_state_dict`, timm's `load_checkpoint` and create_model's `checkpoint_path` take them as the checkpoint
    filter of `pretrained=True` does."""
    names = module.official_key_names([key[len(prefix):] for key in state_dict if key.startswith(prefix)])
    rename_loaded_keys(module, state_dict, {prefix + key: prefix + name for key, name in names.items()})


def _skip_derived_buffers(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    """Load pre-hook: drop the relative position indices and shifted-window masks of a state dict below `prefix`;
    a zoo model recomputes them (non-persistent buffers)."""
    for key in [k for k in state_dict if k.startswith(prefix) and is_derived_buffer(k)]:
        del state_dict[key]


# The prefix each model's state dict is loaded under (`module.` inside DistributedDataParallel), the load's list
# of error messages, which torch gives the load pre-hooks but not the post-hooks, and the shapes it loads.
_LoadRecord = Tuple[str, List[str], Dict[str, torch.Size]]
_LOADS: 'weakref.WeakKeyDictionary[nn.Module, _LoadRecord]' = weakref.WeakKeyDictionary()
_SIZE_MISMATCH = re.compile(r'^size mismatch for (\S+): ')


def _remember_load(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
                   missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
    """Load pre-hook: record `prefix`, `error_msgs` and the loaded shapes for `_keys_as_named`."""
    shapes = {key: value.shape for key, value in state_dict.items() if isinstance(value, Tensor)}
    _LOADS[module] = (prefix, error_msgs, shapes)


def _resizable(model: nn.Module, path: str, shape: torch.Size) -> bool:
    """Whether the tensor of `shape` loaded into the parameter at module path `path` is one of another image size
    that the module resizes where the zoo's loaders read weights (`adapt_loaded_tensor`); found on the meta
    device, so without a copy of the tensor."""
    owner_path, _, name = path.rpartition('.')
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        return False
    param, adapt = owner._parameters.get(name), getattr(owner, 'adapt_loaded_tensor', None)
    if param is None or adapt is None or len(shape) != param.dim():
        return False
    try:
        return adapt(name, torch.empty(shape, dtype=param.dtype, device='meta')).shape == param.shape
    except (RuntimeError, ValueError, IndexError):  # a CheckpointError too: a shape it cannot resize
        return False


def _keys_as_named(module: nn.Module, incompatible_keys: Any) -> None:
    """Load post-hook: missing keys and tensors of another size under the names `state_dict` gives them (official
    ones), unexpected keys under the names the loaded state dict gave them, not the module paths torch meets them
    at, so that `load_state_dict` reports (and, strict, refuses) keys a user can find, the model loaded on its own
    or inside a wrapper."""
    renames = loaded_key_names(module)
    prefix, error_msgs, shapes = _LOADS.pop(module, ('', [], {}))
    mismatched = {i: found for i, found in enumerate(map(_SIZE_MISMATCH.match, error_msgs)) if found}
    if incompatible_keys.missing_keys or mismatched:
        saved = {id(tensor): key for key, tensor in module.state_dict(keep_vars=True).items()}
        tensors = itertools.chain(module.named_parameters(remove_duplicate=False), module.named_buffers())
        names = {prefix + name: prefix + saved.get(id(tensor), name) for name, tensor in tensors}
        incompatible_keys.missing_keys[:] = [names.get(key, key) for key in incompatible_keys.missing_keys]
        resizable = []
        for i, found in mismatched.items():
            key = found.group(1)
            error_msgs[i] = f'size mismatch for {names.get(key, key)}: {error_msgs[i][found.end():]}'
            shape = shapes.get(names.get(key, key))
            if shape is not None and _resizable(module, key[len(prefix):], shape):
                resizable.append(names.get(key, key))
        if resizable:
            error_msgs.append(
                f"{', '.join(resizable[:3])}{', ...' if len(resizable) > 3 else ''} of another image or window size: "
                f"load_state_dict copies tensors as they are; timm.create_model(..., pretrained=True, "
                f"pretrained_cfg_overlay=dict(file=...)) and models.checkpoint.load_pretrained_into resize them to "
                f"the model's grid, as set_input_size does")
    given = []
    for key in incompatible_keys.unexpected_keys:
        for _ in range(len(renames)):  # a key renamed by the model's hook, then by a block's or an attention's
            if key not in renames:
                break
            key = renames[key]
        given.append(key)
    incompatible_keys.unexpected_keys[:] = given


class ZooModel(nn.Module):
    """The timm model API that every family shares, over the family's stages.

    A family builds `norm`, `head`, `feature_info`, `num_features`, `global_pool`, `num_prefix_tokens`,
    `num_stages`, `img_size`, `img_divisor` (and `img_min_side` where its stages need more than one divisor, 1 by
    default), `in_chans` (the input channels, checked on every input; 0 by default: not checked), calls
    `_init_input_size` and `_init_output_fmt`, and implements
    `_run_stages(x, num_stages, keep)`: the first `num_stages` stages on the images (grid from `_input_grid`),
    keeping the tokens and (H, W) grid of the stages in `keep`, as a loop over its stage modules that TorchScript
    unrolls, and `_set_grids(img_size)` for `set_input_size`. Intermediates are taken at the stages' outputs.

    With `dynamic_img_size` the model takes images of any size whose sides are multiples of `img_divisor` and at
    least `img_min_side`, the grids following the input; otherwise only `img_size`, every grid then fixed when the
    model is built (which symbolic tracing needs).
    """
    # timm's poolings of tokens and maps; 'token' is added by families with a class token
    global_pools: ClassVar[Tuple[str, ...]] = ('avg', 'max', 'avgmax', '')
    # The new classifier of `reset_classifier` takes the official init (else PyTorch's Linear init).
    official_head_init: ClassVar[bool] = False
    # The final norm belongs to the last stage's width, so pruning stages drops it.
    norm_follows_last_stage: ClassVar[bool] = True
    # A 1000-class model starts from the ImageNet-1k rows of a 21841-class ImageNet-22k classifier, as the family's
    # official fine-tuning does (`models.checkpoint.narrow_imagenet22k_classifier`); else such a classifier is new.
    narrows_imagenet22k_classifier: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.img_min_side = 1
        self.in_chans = 0
        # official checkpoints hold the buffers these models recompute, so that `load_state_dict` of one works as
        # in the official code, and so does timm's `load_checkpoint` (create_model's `checkpoint_path`)
        self.register_load_state_dict_pre_hook(_from_other_layouts)
        self.register_load_state_dict_pre_hook(_skip_derived_buffers)
        self.register_load_state_dict_pre_hook(_remember_load)
        self.register_load_state_dict_post_hook(_keys_as_named)

    def official_key_names(self, keys: Sequence[str]) -> Dict[str, str]:
        """The official name of each of `keys` that a state dict of another layout holds in its place: a family
        whose weights also circulate in timm's own layout (Swin, PVT v2) names them here; empty for official keys."""
        return {}

    def official_keys_of(self, state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """`state_dict` under the family's official key names (`official_key_names`), for its checkpoint filter,
        `load_pretrained_into` and `load_state_dict`."""
        names = self.official_key_names(list(state_dict))
        return {names.get(key, key): value for key, value in state_dict.items()} if names else state_dict

    def _stage_prefix_tokens(self, i: int) -> int:
        """Prefix tokens (a class token) before the grid tokens of stage i's output."""
        return self.num_prefix_tokens

    def _init_input_size(self, dynamic_img_size: bool) -> None:
        """Take any input size with `dynamic_img_size`, else `img_size` only, and say so in timm's model traits:
        the model, not its patch embedding, checks the size, and timm would read the embedding's `strict_img_size`
        (False) as any size taken."""
        self.dynamic_img_size = dynamic_img_size
        self._traits = {**getattr(self, '_traits', {}), 'fixed_input_size': not dynamic_img_size}

    def _init_output_fmt(self, output_fmt: str) -> None:
        """Lay `forward_features` out as `output_fmt`: 'NLC' tokens (prefix tokens first), or the last stage's map
        as 'NHWC' or 'NCHW', which timm reads from `output_fmt`."""
        self.features_fmt = output_fmt
        if output_fmt != 'NLC':
            self.output_fmt = output_fmt

    def _check_input(self, x: Tensor) -> None:
        check_input(x, self.img_size, self.img_divisor, self.dynamic_img_size, self.img_min_side, self.in_chans)

    def _check_size(self, size: Grid, what: str) -> None:
        """A ValueError unless `size` has sides that are positive multiples of `img_divisor`, at least
        `img_min_side`."""
        check_sides(size[0], size[1], self.img_divisor, self.img_min_side, what)

    def _set_grids(self, img_size: Grid) -> None:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        """A submodule or parameter also under the official name its state-dict key starts with (`patch_embed1` for
        `stages.0.patch_embed`, `block1` for `stages.0.blocks`), so that tools that follow state-dict keys through
        attributes (torch.distributed.checkpoint, torch.func.functional_call) find what each key names; timm's
        loader looks up `first_conv` so too. Reached only for names no module, parameter or buffer has."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            keys: Optional[OfficialKeys] = self.__dict__.get('official_keys')
            if keys is None or keys.to_module(name) == name:
                raise
            return functools.reduce(getattr, keys.to_module(name).split('.'), self)

    def __setattr__(self, name: str, value: Any) -> None:
        """A tensor set under the official name of a parameter or buffer (PVT's `pos_embed1`) takes its place, as
        torch.func.functional_call swaps tensors in and back by state-dict keys; set here, it would be an attribute
        that the stage never reads."""
        keys: Optional[OfficialKeys] = self.__dict__.get('official_keys')
        path = keys.to_module(name) if keys is not None and isinstance(value, Tensor) else name
        owner, _, slot = path.rpartition('.')
        if not (path != name and set_tensor_slot(self.get_submodule(owner), slot, value)):
            super().__setattr__(name, value)

    @torch.jit.ignore
    def set_input_size(self, img_size: Optional[Union[int, Grid]] = None) -> None:
        """Make `img_size` (None: the current size, as in timm) the model's input size: position embeddings,
        FLatten's positional encodings and the bias tables of global windows resampled, and windows, stripes and
        masks rebuilt, as a run at that size with `dynamic_img_size=True` resamples and rebuilds them, so outputs at
        `img_size` stay the same."""
        size: Grid = tuple(to_2tuple(self.img_size if img_size is None else img_size))
        self._check_size(size, 'img_size')
        self._set_grids(size)
        self.img_size = size
        update_model_input_size(self, size, **self._resize_args())

    def _resize_args(self) -> Dict[str, Any]:
        """Constructor arguments besides `img_size` that rebuild the model as `set_input_size` left it (recorded
        for `timm.models.save_for_hf`)."""
        return {}

    def _format_features(self, x: Tensor, grid: Grid) -> Tensor:
        """Tokens (B, [prefix +] H*W, C) on `grid` -> the layout of `features_fmt`."""
        if self.features_fmt == 'NHWC':
            return x.reshape(x.shape[0], grid[0], grid[1], x.shape[-1])
        if self.features_fmt == 'NCHW':
            return tokens_to_image(x, grid)
        return x

    def _final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x)

    def _prune_stages(self, num_stages: int) -> None:
        """Drop every stage from `num_stages` on (the family's modules)."""
        raise NotImplementedError

    def _check_pool(self, global_pool: str, num_classes: int) -> str:
        """`global_pool` if this family takes it before a `num_classes`-way head: 'token' only with a class token,
        and '' on a (B, C, H, W) map only without a classifier, as timm's own heads; else a ValueError."""
        if check_global_pool(global_pool, self.global_pools) == 'token' and not self.num_prefix_tokens:
            raise ValueError("global_pool 'token' needs the class token (class_token=True); use 'avg'")
        if not global_pool and num_classes and self.features_fmt == 'NCHW':
            raise ValueError(f"global_pool '' keeps the (B, C, H, W) map, which a classifier of num_classes "
                             f"{num_classes} cannot take; expected num_classes=0 with it, or global_pool 'avg'")
        return global_pool

    def _input_grid(self, x: Tensor) -> Grid:
        """The (H, W) of images `x` after checking them: their own with `dynamic_img_size`, else `img_size`."""
        self._check_input(x)
        if self.dynamic_img_size:
            return x.shape[-2], x.shape[-1]
        return self.img_size

    def _run_stages(self, x: Tensor, num_stages: int,
                    keep: List[int]) -> Tuple[Tensor, Grid, Dict[int, Tuple[Tensor, Grid]]]:
        """The last output of the first `num_stages` stages on images `x` and its grid, and the output and grid of
        the stages in `keep`."""
        raise NotImplementedError

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        """A new `num_classes`-way head (Identity for 0) on the model's device and dtype; optionally a new pooling.

        Without `global_pool` the pooling stays, except that an unpooled (B, C, H, W) map is averaged again under a
        classifier, which needs pooled features.
        """
        check_arguments(counts=dict(num_classes=num_classes))
        if global_pool is None:
            global_pool = self.global_pool
            if not global_pool and num_classes and self.features_fmt == 'NCHW':
                global_pool = 'avg'
        self.global_pool = self._check_pool(global_pool, num_classes)
        self.num_classes = num_classes
        self.head = new_classifier(self, self.num_features, num_classes)
        if self.official_head_init:
            self.head.apply(init_weights)

    def forward_features(self, x: Tensor) -> Tensor:
        """(B, in_chans, H, W) images -> the last stage's output after the final norm, laid out as `features_fmt`:
        (B, [prefix +] h*w, num_features) tokens, (B, h, w, num_features) or (B, num_features, h, w)."""
        x, grid, _ = self._run_stages(x, self.num_stages, [])
        return self._format_features(self._final_norm(x), grid)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Pool the output of `forward_features` as timm pools it ('token': the class token; 'avg', 'max',
        'avgmax': the mean, maximum or their average over the grid tokens; '' keeps it whole), then classify:
        (B, num_features) -> (B, num_classes)."""
        if self.features_fmt == 'NLC':
            x = global_pool_nlc(x, self.global_pool, self.num_prefix_tokens)
        elif self.global_pool:
            tokens = x.flatten(1, 2) if self.features_fmt == 'NHWC' else x.flatten(2).transpose(1, 2)
            x = global_pool_nlc(tokens, self.global_pool, 0)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(
            self,
            x: Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
            return_prefix_tokens: bool = False,
            output_dict: bool = False,
    ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]], List[Tuple[Tensor, Tensor]], Dict[str, Any]]:
        """Stage outputs without prefix tokens, as (B, C, H, W) ('NCHW'), (B, H, W, C) ('NHWC') or (B, H*W, C) ('NLC').

        `indices`: the last n stages (int), the given stages (list) or all (None). `norm` applies the final norm
        (to every output when it does not follow the last stage, else to the last one). Returns the
        intermediates, or (final features, intermediates), the final features in the layout of `forward_features`
        (normed, after a `stop_early` too where the norm does not follow the last stage, as in timm's ViT; the
        norm of a pyramid's last stage does not fit an earlier one's width). As timm's ViT: in a model with prefix
        tokens `return_prefix_tokens` pairs each output with its stage's (B, n, C) prefix tokens (n = 0 in stages
        before a class token joins), and `output_dict` returns {'image_intermediates', 'image_intermediates_prefix'
        (with `return_prefix_tokens`), 'image_features' (unless `intermediates_only`)}.
        """
        check_output_fmt(output_fmt)
        take_indices, max_index = take_feature_indices(self.num_stages, indices)
        run_all = not (stop_early or intermediates_only)
        num_stages = self.num_stages if run_all else max_index + 1
        final, final_grid, kept = self._run_stages(x, num_stages, take_indices)
        last = self.num_stages - 1
        intermediates, prefixes = [], []
        for i in sorted(set(take_indices)):  # in depth order, as timm's models return them
            y, grid = kept[i]
            if norm and (i == last or not self.norm_follows_last_stage):
                y = self._final_norm(y)
            prefix_tokens = self._stage_prefix_tokens(i)
            prefixes.append(y[:, :prefix_tokens])
            y = y[:, prefix_tokens:]
            intermediates.append(format_intermediate(y, grid, output_fmt))
        with_prefixes = return_prefix_tokens and self.num_prefix_tokens > 0
        features: Optional[Tensor] = None
        if not intermediates_only:
            if num_stages == self.num_stages or not self.norm_follows_last_stage:
                final = self._final_norm(final)
            features = self._format_features(final, final_grid)
        if output_dict:
            result: Dict[str, Any] = {'image_intermediates': intermediates}
            if with_prefixes:
                result['image_intermediates_prefix'] = prefixes
            if features is not None:
                result['image_features'] = features
            return result
        taken = list(zip(intermediates, prefixes)) if with_prefixes else intermediates
        return taken if features is None else (features, taken)

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the stages after the last of `indices`, the final norm with `prune_norm` and the head with
        `prune_head` (both where a pyramid loses its last stages: they are as wide as it); returns the kept
        indices."""
        take_indices, max_index = take_feature_indices(self.num_stages, indices)
        if max_index + 1 < self.num_stages:
            self._prune_stages(max_index + 1)
            self.num_stages = max_index + 1
            self.feature_info = self.feature_info[:self.num_stages]
            if self.norm_follows_last_stage:  # the norm and the head are as wide as the last stage: both go
                prune_norm = prune_head = True
                self.num_features = self.head_hidden_size = self.feature_info[-1]['num_chs']
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self._prune_head()
        return take_indices

    def _prune_head(self) -> None:
        """Drop the head: the classifier and its pooling (a family with more modules in its head drops them too)."""
        self.reset_classifier(0, '')


def _fold_attn_options(model_cls: Type[nn.Module], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Move the attentions' method options given as keywords (the official `focusing_factor=...`) into
    `attn_kwargs`, where every family takes them."""
    params = inspect.signature(model_cls.__init__).parameters
    known = list_attention_options()
    options = {key: kwargs.pop(key) for key in list(kwargs) if key in known and key not in params}
    if options:
        given = dict(kwargs.get('attn_kwargs') or {})
        clash = sorted(set(options) & set(given))
        if clash:
            raise ValueError(f"{clash[0]!r} is given both as a keyword and in attn_kwargs; give it once")
        kwargs['attn_kwargs'] = {**given, **options}
    return kwargs


def _block_attentions(args: Mapping[str, Any]) -> List[List[str]]:
    """The attention of every block of a model built from constructor arguments `args`."""
    depths = args.get('depths', args.get('depth'))
    depths = list(depths) if isinstance(depths, (list, tuple)) else [depths]
    extra = {'mixed_linear': args['mixed_linear']} if 'mixed_linear' in args else {}
    return stage_attentions(args['attn_type'], depths, **extra)


def _native_attentions(model_args: Mapping[str, Any], built: Mapping[str, Any]) -> Optional[List[List[str]]]:
    """The attentions of the variant's own `attn_type` in the architecture `built`; None where that attn_type
    does not fit it (a per-stage pattern such as 'IIIS' given other stages)."""
    try:
        return _block_attentions({**built, 'attn_type': model_args['attn_type']})
    except ValueError:
        return None


def create_variant(
        model_cls: Type[nn.Module],
        variant: str,
        pretrained: bool,
        model_args: Mapping[str, Any],
        kwargs: Dict[str, Any],
        **build_kwargs: Any,
) -> nn.Module:
    """Build registered `variant` from its `model_args` overridden by the user's `kwargs`, through timm, on the
    `device` and in the `dtype` that timm's factory may pass.

    A pretrained cfg belongs to the architecture its weights were trained with: a model built with another
    `attn_type` than the variant's loses the release's weights source, and `pretrained=True` with it is refused
    unless the user points at weights of their own: `pretrained_cfg_overlay=dict(file=...)`, `url=...` or
    `state_dict=...` (as `engine` does for a checkpoint of such a model), or the `pretrained_cfg` that timm passes
    for a `local-dir:` or `hf-hub:` model name (a model saved by `timm.models.save_for_hf`). Softmax weights become
    the start of another attention through `models.checkpoint.load_pretrained_into`, which reports the new keys, or
    through timm's `pretrained_strict=False`, which loads every tensor the weights share with the model (any other
    shape is refused, as timm's loader refuses it) and logs the keys it left, as timm does.
    """
    _check_feature_cls(variant, kwargs)
    kwargs = _fold_attn_options(model_cls, dict(kwargs))
    strict = kwargs.get('pretrained_strict', True)
    if not strict:
        build_kwargs['pretrained_filter_fn'] = functools.partial(build_kwargs['pretrained_filter_fn'], strict=False)
    built = {**model_args, **kwargs}
    takes = inspect.signature(model_cls).parameters
    for name in sorted(kwargs.keys() & {'depth', 'depths'} - takes.keys()):  # the other family's name for it
        other = 'depths' if name == 'depth' else 'depth'
        raise TypeError(f"{model_cls.__name__}.__init__() got an unexpected keyword argument {name!r}; {variant} "
                        f"takes {other!r} (now {model_args.get(other)!r})")
    for name in kwargs.keys() & {'depth', 'depths'}:  # read below before the constructor checks them
        per_stage = (name,) if isinstance(model_args.get(name), (list, tuple)) else ()
        check_arguments(counts={name: kwargs[name]}, per_stage=per_stage)
    released_elsewhere: Dict[str, Any] = {}
    native: Optional[List[List[str]]] = None
    if 'attn_type' in kwargs or kwargs.keys() & {'depths', 'depth'}:
        native = _native_attentions(model_args, built)
        depths = built.get('depths', built.get('depth'))
        # depths that are no list are for the constructor to name
        if native is None and 'attn_type' not in kwargs and isinstance(depths, (list, tuple)):
            raise ValueError(f"{variant}'s attn_type {model_args['attn_type']!r} names the attention of each of its "
                             f"own stages, not of depths {depths!r}; expected an attn_type for those stages too")
    if 'attn_type' in kwargs and _block_attentions(built) != native:
        release_sources, own_weights = _weight_sources(variant, kwargs)
        if pretrained and not own_weights and strict:
            raise ValueError(
                f"{variant}'s pretrained weights belong to attn_type {model_args.get('attn_type')!r}, not "
                f"{kwargs['attn_type']!r}; build it with pretrained=False and start from them with "
                f"models.checkpoint.load_pretrained_into(model, {variant!r}), or load the tensors they share with "
                f"pretrained_strict=False, or give your own file through pretrained_cfg_overlay=dict(file=...)")
        cleared = {key: '' if key == 'url' else None for key in release_sources}
        if pretrained and not own_weights:  # pretrained_strict=False: loaded from the release, cleared after
            released_elsewhere = cleared
        else:
            kwargs['pretrained_cfg_overlay'] = {**(kwargs.get('pretrained_cfg_overlay') or {}), **cleared}
    loaded_here = False
    if pretrained:
        if getattr(model_cls, 'narrows_imagenet22k_classifier', False):  # before the weights are read into the cfg
            _keep_narrowed_imagenet22k_classifier(variant, built.get('num_classes'), kwargs)
        loaded_here = _load_weights_file(variant, kwargs)
    device, dtype = kwargs.pop('device', None), kwargs.pop('dtype', None)
    # timm's factory keywords: parameters are created on `device` (the meta device allocates nothing)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = build_model_with_cfg(model_cls, variant, pretrained, **build_kwargs, **dict(model_args, **kwargs))
    for module in model.modules():  # the model, and the model inside a features_only wrapper
        if not isinstance(getattr(module, 'pretrained_cfg', None), dict):
            continue
        if loaded_here:  # the weights read from the cfg's file for timm's loader; the file stays on record
            module.pretrained_cfg.pop('state_dict', None)
        if released_elsewhere:  # started from the release of another attention, which is not this model's release
            module.pretrained_cfg.update(released_elsewhere, file=None)
    return model if dtype is None else model.to(dtype=dtype)


def _check_feature_cls(variant: str, kwargs: Mapping[str, Any]) -> None:
    """A ValueError for a `features_only` extractor other than timm's getter: the stages run inside the model's own
    loop, so no stage module outputs the stage's map for module hooks or graph nodes to take."""
    feature_cls = kwargs.get('feature_cls')
    if not kwargs.get('features_only') or feature_cls is None:
        return
    if isinstance(feature_cls, str):
        getter = feature_cls.lower() == 'getter'
    else:
        getter = isinstance(feature_cls, type) and issubclass(feature_cls, FeatureGetterNet)
    if not getter:
        raise ValueError(f"feature_cls {feature_cls!r} is not supported by {variant}: no stage module outputs the "
                         f"stage's map for hooks or graph nodes to take; expected 'getter' (the default), which takes "
                         f"the maps from forward_intermediates")


def _weight_sources(variant: str, kwargs: Mapping[str, Any]) -> Tuple[List[str], bool]:
    """The weights sources (`url`, `file`, `hf_hub_id`) of `variant`'s release that its pretrained cfg would keep
    under the user's `pretrained_cfg` and `pretrained_cfg_overlay`, and whether those give weights of their own."""
    given_cfg = kwargs.get('pretrained_cfg')
    release = resolve_pretrained_cfg(variant, given_cfg if isinstance(given_cfg, str) else None)
    given = resolve_pretrained_cfg(variant, given_cfg, kwargs.get('pretrained_cfg_overlay'))
    sources = [key for key in ('url', 'file', 'hf_hub_id') if getattr(given, key)]
    kept = [key for key in sources if getattr(given, key) == getattr(release, key)]
    own = given.source in HUB_SOURCES or given.state_dict is not None or len(kept) < len(sources)
    return kept, own


def _keep_narrowed_imagenet22k_classifier(variant: str, num_classes: Any, kwargs: Dict[str, Any]) -> None:
    """Let timm's loader keep the classifier of ImageNet-22k weights that the family's filter narrows to a 1000-class
    model's ImageNet-1k rows: timm drops a classifier whenever the model's class count differs from the pretrained
    cfg's, so the cfg is told the count the filtered weights have. Weights given as a `state_dict` keep the count
    their giver states (`engine` narrows them itself, where the data's classes are ImageNet-1k's)."""
    cfg = resolve_pretrained_cfg(variant, kwargs.get('pretrained_cfg'), kwargs.get('pretrained_cfg_overlay'))
    if num_classes == 1000 and cfg.num_classes == IMAGENET22K_CLASSES and cfg.state_dict is None:
        kwargs['pretrained_cfg_overlay'] = {**(kwargs.get('pretrained_cfg_overlay') or {}), 'num_classes': 1000}


def _load_weights_file(variant: str, kwargs: Dict[str, Any]) -> bool:
    """Read the weights file of `variant`'s pretrained cfg, downloading its URL into the cache first, and hand
    them to timm's loader as `pretrained_cfg_overlay['state_dict']`, with the file kept as the cfg's `file`;
    whether it did (not for weights from a hub, given as a state dict, or without a file or URL).

    Downloads are atomic and fail on one line, and work for URLs without a file name in their path (the InLine /
    FLatten releases' `/f/<id>/?dl=1`, which torch.hub would save as the cache folder itself); a URL's own file
    name is kept, so a file torch.hub or timm downloaded before is reused. The zoo's reader names a file that is
    empty, of another kind, truncated or unsafe on one line, where timm's says EOFError or KeyError: 101."""
    overlay = dict(kwargs.get('pretrained_cfg_overlay') or {})
    cfg = resolve_pretrained_cfg(variant, kwargs.get('pretrained_cfg'), overlay)
    if cfg.source in HUB_SOURCES or cfg.state_dict is not None:
        return False
    if cfg.file and not os.path.isfile(cfg.file):  # timm's own error says nothing ('')
        raise FileNotFoundError(errno.ENOENT, "pretrained weights file not found (pretrained_cfg_overlay file=...)",
                                cfg.file)
    if not cfg.file and (cfg.hf_hub_id or not cfg.url):
        return False
    path = cfg.file or download_checkpoint(cfg.url, cached_file_name(variant, cfg.url), kwargs.get('cache_dir'))
    overlay.update(file=path, state_dict=load_checkpoint_file(path, shown_as=f"pretrained weights file {path!r}"))
    kwargs['pretrained_cfg_overlay'] = overlay
    return True


def register_variants(
        module_name: str,
        variants: Mapping[str, Tuple[Dict[str, Any], str]],
        create: Callable[..., nn.Module],
) -> None:
    """Register one timm entrypoint per variant of a family: `variants` maps a model name to its constructor
    arguments and a one-line description; `create(name, pretrained, model_args, kwargs)` builds it.

    The entrypoints become attributes of the family module, as timm's `@register_model` functions are.
    """
    module = sys.modules[module_name]
    for name, (model_args, doc) in variants.items():
        setattr(module, name, register_model(_entrypoint(module_name, name, model_args, doc, create)))


def _entrypoint(module_name: str, name: str, model_args: Dict[str, Any], doc: str,
                create: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return create(name, pretrained, model_args, kwargs)

    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__module__ = module_name
    entrypoint.__doc__ = f"{doc}\n\nConstructor arguments: {model_args}; keywords override them."
    return entrypoint
