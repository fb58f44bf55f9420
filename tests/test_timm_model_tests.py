"""timm's own model tests (`tests/test_models.py` of the installed timm, from its sdist) on a sample of the zoo.

The sdist is downloaded once from the package index into `$XDG_CACHE_HOME/swappable-attention-zoo/timm-sdist`
(as `pip install` fetched timm itself), and its test module runs in a child pytest whose `conftest.py` imports the
zoo and narrows `timm.list_models` / `timm.list_pretrained` to the sample. The zoo's class-token models join timm's
`NON_STD_FILTERS`, as timm counts its own DeiT, XCiT and PiT; the hierarchical ones run as standard models. timm runs
its `forward_intermediates`, `features_only` getter and pruning contracts on the modules it lists in
`FEAT_INTER_FILTERS`; the zoo's modules join that list. Tests that download released weights are left out (the
download path has tests of its own, served locally).
"""
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import timm

REPO = Path(__file__).resolve().parents[1]
# one model of each family and grouping, the class-token ones included; MultiMax's own DeiT (the same body without
# the class token, σ on the logits: tests/test_family_multimax_deit.py) is left out: timm's tests take about 20 s
# on it on a slow CI core
STANDARD = ('inline_pvt_tiny', 'flatten_pvt_v2_b0', 'inline_swin_tiny', 'flatten_cswin_tiny')
NON_STANDARD = ('softmax_deit_tiny', 'softmax_pvt_tiny', 'sima_nano_12_p16')
NON_STANDARD_FILTERS = ("'*_deit_*', 'sima_*_12_p*', 'sima_*_24_p*', "
                        "*[f'{a}_pvt_{s}*' for a in ('softmax', 'multimax', 'sima', 'additive', 'linear') "
                        "for s in 'tsml'],")
ZOO_MODULES = "'vit', 'pvt', 'pvt_v2', 'swin', 'cswin', 'xcit_sima',"
# what every model must pass, and what each kind adds
EVERY_MODEL = ('test_model_forward', 'test_model_backward', 'test_model_forward_fx', 'test_model_backward_fx',
               'test_model_forward_torchscript', 'test_model_forward_fx_torchscript',
               'test_model_forward_intermediates', 'test_model_forward_intermediates_features',
               'test_prune_intermediate_layers_contract')
CONFTEST = f'''import sys
sys.path.insert(0, {str(REPO)!r})
import timm
import timm.models
import models  # noqa: F401  (registers the zoo)

SAMPLE = {set(STANDARD + NON_STANDARD)!r}
_list_models, _list_pretrained = timm.list_models, timm.list_pretrained


def _sample(names):
    return [name for name in names if name.split('.')[0] in SAMPLE]


def list_models(*args, **kwargs):
    return _sample(_list_models(*args, **kwargs))


def list_pretrained(*args, **kwargs):
    return _sample(_list_pretrained(*args, **kwargs))


timm.list_models = timm.models.list_models = list_models
timm.list_pretrained = timm.models.list_pretrained = list_pretrained
'''


def timm_sdist() -> Path:
    """The sdist of the installed timm, downloaded once into the cache."""
    cache = Path(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache') / 'swappable-attention-zoo' / 'timm-sdist'
    sdist = cache / f'timm-{timm.__version__}.tar.gz'
    if not sdist.is_file():
        done = subprocess.run([sys.executable, '-m', 'pip', 'download', f'timm=={timm.__version__}', '--no-deps',
                               '--no-binary', ':all:', '--disable-pip-version-check', '-q', '-d', str(cache)],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and sdist.is_file(), f"cannot download timm's sdist: {done.stderr}"
    return sdist


def test_timm_test_models_passes_on_a_sample_of_the_zoo(tmp_path):
    with tarfile.open(timm_sdist()) as archive:
        source = archive.extractfile(f'timm-{timm.__version__}/tests/test_models.py').read().decode()
    for filters, added in (('NON_STD_FILTERS', NON_STANDARD_FILTERS), ('FEAT_INTER_FILTERS', ZOO_MODULES)):
        assert source.count(f'{filters} = [\n') == 1, filters
        source = source.replace(f'{filters} = [\n', f'{filters} = [\n    {added}\n')
    (tmp_path / 'test_models.py').write_text(source)
    (tmp_path / 'conftest.py').write_text(CONFTEST)
    sample = ' or '.join(STANDARD + NON_STANDARD)
    done = subprocess.run(
        [sys.executable, '-m', 'pytest', 'test_models.py', '-q', '-p', 'no:cacheprovider', '-W', 'ignore',
         '-k', f'not pretrained and ({sample})', f'--junitxml={tmp_path / "report.xml"}'],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:]
    # (test function, model name) pairs, from ids such as 'test_model_backward[2-inline_pvt_tiny]' and, where timm
    # lists the weights' tags, 'test_model_default_cfgs[1-inline_pvt_tiny.in1k]'
    passed = set()
    for case in ElementTree.parse(tmp_path / 'report.xml').iter('testcase'):
        if not any(child.tag in ('failure', 'error', 'skipped') for child in case):
            test, params = case.get('name').rstrip(']').split('[')
            passed |= {(test, param.split('.')[0]) for param in params.split('-')}
    for name in STANDARD + NON_STANDARD:
        kind = 'test_model_default_cfgs' if name in STANDARD else 'test_model_default_cfgs_non_std'
        for test in EVERY_MODEL + (kind,):
            assert (test, name) in passed, (test, name)
