"""The README's "Extending" examples, run as a user would: a new mixer file dropped into `models/attention/` and a
new family module beside the others, in a copy of the package."""
import re
import shutil
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def extending_examples():
    """The Python blocks of the README's Extending section: the attention file, its analysis weights, then the
    family module."""
    text = (ROOT / 'README.md').read_text()
    section = text[text.index('## Extending'):text.index('## Tests and benchmarks')]
    return re.findall(r'```python\n(.*?)```', section, flags=re.S)


def test_the_extending_section_has_an_attention_and_a_family_example():
    attention, weights, family = extending_examples()
    assert attention.startswith('# models/attention/cosine.py') and "@register_attention('cosine')" in attention
    assert weights.startswith('# models/analysis/matrices.py') and '@attention_matrix(CosineMixer)' in weights
    assert 'class PlainViT(ZooModel)' in family and 'register_variants(__name__' in family


CHECK = '''
import torch, timm
import models, models.plainvit
from models.attention import list_attentions
assert 'cosine' in list_attentions(), list_attentions()
swin = timm.create_model('cosine_swin_tiny', temperature=20, img_size=32, embed_dim=16, depths=[2, 1, 1, 1],
                         num_heads=[1, 2, 2, 2], window_size=4, num_classes=3)
mixers = [b.attn.mixer for s in swin.layers for b in s.blocks]
assert all(m.temperature == 20 for m in mixers) and swin.layers[0].blocks[1].attn.shift_size == 2
x = torch.randn(2, 3, 32, 32)
for attn_drop_rate in (0.5, 0.):  # attn_drop_rate drops weights in training (it did nothing), and nothing else does
    dropping = timm.create_model('cosine_swin_tiny', attn_drop_rate=attn_drop_rate, drop_path_rate=0., img_size=32,
                                 embed_dim=16, depths=[2, 1, 1, 1], num_heads=[1, 2, 2, 2], window_size=4)
    assert torch.equal(dropping(x), dropping(x)) == (attn_drop_rate == 0.)
    assert torch.equal(dropping.eval()(x), dropping(x))
assert sorted(timm.list_models('*_plainvit')) == sorted(f'{a}_plainvit' for a in list_attentions())
for name in ('inline_plainvit', 'cosine_plainvit'):
    model = timm.create_model(name)
    out = model(torch.randn(2, 3, 32, 32))
    out.square().mean().backward()
    assert out.shape == (2, 10) and all(p.grad is not None for p in model.parameters())
    assert [f.shape for f in model.forward_intermediates(torch.randn(1, 3, 32, 32), intermediates_only=True)] == [
        (1, 32, 4, 4)]
print('ok')
'''


def test_the_examples_run_as_package_files(tmp_path):
    """The examples in a copy of the package, and the tests that iterate the registry run on the new attention
    there, as they would in the user's clone."""
    attention, weights, family = extending_examples()
    package = tmp_path / 'models'
    shutil.copytree(ROOT / 'models', package, ignore=shutil.ignore_patterns('__pycache__'))
    (package / 'attention' / 'cosine.py').write_text(attention)
    matrices = package / 'analysis' / 'matrices.py'
    matrices.write_text(matrices.read_text() + '\n\n' + weights)
    (package / 'plainvit.py').write_text(family)
    run = subprocess.run([sys.executable, '-c', CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == 'ok', run.stderr[-3000:]
    shutil.copytree(ROOT / 'tests', tmp_path / 'tests', ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(ROOT / 'pyproject.toml', tmp_path)
    run = subprocess.run([sys.executable, '-m', 'pytest', '-v', '-p', 'no:cacheprovider', '-k', 'cosine',
                          'tests/test_analysis.py', 'tests/test_attention_core.py'], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    for case in ('test_analysis.py::test_recorded_matrix_reproduces_the_global_term[cosine-window]',
                 'test_analysis.py::test_recorded_matrix_reproduces_the_global_term[cosine-reduction]',
                 'test_attention_core.py::test_module_gradcheck[cosine]'):
        assert f'{case} PASSED' in run.stdout, run.stdout[-3000:]
