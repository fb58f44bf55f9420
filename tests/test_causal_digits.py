"""The autoregressive example, scripts/causal_digits.py, trains a causal model from the registry."""
import importlib.util
import os

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts', 'causal_digits.py')
spec = importlib.util.spec_from_file_location('scripts_causal_digits', SCRIPT)
causal_digits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(causal_digits)


def test_next_pixel_logits_depend_on_earlier_pixels_only():
    torch.manual_seed(0)
    model = causal_digits.NextPixelModel('additive', dim=16, depth=2, num_heads=2).eval()
    pixels = torch.randint(17, (2, 64))
    changed = pixels.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 17
    with torch.no_grad():
        out, out_changed = model(pixels), model(changed)
    # pixel 40 is predicted from pixels 0..39, so its logits and those before it are unchanged
    assert torch.equal(out[:, :41], out_changed[:, :41])
    assert not torch.equal(out[:, 41:], out_changed[:, 41:])


def test_a_few_steps_lower_the_next_pixel_loss(capsys):
    losses = causal_digits.train('additive', steps=30, batch_size=32, dim=32, depth=1, num_heads=2, log_every=10)
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    out = capsys.readouterr().out
    assert 'step   30' in out and 'held-out loss' in out


@pytest.mark.parametrize('args, message', [
    (['--steps', '0'], '--steps 0: expected 1 or more'),
    (['--batch-size', '0'], '--batch-size 0: expected 1 or more'),
    (['--depth', '0'], '--depth 0: expected 1 or more'),
    (['--num-heads', '0'], '--num-heads 0: expected 1 or more'),
    (['--lr', '-1'], '--lr -1.0: expected a finite positive learning rate'),
    (['--lr', 'inf'], '--lr inf: expected a finite positive learning rate'),
    (['--attn', 'inline'], 'inline attention has no causal form'),
    (['--dim', '10', '--num-heads', '3'], 'additive attention: dim 10 must be a multiple of num_heads 3'),
])
def test_bad_arguments_stop_in_one_line_before_training(args, message, monkeypatch, capsys):
    monkeypatch.setattr(causal_digits, 'train', lambda *a, **k: pytest.fail('trained'))
    with pytest.raises(SystemExit) as stopped:
        causal_digits.main(args)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].split(' error: ', 1)[1].startswith(message)
