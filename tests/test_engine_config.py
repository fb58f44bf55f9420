"""The config tree: defaults (DeiT recipe), BASE inheritance, --opts, error messages, and the shipped YAML files."""
import math
import re
from pathlib import Path

import pytest
import timm
import yaml

import models  # noqa: F401  (registers the families)
from engine.checkpoint import _as_trained
from engine.config import (ConfigError, config_changes, config_from_yaml_string, ema_decay, get_default_config,
                           load_config, merge_opts, model_kwargs, scaled_lrs)

CONFIGS = Path(__file__).resolve().parents[1] / 'configs'
ALL_YAML = sorted(CONFIGS.rglob('*.yaml'))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_hold_the_deit_recipe():
    cfg = get_default_config()
    assert (cfg.TRAIN.BASE_LR, cfg.TRAIN.WARMUP_LR, cfg.TRAIN.MIN_LR) == (5e-4, 1e-6, 1e-5)
    assert (cfg.TRAIN.EPOCHS, cfg.TRAIN.WARMUP_EPOCHS, cfg.TRAIN.WEIGHT_DECAY) == (300, 5, 0.05)
    assert cfg.TRAIN.OPTIMIZER.NAME == 'adamw' and cfg.TRAIN.CLIP_GRAD is None
    assert cfg.TRAIN.LR_SCHEDULER.NAME == 'cosine' and cfg.TRAIN.LR_SCALING == 'base'
    assert cfg.AUG.AUTO_AUGMENT == 'rand-m9-mstd0.5-inc1' and cfg.AUG.REPROB == 0.25
    assert (cfg.AUG.MIXUP, cfg.AUG.CUTMIX, cfg.MODEL.LABEL_SMOOTHING) == (0.8, 1.0, 0.1)
    assert cfg.AUG.REPEATED_AUG == 3 and cfg.MODEL.DROP_PATH_RATE == 0.1
    assert cfg.EMA.ENABLED and cfg.EMA.DECAY == 0.99996
    assert cfg.DATA.INTERPOLATION == 'bicubic' and cfg.TEST.CROP_PCT == 0.875


def test_base_files_merge_first_relative_to_the_including_file(tmp_path):
    write(tmp_path / 'bases' / 'a.yaml', 'TRAIN:\n  EPOCHS: 10\n  BASE_LR: 1.0e-3\nDATA:\n  BATCH_SIZE: 8\n')
    write(tmp_path / 'bases' / 'b.yaml', 'BASE: [a.yaml]\nTRAIN:\n  EPOCHS: 20\n')
    write(tmp_path / 'other' / 'c.yaml', 'DATA:\n  BATCH_SIZE: 16\n  IMG_SIZE: 64\n')
    child = write(tmp_path / 'run' / 'child.yaml',
                  'BASE: [../bases/b.yaml, ../other/c.yaml]\nDATA:\n  IMG_SIZE: 32\n')
    cfg = load_config(str(child))
    assert cfg.TRAIN.EPOCHS == 20  # b over a
    assert cfg.TRAIN.BASE_LR == 1e-3  # from a, through b
    assert cfg.DATA.BATCH_SIZE == 16  # the later base wins
    assert cfg.DATA.IMG_SIZE == 32  # the child wins
    assert cfg.OUTPUT == 'output/run/child'  # the config's folder and name
    # the configs of one backbone with two attentions ran into one folder, output/deit_tiny, the second refused
    assert {load_config(str(CONFIGS / attention / 'deit_tiny.yaml')).OUTPUT for attention in ('inline', 'softmax')} \
        == {'output/inline/deit_tiny', 'output/softmax/deit_tiny'}
    assert cfg.is_frozen()


def test_opts_override_files_with_typed_values(tmp_path):
    child = write(tmp_path / 'x.yaml', 'TRAIN:\n  EPOCHS: 10\n')
    cfg = load_config(str(child), ['TRAIN.EPOCHS', '3', 'TRAIN.CLIP_GRAD', '1.5', 'AUG.SCALE', '[0.5, 1.0]',
                                   'TRAIN.WEIGHT_DECAY', '0', 'MODEL.KWARGS.depths', '[1, 1]',
                                   'MODEL.KWARGS.attn_type', 'IIIS', 'DATA.DATA_PATH', '/data/imagenet'])
    assert cfg.TRAIN.EPOCHS == 3 and cfg.TRAIN.CLIP_GRAD == 1.5 and cfg.AUG.SCALE == [0.5, 1.0]
    assert cfg.TRAIN.WEIGHT_DECAY == 0.0 and isinstance(cfg.TRAIN.WEIGHT_DECAY, float)
    assert cfg.DATA.DATA_PATH == '/data/imagenet'
    kwargs = model_kwargs(cfg)
    assert kwargs['depths'] == [1, 1] and kwargs['attn_type'] == 'IIIS'
    assert kwargs['img_size'] == 224 and kwargs['num_classes'] == 1000 and kwargs['drop_path_rate'] == 0.1


@pytest.mark.parametrize('text', ['2024', 'None', '1e-3', 'True', '[1, 2]'])
def test_text_keys_keep_text_that_reads_as_another_type(tmp_path, text):
    """A folder named 2024 was refused ('expects a string, got 2024'), from a flag, a file and --opts; written
    quoted through --opts the run trained, and its checkpoint's stored config could not be read back."""
    file = write(tmp_path / 'out.yaml', f'OUTPUT: "{text}"\n')
    for cfg in (load_config(None, overrides={'OUTPUT': text, 'DATA': {'DATA_PATH': text}}),
                load_config(str(file)), load_config(None, ['OUTPUT', text])):
        assert cfg.OUTPUT == text
        assert config_from_yaml_string(cfg.dump()).OUTPUT == text
    assert load_config(None, ['OUTPUT', f"'{text}'"]).OUTPUT == text  # quoted as a Python literal, as yacs takes it


def test_none_turns_clipping_off():
    cfg = load_config(None, ['TRAIN.CLIP_GRAD', '5.0'])
    assert cfg.TRAIN.CLIP_GRAD == 5.0
    cfg = config_from_yaml_string('TRAIN:\n  CLIP_GRAD: None\n')
    assert cfg.TRAIN.CLIP_GRAD is None


@pytest.mark.parametrize('text, words', [
    ('TRAIN:\n  BASE_LRR: 1.0\n', ['unknown config key TRAIN.BASE_LRR', 'did you mean TRAIN.BASE_LR']),
    ('TRAIN:\n  EPOCHS: many\n', ['TRAIN.EPOCHS', 'expects an integer', "'many'"]),
    ('TRAIN:\n  EPOCHS: 2.5\n', ['TRAIN.EPOCHS', 'expects an integer']),
    ('DATA:\n  IMG_SIZE: [224]\n', ['DATA.IMG_SIZE', 'expects an integer']),
    ('TRAIN: 3\n', ['TRAIN is a group of keys']),
    ('AMP:\n  DTYPE: float8\n', ['AMP.DTYPE', "'float8'", "'bfloat16'"]),
    ('DATA:\n  BATCH_SIZE: 0\n', ['DATA.BATCH_SIZE', '> 0']),
    ('SEED: -1\n', ['config key SEED is -1; expected a value >= 0']),
    ('TRAIN:\n  LR_SCHEDULER:\n    DECAY_RATE: .nan\n', ['config key TRAIN.LR_SCHEDULER.DECAY_RATE is nan; expected a '
                                                        'value > 0']),
    # a non-finite mean made every image NaN, reported as a non-finite loss to cure with the learning rate
    ('DATA:\n  MEAN: [.nan, .nan, .nan]\n', ['config key DATA.MEAN is [nan, nan, nan]; expected one or three '
                                             'finite numbers']),
    ('DATA:\n  STD: [.inf]\n', ['config key DATA.STD is [inf]; expected one or three finite numbers']),
    ('DATA:\n  BATCH_SIZE: 7\n', ['DATA.BATCH_SIZE', 'even batch size while mixup']),
    ('TRAIN:\n  CLIP_GRAD: -1.0\n', ['TRAIN.CLIP_GRAD', 'None or a value > 0']),
    ('MODEL:\n  KWARGS:\n    Depth: 3\n', ['MODEL.KWARGS', 'lower-case']),
    ('- a\n- b\n', ['must hold a mapping']),
    ('TRAIN: [unclosed\n', ['not valid YAML']),
    # YAML keeps the last of two equal keys: the first TRAIN block was dropped without a word
    ('TRAIN:\n  EPOCHS: 3\nDATA:\n  BATCH_SIZE: 8\nTRAIN:\n  WARMUP_EPOCHS: 1\n',
     ["is not valid YAML at line 5, column 1: the key 'TRAIN' appears twice in one mapping (the first from line 1)"]),
    ('MODEL:\n  KWARGS:\n    depth: 3\n    depth: 4\n', ["line 4, column 5: the key 'depth' appears twice"]),
])
def test_bad_files_name_the_key_and_the_expectation(tmp_path, text, words):
    path = write(tmp_path / 'bad.yaml', text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    message = str(info.value)
    assert '\n' not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize('opts, message', [
    (['AUG.AUTO_AUGMENT', 'bogus'], "config key AUG.AUTO_AUGMENT is 'bogus'; expected '' (none) or a policy timm's "
                                    "transforms take, e.g. 'rand-m9-mstd0.5-inc1', 'augmix-m5-w3' or 'original', "
                                    "each section after its name a key and a number (RandAugment's 't' a transform set: 'tweights', "
                                    "'t3a', 't3aw')"),
    # timm skips a section without a number: 'incl' trained without the increasing operations, 'foo' as 'rand-m9'
    (['AUG.AUTO_AUGMENT', 'rand-m9-mstd0.5-incl'], "config key AUG.AUTO_AUGMENT is 'rand-m9-mstd0.5-incl'; expected "
                                                   "'' (none) or a policy timm's transforms take, e.g. "
                                                   "'rand-m9-mstd0.5-inc1', 'augmix-m5-w3' or 'original', each "
                                                   "section after its name a key and a number (RandAugment's 't' a "
                                                   "transform set: 'tweights', 't3a', 't3aw')"),
    (['AUG.AUTO_AUGMENT', 'rand-m9-foo'], "config key AUG.AUTO_AUGMENT is 'rand-m9-foo'; expected '' (none) or a "
                                          "policy timm's transforms take, e.g. 'rand-m9-mstd0.5-inc1', 'augmix-m5-w3' "
                                          "or 'original', each section after its name a key and a number "
                                          "(RandAugment's 't' a transform set: 'tweights', 't3a', 't3aw')"),
    (['AUG.AUTO_AUGMENT', 'rand-m9-tfoo'], "config key AUG.AUTO_AUGMENT is 'rand-m9-tfoo'; expected '' (none) or a "
                                           "policy timm's transforms take, e.g. 'rand-m9-mstd0.5-inc1', "
                                           "'augmix-m5-w3' or 'original', each section after its name a key and a "
                                           "number (RandAugment's 't' a transform set: 'tweights', 't3a', 't3aw')"),
    (['AUG.COLOR_JITTER', '-0.5'], "config key AUG.COLOR_JITTER is -0.5; expected a value >= 0"),
    (['AUG.CUTMIX_MINMAX', '[0.2]'], "config key AUG.CUTMIX_MINMAX is [0.2]; expected None or [min, max], cutmix's "
                                     "box side as a share of the image's, 0 < min <= max <= 1"),
    (['AUG.RATIO', '[0.0, 0.0]'], "config key AUG.RATIO is [0.0, 0.0]; expected a range [min, max] with "
                                  "0 < min <= max"),
    (['AUG.SCALE', '[1.0, 0.5]'], "config key AUG.SCALE is [1.0, 0.5]; expected a range [min, max] with "
                                  "0 < min <= max"),
    (['DATA.STD', '[0.0, 1.0, 1.0]'], "config key DATA.STD is [0.0, 1.0, 1.0]; expected standard deviations > 0"),
    (['TRAIN.OPTIMIZER.BETAS', '[0.9, 1.5]'], "config key TRAIN.OPTIMIZER.BETAS is [0.9, 1.5]; expected None (the "
                                              "optimizer's own) or two values in [0, 1) (three for the Adan family)"),
    (['TRAIN.OPTIMIZER.EPS', '-1.0'], "config key TRAIN.OPTIMIZER.EPS is -1.0; expected None (the optimizer's own) or "
                                      "a value >= 0"),
    (['TRAIN.LR_SCHEDULER.DECAY_EPOCHS', '0'], "config key TRAIN.LR_SCHEDULER.DECAY_EPOCHS is 0; expected a value > 0"),
    # torch.manual_seed's 'Overflow when unpacking long long' at the start of training
    (['SEED', str(2 ** 64)], f"config key SEED is {2 ** 64}; expected a value below 2**63"),
    # every rank's 'Python int too large to convert to C int' as the process group started
    (['DIST.TIMEOUT_MIN', '10000000000000'], "config key DIST.TIMEOUT_MIN is 10000000000000; expected at most 525600 "
                                             "(a year)"),
    (['EMA.DECAY', '1.0'], "config key EMA.DECAY is 1.0; expected a value in [0, 1) (at 1 the EMA weights never leave "
                           "their start)"),
    (['MODEL.NUM_CLASSES', '10', 'MODEL.KWARGS.num_classes', '5'],
     "config key MODEL.KWARGS.num_classes is 5 but MODEL.NUM_CLASSES is 10; expected MODEL.NUM_CLASSES 5 alone (the "
     "engine passes it as num_classes)"),
    (['DATA.IMG_SIZE', '16', 'MODEL.KWARGS.img_size', '32'],
     "config key MODEL.KWARGS.img_size is 32 but DATA.IMG_SIZE is 16; expected DATA.IMG_SIZE 32 alone (the engine "
     "passes it as img_size)"),
    (['DATA.IMG_SIZE', '16', 'TEST.CROP_PCT', '100.0'],
     "config key TEST.CROP_PCT is 100.0; expected a value in [1/16, 16]: images are resized to floor(DATA.IMG_SIZE / "
     "TEST.CROP_PCT) before the 16-pixel crop, at most 16 times the crop and at least 1 pixel"),
    (['DATA.IMG_SIZE', '224', 'TEST.CROP_PCT', '0.0001'],
     "config key TEST.CROP_PCT is 0.0001; expected a value in [1/16, 224]: images are resized to floor(DATA.IMG_SIZE "
     "/ TEST.CROP_PCT) before the 224-pixel crop, at most 16 times the crop and at least 1 pixel"),
    (['TRAIN.BASE_LR', '1e999'], "config key TRAIN.BASE_LR is inf; expected a finite value"),
    # a negative rate trained at a negative learning rate, by gradient ascent, without a word; NaN failed later as a
    # non-finite loss (written as YAML's .nan)
    (['TRAIN.LR_SCHEDULER.DECAY_RATE', '-1.0'], "config key TRAIN.LR_SCHEDULER.DECAY_RATE is -1.0; expected a value "
                                                "> 0"),
    # timm's multistep schedule compared the milestones at the first step (a traceback) or decayed out of order
    (['TRAIN.LR_SCHEDULER.MILESTONES', "['a']"], "config key TRAIN.LR_SCHEDULER.MILESTONES is ['a']; expected epochs "
                                                 "> 0 in increasing order, where the multistep schedule decays"),
    (['TRAIN.LR_SCHEDULER.MILESTONES', '[60, 30]'], "config key TRAIN.LR_SCHEDULER.MILESTONES is [60, 30]; expected "
                                                    "epochs > 0 in increasing order, where the multistep schedule "
                                                    "decays"),
    (['MODEL.IMPORTS', "['my-attention']"], "config key MODEL.IMPORTS is ['my-attention']; expected a list of module "
                                            "names, e.g. ['my_attention']"),
    # timm's random erasing draws from range(1, RECOUNT + 1): an empty range at the first image
    (['AUG.RECOUNT', '0'], "config key AUG.RECOUNT is 0; expected a value > 0"),
    (['TRAIN.BACKBONE_LR_SCALE', '0'], "config key TRAIN.BACKBONE_LR_SCALE is 0.0; expected a value > 0"),
])
def test_values_that_would_fail_inside_timm_or_torch_or_contradict_are_named(opts, message):
    """Each was an exception from timm's or torch's own checks (some at the first batch or scheduler step), a
    silent no-op (an EMA that never moves) or a contradiction that failed in the first training step (a classifier
    for 5 classes fed labels of 10)."""
    with pytest.raises(ConfigError) as error:
        load_config(None, opts)
    assert str(error.value) == message


def test_values_that_timm_takes_pass():
    cfg = load_config(None, ['AUG.AUTO_AUGMENT', 'augmix-m5-w3', 'AUG.CUTMIX_MINMAX', '[0.2, 0.8]',
                             'DATA.IMG_SIZE', '16', 'MODEL.KWARGS.img_size', '[16, 16]', 'AUG.COLOR_JITTER', '0.0'])
    assert cfg.AUG.AUTO_AUGMENT == 'augmix-m5-w3' and cfg.MODEL.KWARGS.img_size == [16, 16]
    assert load_config(None, ['AUG.AUTO_AUGMENT', 'original', 'AUG.AUTO_AUGMENT', '']).AUG.AUTO_AUGMENT == ''
    for policy in ('rand-mstd1-tweights', 'rand-m9-n3-t3aw', 'rand-m7-t3a-inc1', 'augmix-m5-w4-d2', 'original-mstd0.5',
                   'v0', '3a'):
        assert load_config(None, ['AUG.AUTO_AUGMENT', policy]).AUG.AUTO_AUGMENT == policy


def test_a_yaml_error_names_its_line_and_a_non_utf8_file_its_byte(tmp_path):
    path = write(tmp_path / 'bad.yaml', 'TRAIN:\n  EPOCHS: 3\n BASE_LR: [1\n')
    with pytest.raises(ConfigError) as error:
        load_config(str(path))
    assert str(error.value) == (f"config file {str(path)!r} is not valid YAML at line 3, column 2: expected <block "
                                f"end>, but found '<block mapping start>' (while parsing a block mapping from line 1)")
    with pytest.raises(ConfigError) as error:
        config_from_yaml_string('TRAIN: [1\n', "checkpoint 'last.pth'")
    assert str(error.value) == ("the config stored in checkpoint 'last.pth' is not valid YAML at line 2, column 1: "
                                "expected ',' or ']', but got '<stream end>' (while parsing a flow sequence from "
                                "line 1)")
    path.write_bytes('TRAIN:\n  EPOCHS: 3  # résumé\n'.encode('latin-1'))
    with pytest.raises(ConfigError) as error:
        load_config(str(path))
    assert str(error.value) == (f"config file {str(path)!r} is not UTF-8 text: byte 0xe9 on line 2 is not valid "
                                f"UTF-8; expected a UTF-8 YAML file")


def test_bad_opts_name_the_key():
    with pytest.raises(ConfigError, match=r'unknown config key DATA\.IMGSIZE in --opts; did you mean DATA\.IMG_SIZE'):
        load_config(None, ['DATA.IMGSIZE', '32'])
    with pytest.raises(ConfigError, match=r"TRAIN\.BASE_LR expects a number, got 'fast' in --opts"):
        load_config(None, ['TRAIN.BASE_LR', 'fast'])
    with pytest.raises(ConfigError, match='odd number'):
        merge_opts(get_default_config(), ['TRAIN.EPOCHS'])
    # a list as the shell leaves it, its names unquoted, was 'expects a list, got '[my_mod]''
    with pytest.raises(ConfigError) as error:
        load_config(None, ['MODEL.IMPORTS', '[my_mod]'])
    assert str(error.value) == ("config key MODEL.IMPORTS expects a list, got '[my_mod]' in --opts, which does not "
                                "read as one; expected a Python literal with its strings quoted, e.g. \"['name']\"")


def test_config_changes_name_each_value_changed_and_each_key_one_side_lacks():
    before = load_config(None, ['TRAIN.EPOCHS', '2', 'MODEL.KWARGS.depth', '4', 'OUTPUT', 'a'])
    after = load_config(None, ['TRAIN.EPOCHS', '4', 'MODEL.KWARGS.mlp_ratio', '2.0', 'OUTPUT', 'b',
                               'AUG.SCALE', '[0.5, 1.0]'])
    assert config_changes(before, after, ignore=['OUTPUT']) == [
        "MODEL.KWARGS.mlp_ratio unset (this run: 2.0)", "TRAIN.EPOCHS 2 (this run: 4)",
        "AUG.SCALE [0.08, 1.0] (this run: [0.5, 1.0])", "MODEL.KWARGS.depth 4 (this run: unset)"]
    assert config_changes(before, before.clone()) == []


@pytest.mark.parametrize('path', [p for p in ALL_YAML if p.parent.name != 'demo'],
                         ids=lambda p: f'{p.parent.name}/{p.stem}')
def test_validation_runs_under_autocast_as_the_official_code_of_the_recipe_does(path):
    """DeiT's, PVT's, Swin's, CSwin's, MultiMax's and SimA's validation runs under autocast when they train with
    it; the InLine / FLatten code validates in float32."""
    cfg = load_config(str(path))
    official_float32 = path.parent.name in ('inline', 'flatten') or path.stem in ('inline', 'flatten',
                                                                                   'inline_flatten')
    assert cfg.AMP.EVAL == (not official_float32)


def test_missing_and_self_including_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file '.*nope\.yaml' does not exist; expected a YAML file$"):
        load_config(str(tmp_path / 'nope.yaml'))
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(repr(str(tmp_path)))} is a folder; expected a "
                                          rf"YAML file \(such as configs/inline/swin_tiny\.yaml\)$"):
        load_config(str(tmp_path))
    with pytest.raises(ConfigError, match=r"^config file '/dev/null' is not a regular file; expected a YAML file$"):
        load_config('/dev/null')
    loop = write(tmp_path / 'loop.yaml', 'BASE: [loop.yaml]\n')
    with pytest.raises(ConfigError, match='includes itself'):
        load_config(str(loop))


def test_dump_round_trip():
    cfg = load_config(str(CONFIGS / 'inline' / 'cswin_base_384.yaml'), ['MODEL.KWARGS.attn_type', 'IISS'])
    again = config_from_yaml_string(cfg.dump())
    assert again == cfg


def test_learning_rates_scale_with_the_total_batch():
    deit = load_config(None, ['DATA.BATCH_SIZE', '256'])
    assert scaled_lrs(deit, 4) == pytest.approx(dict(lr=1e-3, warmup_lr=1e-6, min_lr=1e-5))  # DeiT: lr only
    swin = load_config(None, ['TRAIN.LR_SCALING', 'all', 'DATA.BATCH_SIZE', '64', 'TRAIN.ACCUMULATION_STEPS', '2'])
    assert scaled_lrs(swin, 8) == pytest.approx(dict(lr=1e-3, warmup_lr=2e-6, min_lr=2e-5))
    fixed = load_config(None, ['TRAIN.LR_SCALING', 'none'])
    assert scaled_lrs(fixed, 64) == pytest.approx(dict(lr=5e-4, warmup_lr=1e-6, min_lr=1e-5))


def test_inline_ema_decay_is_rescaled_by_the_total_batch():
    cfg = load_config(str(CONFIGS / 'inline' / 'cswin_tiny.yaml'))
    assert ema_decay(cfg, 8) == pytest.approx(0.9996 ** (1024 / 4096))
    assert round(ema_decay(cfg, 8), 6) == 0.9999  # spec: total batch 1024 -> 0.999900
    cfg = load_config(str(CONFIGS / 'flatten' / 'cswin_base.yaml'))
    assert ema_decay(cfg, 8) == 0.99982  # FLatten uses the decay as given


@pytest.mark.parametrize('path', ALL_YAML, ids=[str(p.relative_to(CONFIGS)) for p in ALL_YAML])
def test_every_shipped_config_loads_and_names_a_registered_model(path):
    cfg = load_config(str(path))
    assert timm.is_model(cfg.MODEL.NAME), f"{path}: MODEL.NAME {cfg.MODEL.NAME!r} is not registered"


OFFICIAL = ['inline_deit_' + s for s in ('tiny', 'small', 'base')] + [
    f'{a}_pvt_{s}' for a in ('inline', 'flatten') for s in ('tiny', 'small', 'medium', 'large')] + [
    f'{a}_{f}_{s}' for a in ('inline', 'flatten') for f in ('swin', 'cswin') for s in ('tiny', 'small', 'base',
                                                                                        'base_384')] + [
    f'flatten_pvt_v2_b{i}' for i in range(5)] + [f'multimax_deit_{s}' for s in ('tiny', 'small', 'base')] + [
    f'sima_{s}_p{p}' for s in ('nano_12', 'tiny_12', 'small_12', 'tiny_24', 'small_24', 'medium_24', 'large_24')
    for p in (16, 8)] + ['sima_deit_small_ls']


@pytest.mark.parametrize('name', OFFICIAL)
def test_one_config_per_official_variant(name):
    attention, rest = name.split('_', 1)
    cfg = load_config(str(CONFIGS / attention / f'{rest}.yaml'))
    assert cfg.MODEL.NAME == name


# Official per-variant recipes (spec inline_flatten.md 5.2, FLatten cfgs/*.yaml): per-GPU batch, image size,
# epochs / warm-up / cool-down, effective lr / warm-up lr / min lr on 8 GPUs, weight decay, clipping, drop path,
# EMA decay per update on 8 GPUs (None: off), evaluation crop.
RECIPES = {
    'inline/deit_tiny': (512, 224, 300, 20, 0, 4e-3, 4e-6, 4e-5, 0.05, 5.0, 0.1, None, 0.875),
    'inline/deit_small': (128, 288, 300, 20, 0, 1e-3, 1e-6, 1e-5, 0.05, 5.0, 0.1, None, 0.875),
    'inline/deit_base': (64, 448, 300, 20, 0, 5e-4, 5e-7, 5e-6, 0.05, 5.0, 0.1, None, 0.875),
    'inline/pvt_tiny': (128, 224, 300, 5, 10, 1e-3, 2e-6, 2e-5, 0.05, None, 0.1, None, 0.875),
    'inline/pvt_small': (128, 224, 300, 5, 10, 1e-3, 2e-6, 2e-5, 0.05, None, 0.1, None, 0.875),
    'inline/pvt_medium': (128, 224, 300, 5, 10, 1e-3, 2e-6, 2e-5, 0.05, 1.0, 0.3, None, 0.875),
    'inline/pvt_large': (64, 224, 300, 5, 10, 5e-4, 1e-6, 1e-5, 0.05, 1.0, 0.3, None, 0.875),
    'inline/swin_tiny': (128, 224, 300, 20, 0, 1e-3, 1e-6, 1e-5, 0.05, 5.0, 0.2, None, 0.875),
    'inline/swin_small': (128, 224, 300, 20, 0, 1e-3, 1e-6, 1e-5, 0.05, 5.0, 0.3, None, 0.875),
    'inline/swin_base': (64, 224, 300, 20, 0, 5e-4, 5e-7, 5e-6, 0.05, 5.0, 0.5, None, 0.875),
    'inline/swin_base_384': (32, 384, 30, 5, 0, 1e-5, 1e-8, 1e-7, 1e-8, 5.0, 0.5, None, 1.0),
    'inline/cswin_tiny': (128, 224, 300, 20, 10, 1e-3, 2e-6, 2e-5, 0.05, None, 0.2, 0.9996 ** 0.25, 0.875),
    'inline/cswin_small': (128, 224, 300, 20, 10, 1e-3, 2e-6, 2e-5, 0.05, None, 0.4, 0.9996 ** 0.25, 0.875),
    'inline/cswin_base': (64, 224, 300, 20, 10, 5e-4, 1e-6, 1e-5, 0.1, None, 0.5, 0.9996 ** 0.125, 0.875),
    'inline/cswin_base_384': (32, 384, 20, 0, 10, 2.5e-6, 2.5e-6, 2.5e-7, 1e-8, None, 0.7, 0.9996 ** 0.0625,
                              0.875),
    'flatten/pvt_tiny': (128, 224, 300, 5, 10, 1e-3, 2e-6, 2e-5, 0.05, None, 0.1, None, 0.875),
    'flatten/pvt_small': (64, 224, 300, 5, 10, 5e-4, 1e-6, 1e-5, 0.05, None, 0.1, None, 0.875),
    'flatten/pvt_medium': (64, 224, 300, 5, 10, 5e-4, 1e-6, 1e-5, 0.05, 1.0, 0.3, None, 0.875),
    'flatten/pvt_large': (32, 224, 300, 5, 10, 2.5e-4, 5e-7, 5e-6, 0.05, 1.0, 0.3, None, 0.875),
    'flatten/pvt_v2_b0': (128, 224, 300, 5, 10, 1e-3, 2e-6, 2e-5, 0.05, None, 0.1, None, 0.875),
    'flatten/pvt_v2_b1': (128, 224, 300, 5, 10, 1e-3, 2e-6, 2e-5, 0.05, None, 0.1, None, 0.875),
    'flatten/pvt_v2_b2': (128, 224, 300, 5, 10, 1e-3, 2e-6, 2e-5, 0.05, None, 0.1, None, 0.875),
    'flatten/pvt_v2_b3': (128, 224, 300, 5, 10, 1e-3, 2e-6, 2e-5, 0.05, 1.0, 0.3, None, 0.875),
    'flatten/pvt_v2_b4': (64, 224, 300, 5, 10, 5e-4, 1e-6, 1e-5, 0.05, 1.0, 0.3, None, 0.875),
    'flatten/swin_tiny': (128, 224, 300, 20, 0, 1e-3, 1e-6, 1e-5, 0.05, 5.0, 0.2, None, 0.875),
    'flatten/swin_small': (128, 224, 300, 20, 0, 1e-3, 1e-6, 1e-5, 0.05, 5.0, 0.3, None, 0.875),
    'flatten/swin_base': (64, 224, 300, 20, 0, 5e-4, 5e-7, 5e-6, 0.05, 5.0, 0.5, None, 0.875),
    'flatten/swin_base_384': (32, 384, 30, 5, 0, 1e-5, 1e-8, 1e-7, 1e-8, 5.0, 0.5, None, 1.0),
    'flatten/cswin_tiny': (256, 224, 300, 20, 10, 2e-3, 4e-6, 4e-5, 0.05, None, 0.2, 0.99984, 0.875),
    'flatten/cswin_small': (128, 224, 300, 20, 10, 1e-3, 2e-6, 2e-5, 0.05, None, 0.4, 0.99984, 0.875),
    'flatten/cswin_base': (64, 224, 300, 20, 10, 5e-4, 1e-6, 1e-5, 0.1, None, 0.5, 0.99982, 0.875),
    'flatten/cswin_base_384': (32, 384, 20, 0, 10, 2.5e-6, 2.5e-6, 2.5e-7, 1e-8, None, 0.7, 0.99982, 0.875),
}


@pytest.mark.parametrize('key', sorted(RECIPES))
def test_official_hyper_parameters(key):
    (batch, img, epochs, warmup, cooldown, lr, warmup_lr, min_lr, wd, clip, dpr, ema, crop_pct) = RECIPES[key]
    cfg = load_config(str(CONFIGS / f'{key}.yaml'))
    assert (cfg.DATA.BATCH_SIZE, cfg.DATA.IMG_SIZE) == (batch, img)
    assert (cfg.TRAIN.EPOCHS, cfg.TRAIN.WARMUP_EPOCHS, cfg.TRAIN.COOLDOWN_EPOCHS) == (epochs, warmup, cooldown)
    assert scaled_lrs(cfg, 8) == pytest.approx(dict(lr=lr, warmup_lr=warmup_lr, min_lr=min_lr), rel=1e-12)
    assert cfg.TRAIN.WEIGHT_DECAY == wd and cfg.TRAIN.CLIP_GRAD == clip and cfg.MODEL.DROP_PATH_RATE == dpr
    assert cfg.EMA.ENABLED == (ema is not None)
    if ema is not None:
        assert math.isclose(ema_decay(cfg, 8), ema, rel_tol=1e-12)
    assert cfg.TEST.CROP_PCT == crop_pct and cfg.TEST.CROP_MODE == 'squash'  # the official square resize
    assert cfg.TRAIN.LR_SCALING == 'all' and cfg.AUG.REPEATED_AUG == 1 and not cfg.TRAIN.LR_SCHEDULER.WARMUP_PREFIX
    assert cfg.AMP.ENABLED == key.startswith('inline/') and not cfg.AMP.EVAL  # InLine trains with --amp


@pytest.mark.parametrize('given, read', [('true', True), ('false', False), ('True', True), ('False', False),
                                         ('FALSE', False)])
def test_opts_take_booleans_as_the_configs_spell_them(given, read):
    """`--opts AMP.ENABLED false` was refused with 'expects true or false, got 'false''."""
    assert load_config(None, ['AMP.ENABLED', given]).AMP.ENABLED is read


def test_a_boolean_key_names_what_it_takes():
    with pytest.raises(ConfigError) as error:
        load_config(None, ['AMP.ENABLED', 'maybe'])
    assert str(error.value) == "config key AMP.ENABLED expects true or false, got 'maybe' in --opts"


def test_model_keywords_are_free_form_at_every_depth(tmp_path):
    """MODEL.KWARGS holds the constructor's keywords: a nested dict (attn_kwargs) set in a base config takes new keys
    from a child config and from --opts, and a keyword takes a value of another type than the one it had (they were
    refused as unknown keys, or as 'expects an integer' / 'expects a string')."""
    base = write(tmp_path / 'base.yaml', "MODEL:\n  NAME: inline_deit_tiny\n  KWARGS:\n    attn_type: sima\n"
                                         "    mlp_ratio: 4\n    attn_kwargs:\n      focusing_factor: 2\n")
    child = write(tmp_path / 'child.yaml', f"BASE: [{base}]\nMODEL:\n  KWARGS:\n    attn_kwargs:\n      causal: true\n")
    cfg = load_config(str(child), ['MODEL.KWARGS.attn_kwargs.kernel_size', '3', 'MODEL.KWARGS.mlp_ratio', '4.5',
                                   'MODEL.KWARGS.attn_type', "['inline', 'softmax']", 'MODEL.KWARGS.qkv_bias', 'false'])
    kwargs = cfg.MODEL.KWARGS
    assert dict(kwargs.attn_kwargs) == dict(focusing_factor=2, causal=True, kernel_size=3)
    assert kwargs.mlp_ratio == 4.5 and kwargs.attn_type == ['inline', 'softmax'] and kwargs.qkv_bias is False


def test_model_keywords_from_opts_alone_are_read_at_every_depth():
    """Without a file that sets attn_kwargs, `--opts MODEL.KWARGS.attn_kwargs.focusing_factor 2` kept the string '2'
    (the model refused it), and a dict literal built the model but failed to be stored in the checkpoint."""
    cfg = load_config(None, ['MODEL.KWARGS.attn_kwargs.focusing_factor', '2', 'MODEL.KWARGS.extra',
                             "{'deep': {'x': 1.5}, 'flag': 'true'}", 'MODEL.KWARGS.extra.deep.y', '[1, 2]'])
    kwargs = cfg.MODEL.KWARGS
    assert kwargs.attn_kwargs.focusing_factor == 2 and isinstance(kwargs.attn_kwargs.focusing_factor, int)
    assert kwargs.extra == {'deep': {'x': 1.5, 'y': [1, 2]}, 'flag': True}
    assert config_from_yaml_string(cfg.dump()).MODEL.KWARGS == kwargs


def test_a_stored_config_from_before_a_key_reads_as_the_engine_trained_then():
    """A checkpoint saved before TRAIN.LR_SCHEDULER.STEP existed was trained stepping every update, and before EPS
    and BETAS defaulted to None it stored AdamW's own 1e-8 and [0.9, 0.999]: resumed under today's DeiT recipe,
    the run names the schedule's change and no optimizer change (it named the optimizer values and not the
    schedule)."""
    today = load_config(str(CONFIGS / 'base' / 'deit.yaml'))
    before = yaml.safe_load(today.dump())
    del before['TRAIN']['LR_SCHEDULER']['STEP'], before['TRAIN']['SYNC_BN'], before['EMA']['SELECTS_BEST']
    del before['AUG']['ERASE_AFTER_MIXUP']
    before['TRAIN']['OPTIMIZER'].update(EPS=1e-8, BETAS=[0.9, 0.999])
    stored = config_from_yaml_string(yaml.safe_dump(before), 'an old checkpoint')
    assert stored.TRAIN.LR_SCHEDULER.STEP == 'update'
    assert config_from_yaml_string(today.dump()).TRAIN.LR_SCHEDULER.STEP == 'previous_epoch'
    assert config_changes(_as_trained(stored), _as_trained(today)) == [
        "TRAIN.LR_SCHEDULER.STEP 'update' (this run: 'previous_epoch')"]
    lion = load_config(str(CONFIGS / 'base' / 'deit.yaml'), ['TRAIN.OPTIMIZER.NAME', 'lion'])
    assert config_changes(_as_trained(stored), _as_trained(lion)) == [
        "TRAIN.LR_SCHEDULER.STEP 'update' (this run: 'previous_epoch')",
        "TRAIN.OPTIMIZER.NAME 'adamw' (this run: 'lion')", "TRAIN.OPTIMIZER.EPS 1e-08 (this run: None)",
        "TRAIN.OPTIMIZER.BETAS [0.9, 0.999] (this run: [0.9, 0.99])"]
