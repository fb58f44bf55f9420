"""Test-wide settings."""
import torch

# The tests run many tiny models; on a small machine intra-op threads cost more than they save.
torch.set_num_threads(1)
