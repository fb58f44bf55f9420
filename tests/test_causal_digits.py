"""The autoregressive example, scripts/causal_digits.py, trains a causal model from the registry."""
import importlib.util
import os

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
