"""An image folder of the first images of each class of the digits demo, for tests whose checks hold at any size."""
import shutil
from pathlib import Path
from typing import Optional


def copy_digits_subset(digits: Path, root: Path, train: Optional[int], val: Optional[int]) -> Path:
    """`root` with the first `train` training and `val` validation images of each class of the `digits` folder
    (None: all of them), in its train/<class>/ and val/<class>/ layout."""
    for split, count in (('train', train), ('val', val)):
        for folder in sorted((digits / split).iterdir()):
            (root / split / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:count]:
                shutil.copy(image, root / split / folder.name / image.name)
    return root
