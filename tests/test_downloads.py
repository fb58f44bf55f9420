"""Released weights download into timm's cache atomically, once, under the URL's file name or, for URLs without
one (`/f/<id>/?dl=1`), under the model's name; failures are one line and leave no file. Served offline by an HTTP
server on 127.0.0.1."""
import argparse
import concurrent.futures
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import numpy as np
import pytest
import safetensors.torch
import timm
import timm.models._hub
import torch
from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError
from PIL import Image
from timm.models._registry import _model_pretrained_cfgs

from engine.analysis import load_analysis_model
from engine.cli import eval_main, train_main
from engine.errors import USAGE_EXIT_CODE, run_cli
import models.checkpoint
import models.family
from models.attention import list_attentions
from models.checkpoint import (DOWNLOAD_TIMEOUT_S, CheckpointError, DownloadError, has_released_weights,
                               load_checkpoint_file, load_pretrained_into, released_weights_file)
from models.family import tsinghua_url
from test_scripts import load_script

REPO = Path(__file__).resolve().parents[1]
TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
# The same tiny model as the eval command line builds it: 16x16 digits, 10 classes.
EVAL_TINY = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10)
EVAL_OPTS = ['MODEL.KWARGS.patch_size', '4', 'MODEL.KWARGS.embed_dim', '32', 'MODEL.KWARGS.depth', '2',
             'MODEL.KWARGS.num_heads', '2', 'DEVICE', 'cpu', 'DATA.NUM_WORKERS', '0']


class Server:
    """Files served at `/f/<id>/?dl=1` as the release cloud does, and at any path ending in their name as release
    pages do; `mode` 'ok', '404', 'cut' (the connection closes halfway through the body), 'stall' (half the body,
    then `stalled` is set and the rest waits for `release`), 'together' (half the body, then the rest once a
    second request has received its half), 'cut unannounced' (half the body, no Content-Length) or 'short length'
    (half the body, announced as the whole). Every request path is recorded."""

    def __init__(self) -> None:
        self.files: Dict[str, bytes] = {}
        self.requests: List[str] = []
        self.mode = 'ok'
        self.stalled, self.release = threading.Event(), threading.Event()
        self.halfway = threading.Barrier(2, timeout=30)
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # a stalled client cannot hold the test

            def do_GET(self) -> None:
                server.requests.append(self.path)
                key = self.path.split('/')[2] if self.path.startswith('/f/') else self.path.rsplit('/', 1)[-1]
                body = server.files.get(key)
                if body is None or server.mode == '404':
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header('Content-Type', 'application/octet-stream')
                if server.mode != 'cut unannounced':
                    self.send_header('Content-Length', str(len(body) // 2 if server.mode == 'short length' else
                                                           len(body)))
                self.end_headers()
                self.wfile.write(body if server.mode == 'ok' else body[:len(body) // 2])
                self.wfile.flush()
                if server.mode == 'together':
                    server.halfway.wait()
                    self.wfile.write(body[len(body) // 2:])
                if server.mode == 'stall':
                    server.stalled.set()
                    server.release.wait(timeout=30)
                self.close_connection = True

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
        self.thread.start()

    def url(self, file_id: str) -> str:
        return tsinghua_url(file_id).replace('https://cloud.tsinghua.edu.cn', f'http://127.0.0.1:{self.port}')

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def server() -> Iterator[Server]:
    served = Server()
    yield served
    served.stop()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """torch.hub's checkpoints folder under a TORCH_HOME of the test's own."""
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch'))
    return tmp_path / 'torch' / 'hub' / 'checkpoints'


def official_checkpoint(**model_args) -> Tuple[Dict[str, torch.Tensor], bytes]:
    """A tiny InLine DeiT's weights and the bytes of its checkpoint in the official layout ({'model': ...})."""
    torch.manual_seed(0)
    state_dict = timm.create_model('inline_deit_tiny', **model_args).state_dict()
    buffer = io.BytesIO()
    torch.save({'model': state_dict, 'epoch': 299}, buffer)
    return state_dict, buffer.getvalue()


def register_url(monkeypatch, name: str, url: str) -> None:
    """Point `name`'s registered pretrained cfg at `url` for this test, under its name and its tagged name."""
    cfg = dataclasses.replace(_model_pretrained_cfgs[name], url=url)
    monkeypatch.setitem(_model_pretrained_cfgs, name, cfg)
    monkeypatch.setitem(_model_pretrained_cfgs, f'{name}.{cfg.tag}', cfg)


def assert_weights(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor]) -> None:
    own = model.state_dict()
    assert own.keys() == state_dict.keys()
    for key, value in state_dict.items():
        assert torch.equal(own[key], value), key


class Requested(Exception):
    """Raised instead of downloading, with what would have been downloaded."""


def test_every_release_is_downloaded_by_the_zoo_under_a_real_file_name(monkeypatch):
    def requested(url: str, file_name: str, cache_dir=None) -> str:
        raise Requested(url, file_name)

    monkeypatch.setattr(models.family, 'download_checkpoint', requested)
    released = [name for attn in list_attentions() for name in timm.list_models(f'{attn}_*', pretrained=True)]
    nameless = [name for name in released
                if timm.models.get_pretrained_cfg(name).url.startswith('https://cloud.tsinghua.edu.cn/f/')]
    assert len(nameless) == 20
    for name in released:
        url = timm.models.get_pretrained_cfg(name).url
        with pytest.raises(Requested) as raised:
            timm.create_model(name, pretrained=True)
        # the URL's own file name where it has one, as torch.hub names it, so earlier downloads are reused; else
        # the architecture's name, with or without the weights' tag
        architecture = name.split('.')[0]
        assert raised.value.args == (url, f'{architecture}.pth' if name in nameless else url.rsplit('/', 1)[-1]), name
    assert timm.models.get_pretrained_cfg('softmax_deit_tiny').url.endswith('/deit_tiny_patch16_224-a1311bcf.pth')


def test_registered_url_downloads_once_under_the_model_name(server, cache, monkeypatch, capfd):
    state_dict, server.files['1d6b8191ad6d4114b291'] = official_checkpoint(**TINY)
    register_url(monkeypatch, 'inline_deit_tiny', server.url('1d6b8191ad6d4114b291'))
    model = timm.create_model('inline_deit_tiny', pretrained=True, **TINY)
    assert_weights(model, state_dict)
    assert sorted(p.name for p in cache.iterdir()) == ['inline_deit_tiny.pth']
    assert (cache / 'inline_deit_tiny.pth').read_bytes() == server.files['1d6b8191ad6d4114b291']
    assert server.requests == ['/f/1d6b8191ad6d4114b291/?dl=1']
    assert 'inline_deit_tiny.pth' in capfd.readouterr().err  # the progress bar
    for name in ('inline_deit_tiny', 'inline_deit_tiny.in1k'):  # the same weights with or without their tag
        again = timm.create_model(name, pretrained=True, **TINY)
        assert_weights(again, state_dict)
        # A fine-tuning start by model name reads the same cached file.
        start = timm.create_model('inline_deit_tiny', **TINY)
        report = load_pretrained_into(start, name)
        assert not report.new and not report.dropped
        assert_weights(start, state_dict)
    assert len(server.requests) == 1 and sorted(p.name for p in cache.iterdir()) == ['inline_deit_tiny.pth']


def test_an_overlay_url_has_a_cache_name_of_its_own(server, cache):
    state_dict, server.files['abc123'] = official_checkpoint(**TINY)
    model = timm.create_model('inline_deit_tiny', pretrained=True, **TINY,
                              pretrained_cfg_overlay=dict(url=server.url('abc123')))
    assert_weights(model, state_dict)
    (cached,) = cache.iterdir()
    assert cached.name.startswith('inline_deit_tiny-') and cached.name.endswith('.pth')
    assert model.pretrained_cfg['file'] == str(cached)


def test_a_url_with_a_file_name_downloads_under_it_and_fails_on_one_line(server, cache, monkeypatch):
    state_dict, server.files['deit_tiny_patch16_224-a1311bcf.pth'] = official_checkpoint(**TINY)
    url = f'http://127.0.0.1:{server.port}/deit/deit_tiny_patch16_224-a1311bcf.pth'
    register_url(monkeypatch, 'inline_deit_tiny', url)
    assert_weights(timm.create_model('inline_deit_tiny', pretrained=True, **TINY), state_dict)
    assert [p.name for p in cache.iterdir()] == ['deit_tiny_patch16_224-a1311bcf.pth']
    assert server.requests == ['/deit/deit_tiny_patch16_224-a1311bcf.pth']
    (cache / 'deit_tiny_patch16_224-a1311bcf.pth').unlink()
    server.stop()
    with pytest.raises(DownloadError) as raised:
        timm.create_model('inline_deit_tiny', pretrained=True, **TINY)
    message = str(raised.value)
    assert message.startswith(f'cannot download {url} (host unreachable') and '\n' not in message
    assert 'pretrained_cfg_overlay=dict(file=...)' in message and not list(cache.iterdir())


def test_two_downloads_of_one_release_at_once_each_land_whole(server, cache, monkeypatch):
    """Processes that each call `create_model(pretrained=True)` on a fresh cache (a user's own multi-process
    script) download side by side into files of their own: both halfway at once, then each renames a whole file
    into place, and no partial file stays."""
    state_dict, server.files['1d6b8191ad6d4114b291'] = official_checkpoint(**TINY)
    register_url(monkeypatch, 'inline_deit_tiny', server.url('1d6b8191ad6d4114b291'))
    server.mode = 'together'
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda _: timm.create_model('inline_deit_tiny', pretrained=True, **TINY), range(2)))
    for model in built:
        assert_weights(model, state_dict)
    assert len(server.requests) == 2 and [p.name for p in cache.iterdir()] == ['inline_deit_tiny.pth']
    assert (cache / 'inline_deit_tiny.pth').read_bytes() == server.files['1d6b8191ad6d4114b291']


@pytest.mark.parametrize('failure', ['404', 'closed port', 'cut', 'web page', 'cut unannounced', 'short length',
                                     'zip of something else', 'damaged pickle'])
def test_failures_are_one_line_and_leave_no_file(server, cache, monkeypatch, failure):
    """...also where the server announces no length or a wrong one, or sends a whole file that is no checkpoint:
    such a file was cached, and every later call failed on it."""
    _, server.files['1d6b8191ad6d4114b291'] = official_checkpoint(**TINY)
    url = server.url('1d6b8191ad6d4114b291')
    if failure == 'closed port':
        server.stop()
    elif failure == 'web page':
        server.files['1d6b8191ad6d4114b291'] = b'<!DOCTYPE html><html>sign in</html>'
    elif failure == 'zip of something else':
        archive = io.BytesIO()
        with zipfile.ZipFile(archive, 'w') as z:
            z.writestr('readme.txt', 'weights elsewhere')
        server.files['1d6b8191ad6d4114b291'] = archive.getvalue()
    elif failure == 'damaged pickle':
        server.files['1d6b8191ad6d4114b291'] = b'\x80\x02h\x00.'
    else:
        server.mode = failure
    register_url(monkeypatch, 'inline_deit_tiny', url)
    with pytest.raises(DownloadError) as raised:
        timm.create_model('inline_deit_tiny', pretrained=True, **TINY)
    message = str(raised.value)
    assert '\n' not in message and url in message and 'pretrained_cfg_overlay=dict(file=...)' in message
    assert {'404': 'HTTP 404', 'closed port': 'host unreachable', 'cut': 'connection closed after',
            'web page': 'the file received (35 bytes) is not a checkpoint: it starts with',
            'zip of something else': 'is truncated or corrupt'}.get(failure, 'is truncated or corrupt') in message
    assert not cache.exists() or not list(cache.iterdir())


def test_urls_that_differ_in_their_query_alone_are_cached_apart(server, cache):
    """Two URLs of one path (`.../get?f=a`, `.../get?f=b`) shared the cache file `get`: the second model silently
    loaded the first one's weights."""
    weights = {'a': official_checkpoint(**TINY)[0]}
    weights['b'] = {key: value + 1 for key, value in weights['a'].items()}
    for name, state_dict in weights.items():
        buffer = io.BytesIO()
        torch.save({'model': state_dict}, buffer)
        server.files[f'get?f={name}'] = buffer.getvalue()
    for name in ('a', 'b'):
        url = f'http://127.0.0.1:{server.port}/release/get?f={name}'
        assert_weights(timm.create_model('inline_deit_tiny', pretrained=True, **TINY,
                                         pretrained_cfg_overlay=dict(url=url)), weights[name])
    assert len(list(cache.iterdir())) == 2


def test_a_weights_file_that_does_not_exist_is_named(tmp_path):
    """timm raised FileNotFoundError('') for an overlay `file` that is not there."""
    missing = tmp_path / 'inline_deit_t.pth'
    with pytest.raises(FileNotFoundError) as raised:
        timm.create_model('inline_deit_tiny', pretrained=True, **TINY, pretrained_cfg_overlay=dict(file=str(missing)))
    assert str(raised.value) == (f"[Errno 2] pretrained weights file not found (pretrained_cfg_overlay file=...): "
                                 f"{str(missing)!r}")


@pytest.mark.parametrize('content, problem', [
    (b'', "is not a checkpoint: it is empty; expected a file written by torch.save"),
    (b'hello', "is not a checkpoint: it starts with b'hello'; expected a file written by torch.save"),
    (b'PK\x03\x04 cut short', "is truncated or corrupt"),
])
def test_a_weights_file_that_is_no_checkpoint_is_named_in_one_line(tmp_path, content, problem):
    """timm's reader said EOFError with no message for an empty file and KeyError: 101 for a text file."""
    path = tmp_path / 'weights.pth'
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as raised:
        timm.create_model('inline_deit_tiny', pretrained=True, **TINY, pretrained_cfg_overlay=dict(file=str(path)))
    assert str(raised.value).startswith(f"pretrained weights file {str(path)!r} ")
    assert problem in str(raised.value) and '\n' not in str(raised.value)


def test_a_training_checkpoint_given_as_the_weights_file_loads_its_ema_weights_and_is_kept_on_record(tmp_path):
    state_dict, _ = official_checkpoint(**TINY)
    path = tmp_path / 'checkpoint.pth'
    torch.save({'model': {k: v + 1 for k, v in state_dict.items()}, 'model_ema': state_dict, 'epoch': 3}, path)
    model = timm.create_model('inline_deit_tiny', pretrained=True, **TINY, pretrained_cfg_overlay=dict(file=str(path)))
    assert_weights(model, state_dict)
    assert model.pretrained_cfg['file'] == str(path) and 'state_dict' not in model.pretrained_cfg


def test_a_safetensors_file_downloads_and_loads(server, cache):
    state_dict, _ = official_checkpoint(**TINY)
    server.files['weights.safetensors'] = safetensors.torch.save(state_dict)
    url = f'http://127.0.0.1:{server.port}/release/weights.safetensors'
    model = timm.create_model('inline_deit_tiny', pretrained=True, **TINY, pretrained_cfg_overlay=dict(url=url))
    assert_weights(model, state_dict)
    assert [p.name for p in cache.iterdir()] == ['weights.safetensors']


def test_a_cache_folder_that_cannot_be_written_is_named_as_such(server, tmp_path, monkeypatch):
    """It was reported as a failed download, with the advice to copy the file to a path inside a file."""
    _, server.files['1d6b8191ad6d4114b291'] = official_checkpoint(**TINY)
    register_url(monkeypatch, 'inline_deit_tiny', server.url('1d6b8191ad6d4114b291'))
    (tmp_path / 'a_file').write_text('')
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'a_file' / 'torch'))
    folder = tmp_path / 'a_file' / 'torch' / 'hub' / 'checkpoints'
    with pytest.raises(DownloadError) as raised:
        timm.create_model('inline_deit_tiny', pretrained=True, **TINY)
    message = str(raised.value)
    assert message.startswith(f"cannot write the download folder {str(folder)!r} (NotADirectoryError") and \
        message.endswith("; expected a folder this user can write, with room for the file (TORCH_HOME sets it, or "
                         "cache_dir=)") and '\n' not in message, message
    assert server.requests == []


def test_eval_by_model_name_downloads_the_released_weights(server, cache, monkeypatch, tmp_path, capsys, digits):
    _, served = official_checkpoint(**EVAL_TINY)
    server.files['1d6b8191ad6d4114b291'] = served
    register_url(monkeypatch, 'inline_deit_tiny', server.url('1d6b8191ad6d4114b291'))
    args = ['--data-path', str(digits), '--img-size', '16', '--crop-pct', '1.0', '--opts', *EVAL_OPTS]
    assert eval_main(['--model', 'inline_deit_tiny', *args]) == 0
    downloaded = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert downloaded['checkpoint'] == str(cache / 'inline_deit_tiny.pth') and len(server.requests) == 1
    local = tmp_path / 'local.pth'
    local.write_bytes(served)
    assert eval_main(['--model', 'inline_deit_tiny', '--checkpoint', str(local), *args]) == 0
    given = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: downloaded[k] for k in ('top1', 'top5', 'loss', 'count')} == \
        {k: given[k] for k in ('top1', 'top5', 'loss', 'count')}


# digits_tiny.yaml's model, as its release would hold it: 1000 classes
TRAIN_TINY = dict(img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4)


def test_train_starts_from_the_released_weights_of_a_model_name(server, cache, monkeypatch, tmp_path, capsys, digits):
    """...those `timm.create_model(name, pretrained=True)` takes: of a release that holds model and EMA weights,
    the EMA weights, which the release file copied by hand gives too (it gave its model weights), and the log says
    so."""
    _, _, served = release_with_ema(**TRAIN_TINY)
    server.files['1d6b8191ad6d4114b291'] = served
    register_url(monkeypatch, 'inline_deit_tiny', server.url('1d6b8191ad6d4114b291'))
    local = tmp_path / 'local.pth'
    local.write_bytes(served)
    argv = ['--cfg', str(REPO / 'configs' / 'demo' / 'digits_tiny.yaml'), '--data-path', str(digits),
            '--opts', 'TRAIN.EPOCHS', '1', 'DATA.BATCH_SIZE', '128']
    for start, output in (('inline_deit_tiny', 'by_name'), (str(local), 'by_file')):
        assert run_cli(train_main, ['--pretrained', start, '--output', str(tmp_path / output), *argv]) == 0
        out = capsys.readouterr().out
        assert f'{start}: re-initialised the classifier for 10 classes (the weights have 1000)' in out
    assert f'started from the EMA weights of {local} (MODEL.PRETRAINED_EMA False)' in out
    assert sorted(p.name for p in cache.iterdir()) == ['inline_deit_tiny.pth'] and len(server.requests) == 1
    by_name, by_file = (torch.load(tmp_path / output / 'last.pth', weights_only=True)['model']
                        for output in ('by_name', 'by_file'))
    assert_weights_equal = [torch.equal(by_name[k], by_file[k]) for k in by_file]
    assert by_name.keys() == by_file.keys() and all(assert_weights_equal)


def release_with_ema(**model_args) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor], bytes]:
    """A tiny InLine DeiT's model weights, other EMA weights, and the bytes of a release holding both as the CSWin
    releases do (timm's training checkpoint: 'state_dict', 'state_dict_ema', the run's argparse 'args')."""
    torch.manual_seed(0)
    raw = timm.create_model('inline_deit_tiny', **model_args).state_dict()
    torch.manual_seed(1)
    ema = timm.create_model('inline_deit_tiny', **model_args).state_dict()
    buffer = io.BytesIO()
    torch.save({'epoch': 299, 'arch': 'inline_deit_tiny', 'state_dict': raw, 'state_dict_ema': ema,
                'args': argparse.Namespace(model_ema=True)}, buffer)
    return raw, ema, buffer.getvalue()


def test_a_release_with_ema_weights_gives_them_by_every_path_that_names_the_model_or_its_file(
        server, cache, monkeypatch, tmp_path, capsys, digits):
    """timm reads a pretrained `file` with `load_state_dict(use_ema=True)`, the EMA weights of a file that holds both;
    the same release reached by `url` gave its model weights, and so did eval.py --model, train.py --pretrained
    and load_pretrained_into with the model's name. The CSWin releases are such files, and the CSWin code evaluates
    their EMA weights. The release file copied by hand, the offline route every download error names, gave its
    model weights to `--checkpoint FILE` and `load_pretrained_into(model, FILE)`: it gives its download's now."""
    raw, ema, served = release_with_ema(**EVAL_TINY)
    server.files['1d6b8191ad6d4114b291'] = served
    register_url(monkeypatch, 'inline_deit_tiny', server.url('1d6b8191ad6d4114b291'))
    local = tmp_path / 'release.pth'
    local.write_bytes(served)
    for overlay in ({}, {'file': str(local)}):  # the release's 10 classes kept: timm keeps a cfg's class count
        assert_weights(timm.create_model('inline_deit_tiny', pretrained=True, **EVAL_TINY,
                                         pretrained_cfg_overlay=dict(overlay, num_classes=10)), ema)
    started = timm.create_model('inline_deit_tiny', **EVAL_TINY)
    load_pretrained_into(started, 'inline_deit_tiny')
    assert_weights(started, ema)
    started.load_state_dict(raw)
    load_pretrained_into(started, str(local))
    assert_weights(started, ema)

    args = ['--data-path', str(digits), '--img-size', '16', '--crop-pct', '1.0', '--opts', *EVAL_OPTS]
    results = {}
    for label, given in (('by name', []), ('file', ['--checkpoint', str(local)]),
                         ('file --ema', ['--checkpoint', str(local), '--ema'])):
        assert eval_main(['--model', 'inline_deit_tiny', *given, *args]) == 0
        results[label] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [results[label]['weights'] for label in results] == ['ema', 'ema', 'ema']
    assert results['by name']['loss'] == results['file']['loss'] == results['file --ema']['loss']


@pytest.mark.parametrize('entry', ['create_model', 'eval.py', 'train.py'])
def test_a_signal_mid_download_stops_with_the_signal_and_leaves_no_file(server, cache, monkeypatch, tmp_path, capsys,
                                                                         digits, entry):
    _, server.files['1d6b8191ad6d4114b291'] = official_checkpoint(**TRAIN_TINY)
    register_url(monkeypatch, 'inline_deit_tiny', server.url('1d6b8191ad6d4114b291'))
    server.mode = 'stall'

    def interrupt() -> None:  # Ctrl-C once half the file has arrived
        if server.stalled.wait(timeout=60):
            os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C as a terminal delivers it, also where the tests run with SIGINT ignored (a job started in the
    # background without job control)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        if entry == 'create_model':
            with pytest.raises(KeyboardInterrupt):
                timm.create_model('inline_deit_tiny', pretrained=True, **TRAIN_TINY)
        elif entry == 'eval.py':
            assert run_cli(eval_main, ['--model', 'inline_deit_tiny', '--data-path', str(digits), '--img-size', '16',
                                       '--opts', *EVAL_OPTS]) == 128 + signal.SIGINT
        else:
            assert run_cli(train_main, [
                '--cfg', str(REPO / 'configs' / 'demo' / 'digits_tiny.yaml'), '--data-path', str(digits),
                '--pretrained', 'inline_deit_tiny', '--output', str(tmp_path / 'run')]) == 128 + signal.SIGINT
    finally:
        server.release.set()
        signal.signal(signal.SIGINT, previous)
    assert server.stalled.is_set() and not list(cache.iterdir())
    if entry != 'create_model':
        assert capsys.readouterr().err.splitlines()[-1] == 'error: interrupted by SIGINT'
    server.mode = 'ok'
    timm.create_model('inline_deit_tiny', pretrained=True, **TRAIN_TINY)
    assert [p.name for p in cache.iterdir()] == ['inline_deit_tiny.pth']


# A process that downloads the tiny model's weights from URL, as `timm.create_model(pretrained=True)` does.
DOWNLOADER = """
import dataclasses, sys
import timm
from timm.models._registry import _model_pretrained_cfgs
import models
cfg = dataclasses.replace(_model_pretrained_cfgs['inline_deit_tiny'], url=sys.argv[1])
_model_pretrained_cfgs['inline_deit_tiny'] = _model_pretrained_cfgs[f'inline_deit_tiny.{cfg.tag}'] = cfg
timm.create_model('inline_deit_tiny', pretrained=True, img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4)
"""


def test_a_download_killed_by_sigterm_leaves_a_partial_file_a_later_download_removes(server, cache, tmp_path,
                                                                                      monkeypatch):
    _, server.files['1d6b8191ad6d4114b291'] = official_checkpoint(**TRAIN_TINY)
    url = server.url('1d6b8191ad6d4114b291')
    server.mode = 'stall'
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCH_HOME=str(tmp_path / 'torch'))
    child = subprocess.Popen([sys.executable, '-c', DOWNLOADER, url], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert server.stalled.wait(timeout=120), child.stderr.read() if child.poll() is not None else 'no request'
        deadline = time.monotonic() + 60
        while not (cache.is_dir() and any(cache.iterdir())):  # half the file written
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.01)
        child.send_signal(signal.SIGTERM)  # as a scheduler ends a job: no Python clean-up runs
        child.communicate(timeout=60)
    finally:
        server.release.set()
        child.kill()
    left = [p.name for p in cache.iterdir()]
    assert child.returncode == -signal.SIGTERM and len(left) == 1 and left[0].endswith('.partial')
    # the killed download's file, unchanged for ten read timeouts, goes
    stale = time.time() - 10 * DOWNLOAD_TIMEOUT_S - 1
    os.utime(cache / left[0], (stale, stale))
    # partial files of a live process of this host, of another host sharing the folder, and of a PID this process
    # cannot see but still written (a writer in another PID namespace: a container sharing the host's name and the
    # folder, whose live download another container's clean-up removed) are not touched
    kept = [f'inline_deit_tiny.pth.{socket.gethostname()}.{os.getpid()}.0123abcd.partial',
            f'inline_deit_tiny.pth.another-host.{child.pid}.0123abcd.partial',
            f'inline_deit_tiny.pth.{socket.gethostname()}.{child.pid}.4567cdef.partial']
    for name in kept:
        (cache / name).write_bytes(b'half')
    server.mode = 'ok'
    register_url(monkeypatch, 'inline_deit_tiny', url)  # the later download, in this process: as DOWNLOADER's
    timm.create_model('inline_deit_tiny', pretrained=True, **TRAIN_TINY)
    assert sorted(p.name for p in cache.iterdir()) == sorted(kept + ['inline_deit_tiny.pth'])


EXPECTED_START = ("expected a checkpoint file, the name of a model with released weights, or 'local-dir:FOLDER' / "
                  "'hf-hub:REPO' of a model saved by timm.models.save_for_hf")


@pytest.mark.parametrize('start, message', [
    ('inline_deit_tinyy', "MODEL.PRETRAINED 'inline_deit_tinyy' is neither a file nor a registered model name; "
                          f"{EXPECTED_START}; did you mean inline_deit_tiny, inline_pvt_tiny?"),
    ('missing/best.pth', "MODEL.PRETRAINED 'missing/best.pth' is neither a file nor a registered model name; "
                         f"{EXPECTED_START}"),
    ('linear_deit_tiny', f"MODEL.PRETRAINED 'linear_deit_tiny' has no released weights; {EXPECTED_START}"),
    ('local-dir:missing', "MODEL.PRETRAINED 'local-dir:missing': 'missing' is not a folder; expected one written by "
                          "timm.models.save_for_hf"),
    ('local-dir:empty', "MODEL.PRETRAINED 'local-dir:empty': the folder holds no weights; expected model.safetensors "
                        "or pytorch_model.bin (the files timm.models.save_for_hf writes), or a .safetensors / .pth / "
                        ".pth.tar / .bin file"),
])
def test_a_start_that_is_neither_a_file_nor_a_release_fails_before_any_data_is_read(tmp_path, capsys, monkeypatch,
                                                                                    start, message):
    (tmp_path / 'empty').mkdir()
    monkeypatch.chdir(tmp_path)
    status = run_cli(train_main, ['--cfg', str(REPO / 'configs' / 'demo' / 'digits_tiny.yaml'), '--pretrained', start,
                                  '--data-path', str(tmp_path / 'no_data'), '--output', str(tmp_path / 'run'),
                                  '--opts', 'DATA.DATASET', 'imagefolder'])
    assert (status, capsys.readouterr().err) == (USAGE_EXIT_CODE, f"error: {message}\n")
    assert not (tmp_path / 'run').exists()


def test_eval_reports_an_unreachable_host_on_one_line(server, cache, monkeypatch, tmp_path, capsys, digits):
    url = server.url('1d6b8191ad6d4114b291')
    server.stop()
    register_url(monkeypatch, 'inline_deit_tiny', url)
    # the data (digits) is checked before the download
    status = run_cli(eval_main, ['--model', 'inline_deit_tiny', '--data-path', str(digits), '--opts', *EVAL_OPTS])
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith('error: cannot download ' + url) and '\n' not in err
    assert not cache.exists() or not list(cache.iterdir())


def test_eval_py_reads_a_file_copied_to_the_cache_path_without_network(tmp_path, monkeypatch, capsys, digits):
    """The offline recipe of the README, through eval.py's command line: the released file copied to the cache path
    is evaluated by model name, and the release host is never asked (nothing may open a URL here)."""
    cache = tmp_path / 'torch' / 'hub' / 'checkpoints'
    cache.mkdir(parents=True)
    _, served = official_checkpoint(**EVAL_TINY)
    (cache / 'inline_deit_tiny.pth').write_bytes(served)
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch'))
    monkeypatch.setattr(urllib.request, 'urlopen', lambda *args, **kwargs: pytest.fail('the release host was asked'))
    assert run_cli(eval_main, ['--model', 'inline_deit_tiny', '--data-path', str(digits), '--img-size', '16',
                               '--crop-pct', '1.0', '--opts', *EVAL_OPTS]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result['checkpoint'] == str(cache / 'inline_deit_tiny.pth') and result['count'] > 0
    assert sorted(p.name for p in cache.iterdir()) == ['inline_deit_tiny.pth']


class FakeHub:
    """timm's hub download, served from a folder per repository; records what was asked for."""

    def __init__(self, root: Path, offline: bool = False):
        self.root, self.offline, self.fetched = root, offline, []

    def __call__(self, repo_id, filename, revision=None, **kwargs) -> str:
        self.fetched.append((repo_id, filename))
        if self.offline:
            raise LocalEntryNotFoundError('the file is not in the cache and outgoing traffic is disabled')
        path = self.root / repo_id / filename
        if not path.is_file():
            raise EntryNotFoundError(f'{filename} is not in {repo_id}')
        return str(path)


def test_timm_s_own_weights_come_from_its_hub_repository_as_timm_loads_them(tmp_path, monkeypatch):
    """A timm model whose weights live on the hub only (PVTv2-B0) starts a PVTv2 of another attention, from the file
    `timm.create_model(name, pretrained=True)` reads; its original URL, where there is one, is not asked."""
    torch.manual_seed(0)
    served = timm.create_model('pvt_v2_b0').state_dict()
    (tmp_path / 'timm' / 'pvt_v2_b0.in1k').mkdir(parents=True)
    safetensors.torch.save_file(served, tmp_path / 'timm' / 'pvt_v2_b0.in1k' / 'model.safetensors')
    hub = FakeHub(tmp_path)
    monkeypatch.setattr(timm.models._hub, 'hf_hub_download', hub)
    by_timm = timm.create_model('pvt_v2_b0', pretrained=True).state_dict()
    assert all(torch.equal(by_timm[k], served[k]) for k in served)
    assert has_released_weights('pvt_v2_b0')
    hub.fetched.clear()
    assert released_weights_file('pvt_v2_b0') == str(tmp_path / 'timm' / 'pvt_v2_b0.in1k' / 'model.safetensors')
    assert hub.fetched == [('timm/pvt_v2_b0.in1k', 'model.safetensors')]
    model = timm.create_model('inline_pvt_v2_b0')
    report = load_pretrained_into(model, 'pvt_v2_b0')
    assert len(report.loaded) == 154 and any('.residual.' in k for k in report.new)
    assert torch.equal(model.state_dict()['block1.0.attn.q.weight'], served['stages.0.blocks.0.attn.q.weight'])
    # a URL in the cfg too (DeiT): the hub still wins, as in timm, and the URL is never requested
    monkeypatch.setattr(models.checkpoint, 'download_checkpoint', lambda *args: pytest.fail('downloaded the URL'))
    with pytest.raises(CheckpointError, match=r"^the released weights of 'deit_tiny_patch16_224' \(hub repository "
                                              r"'timm/deit_tiny_patch16_224\.fb_in1k'\): the repository holds no "
                                              r"weights; expected model\.safetensors or pytorch_model\.bin$"):
        released_weights_file('deit_tiny_patch16_224')


def test_a_release_on_the_hub_under_its_own_file_name_is_read_as_timm_reads_it(tmp_path, monkeypatch):
    """A registered cfg naming a hub repository and a `.bin` file: the files asked for, and their order (the
    safetensors alternative first), are those of timm's own hub loader."""
    cfg = dataclasses.replace(_model_pretrained_cfgs['inline_deit_tiny'], hf_hub_id='lab/inline-deit-tiny',
                              hf_hub_filename='inline_deit_t.bin')
    monkeypatch.setitem(_model_pretrained_cfgs, 'inline_deit_tiny', cfg)
    monkeypatch.setitem(_model_pretrained_cfgs, f'inline_deit_tiny.{cfg.tag}', cfg)
    monkeypatch.setattr(models.checkpoint, 'download_checkpoint', lambda *args: pytest.fail('downloaded the URL'))
    (tmp_path / 'lab' / 'inline-deit-tiny').mkdir(parents=True)
    torch.save({'marker': torch.ones(1)}, tmp_path / 'lab' / 'inline-deit-tiny' / 'inline_deit_t.bin')
    hub = FakeHub(tmp_path)
    monkeypatch.setattr(timm.models._hub, 'hf_hub_download', hub)
    timm.models._hub.load_state_dict_from_hf('lab/inline-deit-tiny', 'inline_deit_t.bin')
    by_timm, hub.fetched = hub.fetched, []
    assert released_weights_file('inline_deit_tiny') == str(tmp_path / 'lab' / 'inline-deit-tiny' / 'inline_deit_t.bin')
    assert hub.fetched == by_timm == [('lab/inline-deit-tiny', 'inline_deit_t.safetensors'),
                                      ('lab/inline-deit-tiny', 'inline_deit_t.bin')]


def test_a_timm_model_s_hub_weights_offline_are_one_line(tmp_path, monkeypatch, capsys, digits):
    monkeypatch.setattr(timm.models._hub, 'hf_hub_download', FakeHub(tmp_path, offline=True))
    status = run_cli(train_main, ['--cfg', str(REPO / 'configs' / 'demo' / 'digits_tiny.yaml'), '--pretrained',
                                  'deit_tiny_patch16_224', '--data-path', str(digits), '--output', str(tmp_path / 'run')])
    err = capsys.readouterr().err.splitlines()[-1]
    assert status == USAGE_EXIT_CODE
    assert err == ("error: the released weights of 'deit_tiny_patch16_224' (hub repository "
                   "'timm/deit_tiny_patch16_224.fb_in1k'): model.safetensors cannot be downloaded "
                   "(LocalEntryNotFoundError: the file is not in the cache and outgoing traffic is disabled); without "
                   "network access, download it where you can and give the file (eval.py: --checkpoint FILE, "
                   "train.py: --pretrained FILE)")


def test_the_analysis_scripts_draw_the_released_weights_with_pretrained(server, cache, monkeypatch, tmp_path):
    """`visualize_attention.py` / `attention_stats.py --pretrained`: the release downloaded once into the cache, and
    the weights drawn are the released ones."""
    state_dict, served = official_checkpoint(**EVAL_TINY)
    server.files['1d6b8191ad6d4114b291'] = served
    register_url(monkeypatch, 'inline_deit_tiny', server.url('1d6b8191ad6d4114b291'))
    opts = ['DATA.IMG_SIZE', '16', *EVAL_OPTS]
    model, cfg = load_analysis_model('inline_deit_tiny', None, opts, pretrained=True)
    assert_weights(model, state_dict)
    assert cfg.MODEL.NUM_CLASSES == 10
    image = tmp_path / 'digit.png'
    Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), mode='L').save(image)
    assert run_cli(load_script('visualize_attention').main,
                   ['--model', 'inline_deit_tiny', '--pretrained', '--image', str(image), '--out',
                    str(tmp_path / 'figures'), '--opts', *opts]) == 0
    assert run_cli(load_script('attention_stats').main,
                   ['--models', 'inline_deit_tiny', '--pretrained', '--data', str(image), '--out',
                    str(tmp_path / 'stats'), '--opts', *opts]) == 0
    assert len(server.requests) == 1 and os.listdir(tmp_path / 'figures')
    assert (tmp_path / 'stats.csv').read_text().count('inline_deit_tiny') == 2 * 2  # a row per layer and head


def test_a_damaged_file_in_the_download_cache_says_that_deleting_it_downloads_it_again(server, cache, monkeypatch,
                                                                                     tmp_path):
    """The zoo's downloads never leave a damaged file, but one copied into the cache by hand (as the offline route
    suggests) or left by another tool failed at every use with no word of where it lay or how to get past it."""
    _, served = official_checkpoint(**EVAL_TINY)
    server.files['1d6b8191ad6d4114b291'] = served
    register_url(monkeypatch, 'inline_deit_tiny', server.url('1d6b8191ad6d4114b291'))
    cache.mkdir(parents=True)
    cached = cache / 'inline_deit_tiny.pth'
    elsewhere = tmp_path / 'inline_deit_tiny.pth'
    for damaged in (b'', served[:len(served) // 2]):
        for path in (cached, elsewhere):
            path.write_bytes(damaged)
        with pytest.raises(CheckpointError) as raised:
            timm.create_model('inline_deit_tiny', pretrained=True, **EVAL_TINY)
        assert str(raised.value).startswith(f"pretrained weights file {str(cached)!r} ")
        assert str(raised.value).endswith('; it is in the download cache: delete it, and the next use downloads it '
                                          'again')
        with pytest.raises(CheckpointError) as raised:
            load_checkpoint_file(str(elsewhere))
        assert 'download cache' not in str(raised.value)
    cached.unlink()
    timm.create_model('inline_deit_tiny', pretrained=True, **EVAL_TINY)
    assert cached.read_bytes() == served and len(server.requests) == 1
