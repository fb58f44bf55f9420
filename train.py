"""Train a registered model: `python train.py --cfg FILE --data-path DIR [--opts KEY VALUE ...]`, or under
`torchrun --nproc_per_node=N train.py ...` on several devices or nodes."""
import sys

from engine.startup import quit_on_interrupt

with quit_on_interrupt():  # while torch and the models load: nothing has started
    from engine.cli import train_main
    from engine.errors import run_cli

if __name__ == '__main__':
    sys.exit(run_cli(train_main))
