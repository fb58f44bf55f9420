"""Train a registered model: `python train.py --cfg FILE --data-path DIR [--opts KEY VALUE ...]`, or under
`torchrun --nproc_per_node=N train.py ...` on several devices or nodes."""
import sys

try:
    from engine.cli import train_main
    from engine.errors import run_cli
except KeyboardInterrupt:  # Ctrl-C while torch and the models load: nothing has started
    sys.exit(130)

if __name__ == '__main__':
    sys.exit(run_cli(train_main))
