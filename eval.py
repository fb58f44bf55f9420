"""Evaluate a checkpoint: `python eval.py --cfg FILE --checkpoint PATH --data-path DIR`, or `--model NAME` for an
official release; `--throughput` measures images/s. Runs under `torchrun` too."""
import sys

from engine.startup import quit_on_interrupt

with quit_on_interrupt():  # while torch and the models load: nothing has started
    from engine.cli import eval_main
    from engine.errors import run_cli

if __name__ == '__main__':
    sys.exit(run_cli(eval_main))
