"""Moving pytrees of jax arrays onto other devices: within a process and across processes.

In one process a plain `jax.device_put` onto the other mesh's shardings moves a tree
(runtime/links.py's LocalLink). Across processes (trainer and rollout in separate jax.distributed processes): a `Channel` to a
peer process, built on `jax.experimental.transfer`:

  sender:    Channel(peer=1).send(params, 'weights')                 # non-blocking
  receiver:  Channel(peer=0).receive(abstract_params, 'weights')    # leaves: ShapeDtypeStruct
                                                                     # with .sharding on local devices

The n-th `send` of a tag pairs with the n-th `receive` of that tag on the other side, so a tag
such as 'weights' can be reused every step. `send` hands the arrays to this process's transfer
server (`await_pull`) and posts a small JSON description (pull id, shapes, dtypes, which slice of
each array every piece holds) in the jax.distributed key-value store; `receive` reads it, pulls
every piece straight onto one of its own devices and lays the result out on the requested
shardings with device-to-device copies only (never through host numpy).

Why pieces: the transfer engine copies raw per-device buffers, so the receiver must ask for
exactly the sender's shard shapes, in the sender's order; asking for another layout either fails
or, when byte sizes happen to match, silently returns scrambled data. Pulling each sender shard
as its own single-device array and re-laying it out locally makes any sender layout and any
receiver layout (other device count, other partition spec) correct. When the requested layout
uses exactly the sender's slices (same FSDP spec and shard count, or replicated to replicated),
every piece lands directly on its device and nothing is copied again.

Quirks of jax 0.10.2 seen here (CPU, gloo): the transfer server must be started with an explicit
socket address *and* transport addresses (the defaults, '[::]:0' and none, make pulls fail with
"SocketServer: Connection closed" and abort the peer); a failed pull kills the process
(CHECK failure), so every mismatch is caught as a ValueError before pulling. Never use plain
`jax.device_put` across processes: it hangs on CPU.

Do not donate or delete sent arrays before `wait_delivered` returns for that send.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import ipaddress
import itertools
import json
import socket
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import transfer as jax_transfer
from jax.sharding import Sharding, SingleDeviceSharding

from digen_jax.experiment import validation
from digen_jax.runtime import distributed

_KV_PREFIX = 'digen/xfer'
DEFAULT_HOST = '127.0.0.1'


# ------------------------------------------------------------------------------------------
# Layouts and casts


def _cast_dtype(dtype) -> np.dtype | None:
  if dtype is None:
    return None
  dt = jnp.dtype(dtype)
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(
        f'dtype={dt} must be a floating dtype (e.g. jnp.bfloat16); integer leaves '
        'are never cast.'
    )
  return dt


def _flat_shardings(target_shardings, treedef, what: str) -> list[Sharding]:
  if isinstance(target_shardings, Sharding):
    return [target_shardings] * treedef.num_leaves
  flat, sdef = jax.tree.flatten(target_shardings, is_leaf=lambda s: isinstance(s, Sharding))
  if sdef != treedef:
    raise ValueError(
        f'{what}: the sharding tree {sdef} does not match the array tree {treedef}; '
        'pass one Sharding per leaf (same structure) or a single Sharding for all.'
    )
  for s in flat:
    if not isinstance(s, Sharding):
      raise ValueError(f'{what}: {s!r} is not a jax.sharding.Sharding.')
  return flat


def abstract(tree, shardings=None, dtype=None):
  """ShapeDtypeStruct tree for `Channel.receive`: shapes of `tree` (arrays or ShapeDtypeStructs),
  `shardings` (one Sharding, or one per leaf; default: each leaf's own), floating leaves cast to
  `dtype` when given."""
  dt = _cast_dtype(dtype)
  leaves, treedef = jax.tree.flatten(tree)
  if shardings is None:
    flat_s = [x.sharding for x in leaves]
  else:
    flat_s = _flat_shardings(shardings, treedef, 'abstract')
  out = []
  for x, s in zip(leaves, flat_s):
    d = dt if dt is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
    out.append(jax.ShapeDtypeStruct(x.shape, d, sharding=s))
  return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------------------------------
# Transfer server (one per process) and its address in the KV store

_server = None
_connections: dict[int, Any] = {}
_pull_ids = itertools.count(1)
_host = DEFAULT_HOST  # config.cluster.transfer_host (set_host)


def set_host(host: str) -> None:
  """The interface this process's transfer server binds (before it starts: the first Channel)."""
  global _host
  _host = validation.check_transfer_host(host)


def _transfer_host() -> str:
  """The one interface this process's transfer server binds, and peers reach it on."""
  host = socket.gethostbyname(socket.gethostname()) if _host == 'hostname' else _host
  coordinator = distributed.process_info().coordinator_address or ''
  if (
      ipaddress.ip_address(host).is_loopback
      and coordinator
      and coordinator.rpartition(':')[0] not in ('127.0.0.1', 'localhost', '[::1]')
  ):
    logging.warning(
        'the transfer server listens on %s only, but the coordinator is at %s: '
        'peers on other machines cannot reach it; set '
        "--config.cluster.transfer_host=hostname (or this machine's address)",
        host,
        coordinator,
    )
  return host


def start_server(host: str):
  """A transfer server bound to `host` only: its socket address and one transport address per
  local device. Both must be explicit: with the defaults ('[::]:0', none) pulls fail on CPU
  ("SocketServer: Connection closed"), and '[::]' would listen on every interface."""
  local = jax.local_devices()
  return jax_transfer.start_transfer_server(
      local[0].client, f'{host}:0', [f'{host}:0'] * len(local)
  )


def _addr_key(process_id: int) -> str:
  return f'{_KV_PREFIX}/server/{process_id}'


def transfer_server():
  """This process's transfer server, started (and its address published) on first use."""
  global _server
  if _server is None:
    info = distributed.process_info()
    if not info.is_distributed:
      raise RuntimeError(
          'Cross-process transfer needs jax.distributed: launch with '
          'launch/local.py and call distributed.maybe_initialize(); inside one '
          'process use jax.device_put instead.'
      )
    server = start_server(_transfer_host())
    distributed.kv_set(_addr_key(info.process_id), server.address(), overwrite=True)
    _server = server
  return _server


def _connection(peer: int, timeout_s: float):
  if peer not in _connections:
    address = distributed.kv_get(_addr_key(peer), timeout_s)
    _connections[peer] = transfer_server().connect(address)
  return _connections[peer]


# ------------------------------------------------------------------------------------------
# Layout helpers


def _norm_index(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  """A shard's index (tuple of slices) as ((start, stop), ...) over every dimension."""
  out = []
  for d, n in enumerate(shape):
    sl = index[d] if d < len(index) else slice(None)
    start, stop, step = sl.indices(n)
    if step != 1:
      raise ValueError(f'strided shard index {index} is not supported')
    out.append((start, stop))
  return tuple(out)


@functools.partial(jax.jit, static_argnums=(1, 2))
@functools.partial(jax.jit, static_argnums=(1, 2))
def _assemble(pieces, slices, shape):
  """Writes `pieces` (on one device) into a zero array of `shape` at `slices` ((start, stop)...).

  Jitted with static slices: it runs on the pieces' device with no host scalars, so it is legal
  under jax.transfer_guard('disallow')."""
  out = jnp.zeros(shape, pieces[0].dtype)
  for p, sl in zip(pieces, slices):
    out = lax.dynamic_update_slice(out, p, tuple(a for a, _ in sl))
  return out


def _path_strings(tree) -> tuple[list[str], list, Any]:
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(p) for p, _ in with_path], [x for _, x in with_path], treedef


def _split(x: jax.Array) -> tuple[list[jax.Array], dict]:
  """The pieces `send` offers for `x` (one single-device array per distinct slice, so replicas
  go once) and their description for the receiver."""
  shards = sorted(
      (s for s in x.addressable_shards if s.replica_id == 0),
      key=lambda s: _norm_index(s.index, x.shape),
  )
  meta = {
      'shape': list(x.shape),
      'dtype': jnp.dtype(x.dtype).name,
      'pieces': [_norm_index(s.index, x.shape) for s in shards],
  }
  return [s.data for s in shards], meta


def _plan(i: int, spec, m: dict) -> dict:
  """Which device each sent piece is pulled onto, and how the leaf is then built."""
  shape = tuple(m['shape'])
  sharding = spec.sharding
  slices = [tuple(tuple(ab) for ab in p) for p in m['pieces']]
  target = {
      d: _norm_index(idx, shape)
      for d, idx in sharding.addressable_devices_indices_map(shape).items()
  }
  devices = sorted(target, key=lambda d: d.id)
  home = devices[i % len(devices)]  # spreads leaves that need assembling over the devices
  if set(target.values()) <= set(slices):
    # Every device wants exactly one sent piece: pull each onto the first device wanting it
    # (replicas are then device-to-device copies; unwanted pieces land on `home`, unused).
    first = {}
    for d in devices:
      first.setdefault(target[d], d)
    return {
        'direct': True,
        'slices': slices,
        'target': target,
        'devices': [first.get(sl, home) for sl in slices],
    }
  # Other slicing: pull every piece onto `home`, assemble the whole leaf there, then reshard.
  return {'direct': False, 'slices': slices, 'target': target, 'devices': [home] * len(slices)}


def _build(spec, pieces: list, plan: dict):
  """The received leaf on spec.sharding from its pulled pieces (device-to-device only)."""
  shape, sharding = tuple(spec.shape), spec.sharding
  if plan['direct']:
    by_slice = {}
    for sl, p in zip(plan['slices'], pieces):
      by_slice[sl] = p
    arrays = []
    for d in sharding.addressable_devices_indices_map(shape):
      p = by_slice[plan['target'][d]]
      arrays.append(p if p.devices() == {d} else jax.device_put(p, d))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
  if len(pieces) == 1:
    full = pieces[0]
  else:
    full = _assemble(pieces, tuple(plan['slices']), shape)
  return jax.device_put(full, sharding)


# ------------------------------------------------------------------------------------------
# Channel


@dataclasses.dataclass(frozen=True)
class Delivery:
  """What Channel.receive_full returns."""

  tree: Any
  info: dict
  wait_s: float
  pull_s: float


class Channel:
  """Point-to-point pytree transfer between this process and process `peer`.

  Both directions work over one Channel. Pairing is by (tag, count): the n-th send(tag) of this
  process to `peer` is the n-th receive(tag) of `peer` from this process. `name` separates
  independent channels between the same two processes. Not thread-safe.
  """

  def __init__(self, peer: int, name: str = 'default', timeout_s: float = 300.0):
    info = distributed.process_info()
    if not info.is_distributed:
      raise RuntimeError(
          'Channel needs jax.distributed (launch/local.py + maybe_initialize()); '
          'in one process use jax.device_put.'
      )
    if not 0 <= peer < info.num_processes or peer == info.process_id:
      raise ValueError(
          f'peer={peer} must be another process id in [0, {info.num_processes}) '
          f'(this is process {info.process_id}).'
      )
    self.peer, self.name, self.timeout_s = peer, name, timeout_s
    self.process_id = info.process_id
    self._sent: dict[str, int] = {}  # tag -> number of sends so far
    self._received: dict[str, int] = {}  # tag -> number of receives so far
    self._acks_consumed: set[tuple[str, int]] = set()  # (tag, seq) whose ack wait_delivered took
    transfer_server()  # start ours and publish its address now, so the peer never waits long

  def _key(self, src: int, dst: int, tag: str, seq: int) -> str:
    return f'{_KV_PREFIX}/{self.name}/{src}-{dst}/{tag}/{seq}'

  def send(self, tree, tag: str, dtype=None, info: dict | None = None) -> int:
    """Offers `tree` (pytree of fully addressable jax.Arrays) to the peer under `tag`.

    Returns at once (the peer pulls when it calls receive); floating leaves are cast to `dtype`
    first when given. `info`: a small JSON-serialisable dict that travels with the send (e.g.
    a policy version); the peer gets it from `receive_full`. Returns the send's sequence number
    for wait_delivered.
    """
    dt = _cast_dtype(dtype)
    paths, leaves, _ = _path_strings(tree)
    pieces, meta_leaves = [], []
    for path, x in zip(paths, leaves):
      if not isinstance(x, jax.Array):
        raise ValueError(
            f'send({tag!r}): leaf {path} is a {type(x).__name__}, not a jax.Array; '
            'jax.device_put it first.'
        )
      if not x.is_fully_addressable:
        raise ValueError(
            f'send({tag!r}): leaf {path} spans other processes; send only arrays '
            "on this process's devices."
        )
      if dt is not None and jnp.issubdtype(x.dtype, jnp.floating):
        x = lax.convert_element_type(x, dt)
      arrays, leaf_meta = _split(x)
      pieces += arrays
      meta_leaves.append(leaf_meta)
    seq = self._sent.get(tag, 0)
    pull_id = next(_pull_ids)
    if pieces:
      transfer_server().await_pull(pull_id, pieces)
    key = self._key(self.process_id, self.peer, tag, seq)
    # Published after await_pull, so a receiver that sees the key never pulls too early.
    distributed.kv_set(
        key + '/meta',
        json.dumps({'pull_id': pull_id, 'paths': paths, 'leaves': meta_leaves, 'info': info or {}}),
    )
    self._sent[tag] = seq + 1
    # Keep the KV store small: drop the previous send's ack once it is there (unless
    # wait_delivered already took it: one store round trip less per send).
    if seq > 0 and (tag, seq - 1) not in self._acks_consumed:
      prev = self._key(self.process_id, self.peer, tag, seq - 1) + '/ack'
      if distributed.kv_try_get(prev) is not None:
        distributed.kv_delete(prev)
    self._acks_consumed.discard((tag, seq - 1))
    return seq

  def sent(self, tag: str) -> int:
    """How many sends under `tag` this channel has made."""
    return self._sent.get(tag, 0)

  def wait_delivered(self, tag: str, seq: int | None = None, timeout_s: float | None = None):
    """Blocks until the peer has received send number `seq` (default: the latest) of `tag`."""
    if seq is None:
      seq = self._sent.get(tag, 0) - 1
    if seq < 0:
      raise ValueError(f'wait_delivered({tag!r}): nothing was sent under this tag.')
    key = self._key(self.process_id, self.peer, tag, seq) + '/ack'
    distributed.kv_get(key, self.timeout_s if timeout_s is None else timeout_s)
    distributed.kv_delete(key)
    self._acks_consumed.add((tag, seq))

  def _next_meta_key(self, tag: str) -> str:
    """The key the peer's next send under `tag` posts its description under."""
    return self._key(self.peer, self.process_id, tag, self._received.get(tag, 0)) + '/meta'

  def poll(self, tag: str) -> bool:
    """Whether the peer's next send under `tag` is posted (receive would not wait)."""
    return distributed.kv_try_get(self._next_meta_key(tag)) is not None

  def wait_posted(self, tag: str, timeout_s: float) -> bool:
    """Blocks up to timeout_s for the peer's next send under `tag`; whether it is posted."""
    try:
      distributed.kv_get(self._next_meta_key(tag), timeout_s)
      return True
    except jax.errors.JaxRuntimeError as e:
      if distributed.timed_out(e):
        return False
      raise

  def receive(self, abstract_tree, tag: str):
    """The tree of the peer's next send under `tag` (see receive_full)."""
    return self.receive_full(abstract_tree, tag).tree

  def receive_full(self, abstract_tree, tag: str) -> 'Delivery':
    """Receives the peer's next send under `tag`, laid out as `abstract_tree` asks.

    Args:
      abstract_tree: pytree (same structure as the sent one) of jax.ShapeDtypeStruct (or arrays)
        whose .sharding lives on this process's devices; shapes and dtypes must match the sent
        leaves (see `abstract`).
    Returns:
      Delivery: .tree, a pytree of jax.Arrays on those shardings, ready (the peer may free its
      copies); .info, the sender's info dict; .wait_s, seconds spent waiting for the send to be
      posted; .pull_s, seconds from then until every array was ready here.
    Raises:
      ValueError on any structure/shape/dtype/sharding mismatch, before anything is pulled (the
      receive can then be retried with the right tree).
    """
    paths, specs, treedef = _path_strings(abstract_tree)
    local = set(jax.local_devices())
    for path, s in zip(paths, specs):
      sh = getattr(s, 'sharding', None)
      if not isinstance(sh, Sharding):
        raise ValueError(
            f'receive({tag!r}): leaf {path} needs a jax.sharding.Sharding on this '
            "process's devices, e.g. jax.ShapeDtypeStruct(shape, dtype, sharding="
            'NamedSharding(local_mesh, spec)); got sharding={sh!r}.'
        )
      if not sh.device_set <= local:
        raise ValueError(
            f'receive({tag!r}): leaf {path} asks for devices of another process '
            f'({sorted(d.id for d in sh.device_set - local)}); use a mesh over '
            'jax.local_devices().'
        )
    seq = self._received.get(tag, 0)
    key = self._key(self.peer, self.process_id, tag, seq)
    t_wait = time.perf_counter()
    meta = json.loads(distributed.kv_get(key + '/meta', self.timeout_s))
    t_pull = time.perf_counter()
    self._check(meta, paths, specs, tag)

    pull_specs, builders = [], []
    for i, (s, m) in enumerate(zip(specs, meta['leaves'])):
      plan = _plan(i, s, m)
      builders.append((len(pull_specs), len(plan['devices']), plan))
      dtype = jnp.dtype(m['dtype'])
      for sl, dev in zip(plan['slices'], plan['devices']):
        shape = tuple(b - a for a, b in sl)
        pull_specs.append(jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev)))
    if pull_specs:
      deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout_s)
      pulled = _connection(self.peer, self.timeout_s).pull(
          meta['pull_id'], pull_specs, timeout=deadline
      )
    else:
      pulled = []
    out = [
        _build(s, pulled[start : start + n], plan) for s, (start, n, plan) in zip(specs, builders)
    ]
    # Ready before acking: after the ack the sender may free or donate its buffers.
    out = jax.block_until_ready(out)
    t_done = time.perf_counter()
    distributed.kv_set(key + '/ack', '1')
    distributed.kv_delete(key + '/meta')
    self._received[tag] = seq + 1
    return Delivery(
        jax.tree.unflatten(treedef, out),
        meta.get('info', {}),
        wait_s=t_pull - t_wait,
        pull_s=t_done - t_pull,
    )

  @staticmethod
  def _check(meta: dict, paths: list[str], specs: list, tag: str) -> None:
    if meta['paths'] != paths:
      extra = sorted(set(paths) - set(meta['paths']))[:5]
      missing = sorted(set(meta['paths']) - set(paths))[:5]
      raise ValueError(
          f'receive({tag!r}): tree structure differs from the sent one '
          f'({len(meta["paths"])} sent leaves, {len(paths)} asked; only asked: '
          f'{extra}, only sent: {missing}).'
      )
    for path, s, m in zip(paths, specs, meta['leaves']):
      if tuple(s.shape) != tuple(m['shape']):
        raise ValueError(
            f'receive({tag!r}): leaf {path} has shape {tuple(m["shape"])} but '
            f'{tuple(s.shape)} was asked.'
        )
      if jnp.dtype(s.dtype).name != m['dtype']:
        raise ValueError(
            f'receive({tag!r}): leaf {path} was sent as {m["dtype"]} but '
            f'{jnp.dtype(s.dtype).name} was asked; ask for {m["dtype"]} or have the '
            'sender cast with send(..., dtype=...).'
        )
