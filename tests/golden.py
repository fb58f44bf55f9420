"""Outputs of the official InLine / FLatten model code on tiny random configs, kept in `tests/data/golden`.

The files are copies of the project's reference vectors (their README says how they were made), so a fresh
clone checks fidelity to the official code without anything beside the repository.
"""
from pathlib import Path
from typing import Any, Dict

import torch

GOLDEN = Path(__file__).resolve().parent / 'data' / 'golden'


def load_golden(name: str) -> Dict[str, Any]:
    """The golden `name` (file stem): `spec`, `state_dict` (official key names), `input`, `output_fp32/64`."""
    return torch.load(GOLDEN / f'{name}.pt', weights_only=True)
