"""Untrusted inputs: nothing the package reads can run code (no pickle: weights,
checkpoints and caches go through safetensors, orbax and array_record only; the published .pt
checkpoints of learned rewards through torch.load(weights_only=True), which unpickles tensors and
plain containers only), and the transfer
server listens on the configured interface only (127.0.0.1 by default)."""

import ast
import os
import socket
import time

import pytest

from digen_jax.experiment import config as configlib
from digen_jax.runtime import transfer
from tests.helpers.paths import REPO

SCANNED = ('digen_jax', 'launch', 'benchmarks', 'configs')
_PICKLING_MODULES = {
    'pickle',
    'cPickle',
    '_pickle',
    'dill',
    'cloudpickle',
    'joblib',
    'shelve',
    'marshal',
    'pickletools',
    'copyreg',
}


def pickle_uses(source: str, path: str = '<src>') -> list[str]:
  """Where `source` imports a pickling module, calls torch.load / read_pickle, or passes
  allow_pickle=True (mentions in strings and comments are fine)."""
  found = []
  for node in ast.walk(ast.parse(source, path)):
    if isinstance(node, ast.Import):
      found += [
          f'{path}:{node.lineno}: import {a.name}'
          for a in node.names
          if a.name.split('.')[0] in _PICKLING_MODULES
      ]
    elif (
        isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] in _PICKLING_MODULES
    ):
      found.append(f'{path}:{node.lineno}: from {node.module} import')
    elif isinstance(node, ast.Call):
      f = node.func
      name = f.attr if isinstance(f, ast.Attribute) else getattr(f, 'id', '')
      owner = getattr(f.value, 'id', '') if isinstance(f, ast.Attribute) else ''
      # torch.load only with weights_only=True: PyTorch's restricted unpickler (tensors and
      # plain containers, no code), for the published .pt reward checkpoints (rewards/).
      safe_torch_load = any(
          kw.arg == 'weights_only' and isinstance(kw.value, ast.Constant) and kw.value.value is True
          for kw in node.keywords
      )
      if ((owner, name) == ('torch', 'load') and not safe_torch_load) or name in (
          'read_pickle',
          'to_pickle',
      ):
        found.append(f'{path}:{node.lineno}: {owner + "." if owner else ""}{name}(...)')
      for kw in node.keywords:
        if kw.arg == 'allow_pickle' and not (
            isinstance(kw.value, ast.Constant) and kw.value.value is False
        ):
          found.append(f'{path}:{node.lineno}: allow_pickle={ast.unparse(kw.value)}')
        if kw.arg == 'use_safetensors' and not (
            isinstance(kw.value, ast.Constant) and kw.value.value is True
        ):
          found.append(f'{path}:{node.lineno}: use_safetensors={ast.unparse(kw.value)}')
  return found


def test_the_scanner_finds_pickle():
  src = (
      'import pickle\nfrom dill import loads\nimport torch\nimport numpy as np\n'
      'torch.load("w.bin")\nnp.load("a.npy", allow_pickle=True)\n'
      'torch.load("w.pt", weights_only=False)\ntorch.load("w.pt", weights_only=True)\n'
      'm.from_pretrained(p, use_safetensors=False)\n'
      's = "pickle is not allowed"  # pickle\n'
  )
  assert len(pickle_uses(src)) == 6  # torch.load(weights_only=True) is the one allowed


def test_no_pickle_anywhere_in_the_package():
  found, scanned = [], 0
  for top in SCANNED:
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for name in files:
        if name.endswith('.py'):
          path = os.path.join(root, name)
          with open(path, encoding='utf-8') as f:
            found += pickle_uses(f.read(), os.path.relpath(path, REPO))
          scanned += 1
  assert scanned > 50
  assert not found, found


def test_text_encoder_weights_load_from_safetensors_only():
  """transformers' from_pretrained falls back to pickled .bin weights unless told not to."""
  with open(os.path.join(REPO, 'digen_jax', 'encode_prompts.py'), encoding='utf-8') as f:
    tree = ast.parse(f.read())
  models = [
      n
      for n in ast.walk(tree)
      if isinstance(n, ast.Call)
      and getattr(n.func, 'attr', '') == 'from_pretrained'
      and any(k.arg == 'dtype' for k in n.keywords)
  ]  # the encoder, not its tokenizer
  assert models and all(
      any(k.arg == 'use_safetensors' and k.value.value is True for k in n.keywords) for n in models
  )


def _listening() -> set[str]:
  """'ADDR:PORT' (kernel hex) of this process's listening TCP sockets."""
  inodes = set()
  for fd in os.listdir('/proc/self/fd'):
    try:
      target = os.readlink(f'/proc/self/fd/{fd}')
    except OSError:
      continue
    if target.startswith('socket:['):
      inodes.add(target[8:-1])
  out = set()
  for table in ('/proc/net/tcp', '/proc/net/tcp6'):
    with open(table) as f:
      for line in f.read().splitlines()[1:]:
        parts = line.split()
        if parts[3] == '0A' and parts[9] in inodes:  # 0A: LISTEN
          out.add(parts[1])
  return out


def _new_listeners(before: set[str]) -> set[str]:
  """Listening sockets opened since `before` (the server's threads may open them a moment
  after start returns)."""
  deadline = time.monotonic() + 5.0
  while True:
    new = _listening() - before
    if new or time.monotonic() > deadline:
      return new
    time.sleep(0.05)


def _hex_ipv4(addr: str) -> str:
  return socket.inet_aton(addr)[::-1].hex().upper()


def test_transfer_server_listens_on_the_configured_interface_only():
  assert configlib.base_config().cluster.transfer_host == '127.0.0.1'
  transfer.set_host(configlib.base_config().cluster.transfer_host)
  before = _listening()
  server = transfer.start_server(transfer._transfer_host())  # pylint: disable=protected-access
  new = _new_listeners(before)
  # Its socket address and transport addresses, all on loopback.
  assert new, 'no listening socket found'
  assert all(a.startswith(_hex_ipv4('127.0.0.1') + ':') for a in new), new
  assert server.address().startswith('127.0.0.1:')
  # Another configured address is honoured, not replaced by a default (Linux routes all of
  # 127/8 to loopback, so 127.0.0.2 is bindable anywhere this test runs).
  before = _listening()
  transfer.set_host('127.0.0.2')
  try:
    second = transfer.start_server(transfer._transfer_host())  # pylint: disable=protected-access
  finally:
    transfer.set_host('127.0.0.1')
  new = _new_listeners(before)  # (`second` held: a collected server closes its sockets)
  assert new and all(a.startswith(_hex_ipv4('127.0.0.2') + ':') for a in new), new
  assert second.address().startswith('127.0.0.2:')


@pytest.mark.parametrize('host', ['0.0.0.0', '::', 'localhost:80', 'eth0', ''])
def test_transfer_host_must_name_one_interface(host):
  config = configlib.base_config()
  config.cluster.transfer_host = host
  with pytest.raises(ValueError, match='config.cluster.transfer_host'):
    configlib.check_transfer_host(config.cluster.transfer_host)
