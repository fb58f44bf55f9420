"""A tiny autoregressive model on the digits: next-pixel prediction with causal attention from the registry.

Each 8×8 digit (17 grey levels, 0..16) is read in raster order as 64 tokens; token i is the previous pixel (a start
token for the first) plus a learned position, and the model predicts pixel i from pixels 0..i−1 through pre-norm
blocks whose attention is `build_attention(name, ..., attn_kwargs=dict(causal=True))` in the global grouping.
It prints the training loss falling and, at the end, the held-out loss next to the loss of predicting every
pixel from the grey-level frequencies alone (what a model that ignores the earlier pixels can reach).

    python scripts/causal_digits.py --attn additive --steps 300
"""
import argparse
import math
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.startup import quit_on_interrupt  # noqa: E402

with quit_on_interrupt():  # while torch and the models load: nothing has started
    import torch
    import torch.nn.functional as F
    from torch import Tensor, nn

    from engine.data import DIGITS_SPLIT_SEED, DIGITS_VAL_FRACTION
    from engine.errors import refuse_below, run_cli
    from models.attention import build_attention
    from models.family import Block

LEVELS = 17  # grey levels of the digits
SIDE = 8


class NextPixelModel(nn.Module):
    """Pixels (B, 64) in 0..16 -> logits (B, 64, 17) of each pixel given the pixels before it."""

    def __init__(self, attn: str, dim: int = 64, depth: int = 2, num_heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(LEVELS + 1, dim)  # the last index is the start token
        self.pos_embed = nn.Parameter(torch.zeros(1, SIDE * SIDE, dim))
        nn.init.trunc_normal_(self.pos_embed, std=.02)
        self.blocks = nn.ModuleList([
            Block(dim, build_attention(attn, dim, num_heads, (SIDE, SIDE), attn_kwargs=dict(causal=True)))
            for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, LEVELS)

    def forward(self, pixels: Tensor) -> Tensor:
        previous = F.pad(pixels[:, :-1], (1, 0), value=LEVELS)
        x = self.embed(previous) + self.pos_embed
        for block in self.blocks:
            x = block(x, (SIDE, SIDE))
        return self.head(self.norm(x))


def load_pixels() -> Tuple[Tensor, Tensor]:
    """The digits' (N, 64) grey levels, split into train and held-out images as the digits image folder is."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = torch.as_tensor(digits.images.reshape(len(digits.images), -1), dtype=torch.long)
    train_idx, val_idx = train_test_split(range(len(pixels)), test_size=DIGITS_VAL_FRACTION, stratify=digits.target,
                                          random_state=DIGITS_SPLIT_SEED)
    return pixels[train_idx], pixels[val_idx]


def next_pixel_loss(model: nn.Module, pixels: Tensor) -> Tensor:
    """Mean cross-entropy in nats per pixel."""
    return F.cross_entropy(model(pixels).flatten(0, 1), pixels.flatten())


def frequency_loss(train: Tensor, val: Tensor) -> float:
    """Held-out cross-entropy of predicting every pixel from the training grey-level frequencies."""
    counts = torch.bincount(train.flatten(), minlength=LEVELS).double() + 1
    return -counts.div(counts.sum()).log()[val.flatten()].mean().item()


def train(
        attn: str = 'additive',
        steps: int = 300,
        batch_size: int = 64,
        lr: float = 3e-3,
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 4,
        log_every: int = 25,
        seed: int = 0,
) -> List[float]:
    """Train and print; returns the training loss of every step."""
    torch.manual_seed(seed)
    train_pixels, val_pixels = load_pixels()
    model = NextPixelModel(attn, dim, depth, num_heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    losses: List[float] = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        batch = train_pixels[torch.randint(len(train_pixels), (batch_size,))]
        loss = next_pixel_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % log_every == 0 or step in (1, steps):
            recent = losses[-log_every:]
            print(f"step {step:4d}  loss {sum(recent) / len(recent):.3f} nats/pixel  "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        held_out = next_pixel_loss(model, val_pixels).item()
    print(f"held-out loss {held_out:.3f} nats/pixel; "
          f"grey-level frequencies alone {frequency_loss(train_pixels, val_pixels):.3f}")
    return losses


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--attn', default='additive', help="an attention with a causal form: softmax, multimax, "
                                                           "additive or linear")
    parser.add_argument('--steps', type=int, default=300)
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--lr', type=float, default=3e-3)
    parser.add_argument('--dim', type=int, default=64)
    parser.add_argument('--depth', type=int, default=2)
    parser.add_argument('--num-heads', type=int, default=4)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    refuse_below(parser, {'--steps': (args.steps, 1), '--batch-size': (args.batch_size, 1), '--dim': (args.dim, 1),
                          '--depth': (args.depth, 1), '--num-heads': (args.num_heads, 1)})
    if not 0 < args.lr < math.inf:
        parser.error(f'--lr {args.lr}: expected a finite positive learning rate')
    try:  # the attention's own checks (a causal form, dim a multiple of num_heads) before the digits load
        build_attention(args.attn, args.dim, args.num_heads, (SIDE, SIDE), attn_kwargs=dict(causal=True))
    except ValueError as e:
        parser.error(str(e))
    train(args.attn, args.steps, args.batch_size, args.lr, args.dim, args.depth, args.num_heads, seed=args.seed)


if __name__ == '__main__':
    sys.exit(run_cli(main, terminate_unwinds=True))
