"""The project's source and wheel distributions, built by the declared build backend from a copy of the checkout:
the sdist holds everything its own tests, the demo and the documented commands read, the wheel the packages with
the kernel's C++ source; and every package the code imports is a declared dependency."""
import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Sequence, Set

import pytest
from setuptools.config.pyprojecttoml import read_configuration

REPO = Path(__file__).resolve().parents[1]
# What a checkout holds beyond the project: version control, CI, environments, build and run outputs, caches.
NOT_THE_PROJECT = {'.git', '.ci', '.gitignore', '.venv', '.ci-venv', 'build', 'dist', 'output', 'data', '.pytest_cache'}
CACHES = shutil.ignore_patterns('__pycache__', '*.pyc', '*.egg-info')


def outside_the_project(folder: str, names: Sequence[str]) -> Set[str]:
    top = NOT_THE_PROJECT if Path(folder) == REPO else set()
    return top.intersection(names) | CACHES(folder, names)


@pytest.fixture(scope='module')
def dists(tmp_path_factory):
    """(the copied checkout, the sdist's files, the wheel's files), paths relative to their roots."""
    tmp = tmp_path_factory.mktemp('packaging')
    source = tmp / 'source'
    shutil.copytree(REPO, source, ignore=outside_the_project)
    # the sdist through the backend's hook (it needs nothing beyond setuptools); the wheel as `pip install .`
    # builds it, in an environment of the declared build requirements (setuptools before 70.1 needs `wheel` too)
    build = "from setuptools import build_meta; import sys; print(build_meta.build_sdist(sys.argv[1]))"
    done = subprocess.run([sys.executable, '-c', build, str(tmp / 'sdist')], cwd=source, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    with tarfile.open(tmp / 'sdist' / done.stdout.split()[-1]) as sdist:
        sdist_files = {name.split('/', 1)[1] for name in sdist.getnames() if '/' in name}
    done = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--quiet', '--no-deps', '--disable-pip-version-check',
                           '--wheel-dir', str(tmp / 'wheel'), str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel_path,) = (tmp / 'wheel').iterdir()
    with zipfile.ZipFile(wheel_path) as wheel:
        wheel_files = set(wheel.namelist())
    return source, sdist_files, wheel_files


def files_under(root: Path, *tops: str) -> Set[str]:
    return {os.path.relpath(os.path.join(folder, name), root) for top in tops
            for folder, _, names in os.walk(root / top) for name in names}


def test_the_sdist_holds_what_its_tests_demo_and_commands_read(dists):
    """The sdist held the test modules but not their conftest, helpers, goldens and fingerprints, nor the configs,
    scripts, train.py and eval.py they run: 21 of its test modules failed to load."""
    source, sdist_files, _ = dists
    wanted = files_under(source, 'models', 'engine', 'tests', 'configs', 'scripts', 'docs') | {
        'train.py', 'eval.py', 'README.md', 'pyproject.toml'}
    assert {'tests/conftest.py', 'tests/data/state_dict_fingerprints.json', 'configs/demo/digits.yaml'} <= wanted
    assert sorted(wanted - sdist_files) == []


def test_the_wheel_holds_the_packages_and_the_kernel_source(dists):
    source, _, wheel_files = dists
    assert files_under(source, 'models', 'engine') <= wheel_files
    assert 'models/attention/csrc/multimax_cpu.cpp' in wheel_files
    assert not {name for name in wheel_files if name.startswith(('tests/', 'configs/', 'scripts/'))}


def distribution_name(requirement: str) -> str:
    """The normalised project name a requirement string starts with ('PyYAML>=6; extra == "x"' -> 'pyyaml')."""
    return re.sub(r'[-_.]+', '-', re.match(r'[A-Za-z0-9._-]+', requirement).group()).lower()


def test_every_package_the_code_imports_is_declared():
    """PyYAML, which the config loader imports, came only through yacs, which declares it without a floor. Every
    import of the packages, the scripts, train.py and eval.py outside the standard library is a dependency or an
    extra's in pyproject.toml (read by setuptools, the build backend)."""
    project = read_configuration(REPO / 'pyproject.toml')['project']
    requirements = project['dependencies'] + [r for extra in project['optional-dependencies'].values() for r in extra]
    declared = {distribution_name(r) for r in requirements}
    sources = [path for top in ('models', 'engine', 'scripts') for path in (REPO / top).rglob('*.py')]
    sources += [REPO / 'train.py', REPO / 'eval.py']
    ours = {'models', 'engine'} | {path.stem for path in (REPO / 'scripts').glob('*.py')}  # scripts import siblings
    providers = importlib.metadata.packages_distributions()
    undeclared = {}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module]
            else:
                continue
            for top in {module.split('.')[0] for module in modules} - ours - set(sys.stdlib_module_names):
                # Python 3.10 maps import names through top_level.txt only, which wheels of some build backends
                # (timm's, safetensors') lack: such a module is taken to come from the distribution of its name
                if not declared & {distribution_name(d) for d in providers.get(top, [top])}:
                    undeclared.setdefault(top, str(path.relative_to(REPO)))
    assert not undeclared, f"imported but not declared (import name: first file): {undeclared}"
