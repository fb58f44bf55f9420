"""Plain float64 reference formulas shared by the attention tests (written out, no project code)."""
import torch

# The MultiMax parameters of the spec's test vector.
SPEC_RANGES = (0.1, 0.2, -0.3, 0.4)
SPEC_TS = (0.5, 0.3, 0.2, 0.1)


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def dense(x, layer):
    return x @ layer.weight.T + layer.bias


def naive_softmax(s):
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def naive_sigma(x, ranges, ts):
    b, t = ranges.detach().tolist(), ts.detach().tolist()
    return (x + t[0] * (b[0] - x).clamp(min=0) + t[1] * (x - b[1]).clamp(min=0)
            + t[2] * (b[2] - x).clamp(min=0) ** 2 + t[3] * (x - b[3]).clamp(min=0) ** 2)


def naive_l1(x):
    """Every channel divided by the sum of its absolute values over the tokens (dim -2), clamped at 1e-12."""
    return x / x.abs().sum(dim=-2, keepdim=True).clamp(min=1e-12)


def later_keys(n):
    """(n, n) bool, True where key j comes after query i: the entries a causal attention masks out."""
    return torch.ones(n, n, dtype=torch.bool).triu(1)


def naive_causal_softmax(s):
    """Row-wise softmax of (..., n, n) scores over the keys j ≤ i of row i."""
    return naive_softmax(s.masked_fill(later_keys(s.shape[-1]), float('-inf')))
