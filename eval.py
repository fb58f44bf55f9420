"""Evaluate a checkpoint: `python eval.py --cfg FILE --checkpoint PATH --data-path DIR`, or `--model NAME` for an
official release; `--throughput` measures images/s. Runs under `torchrun` too."""
import sys

try:
    from engine.cli import eval_main
    from engine.errors import run_cli
except KeyboardInterrupt:  # Ctrl-C while torch and the models load: nothing has started
    sys.exit(130)

if __name__ == '__main__':
    sys.exit(run_cli(eval_main))
