"""How the two roles exchange weights, fragments, claims and small values
(docs/design.md#execution-modes).

`Link` is what a schedule needs from a transport; two implement it:

  LocalLink    both roles in one process (the rollout a thread): jax.device_put between
               the meshes, claims under a lock.
  ChannelLink  trainer and rollout in two processes (launch/local.py, launch/slurm.sh):
               transfer.Channel for weights and fragments, the jax.distributed key-value
               store for prompts, claims and eval rows (plain cross-process device_put hangs
               on CPU: docs/design.md#execution-modes).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from digen_jax.process import interrupt
from digen_jax.runtime import distributed
from digen_jax.runtime import publish
from digen_jax.runtime import transfer

KV = 'digen/pipe'
PEER_TIMEOUT_S = 3600.0
FRAG_TAG = 'frag'
WEIGHTS_TAG = 'weights'


@dataclasses.dataclass
class Fragment:
  """A scored fragment. traj: Trajectory of plan.rows rows, the first plan.size its samples,
  the rest weight-0 padding (on the holder's mesh); rewards and images: plan.size."""

  step: int
  index: int
  version: int
  traj: Any
  rewards: np.ndarray  # [size] float32
  producer: str  # 'rollout' | 'trainer' (TAG)
  sample_s: float = 0.0  # device span of sampling + decode
  reward_s: float = 0.0
  images: Any = None
  t_start: float = 0.0  # wall clock (time.time()) of the span's start and end
  t_end: float = 0.0
  arrived: float = 0.0  # wall clock at which the trainer held it (rollout fragments)
  eval_s: float = 0.0  # the producer's eval before this step's first fragment
  # Each reward's scores [K, size] (NaN: that sample's reward failed) and what scoring cost:
  # {'compute_s', 'wait_s' (the rollout blocked on it), 'retries', 'failed'}.
  reward_parts: Any = None
  reward_info: dict = dataclasses.field(default_factory=dict)
  pending: Any = None  # the rewards being scored (rollout side, until they are in)


class Link(Protocol):
  """The transport between the trainer and the rollout, as the schedule uses it."""

  error: BaseException | None

  # weights (trainer -> rollout)
  def publish(self, params, version: int) -> None:
    ...

  def weights_delivered(self) -> None:
    ...

  def policy_ready(self, version: int) -> bool:
    ...

  def wait_policy(self, version: int) -> tuple[publish.Policy, float]:
    ...

  def release_before(self, step: int) -> None:
    ...

  # small shared values (prompts, eval rows)
  def put(self, key: str, value) -> None:
    ...

  def get(self, key: str):
    ...

  # claims: who samples a fragment; the first claim wins
  def claim(self, step: int, f: int, who: str) -> bool:
    ...

  def claims(self, step: int, num: int) -> dict[int, dict]:
    ...

  # fragments (rollout -> trainer)
  def send_fragment(self, frag: Fragment, spans: list[dict]) -> None:
    ...

  def poll(self) -> bool:
    ...

  def receive_fragment(self) -> tuple[Fragment, list[dict], float]:
    ...

  def finish_rollout(self) -> None:
    ...

  # lifetime
  def fail(self, e: BaseException) -> None:
    ...

  def close(self) -> None:
    ...


class PeerFailed(Exception):
  """The other role (a thread of this process) failed; this one stops quietly."""


class LocalLink:
  """Both roles in one process (the rollout is a thread): weights and fragments move by
  jax.device_put onto the other role's mesh; claims under a lock."""

  def __init__(self, cluster, weights, trainer_traj_shardings, rollout_param_shardings, dtype):
    self._cv = threading.Condition()
    self._weights = weights
    self._policies: dict[int, publish.Policy] = {}
    self._frags: queue.Queue = queue.Queue()
    self._claims: dict[tuple[int, int], dict] = {}
    self._kv: dict[str, Any] = {}
    self.error: BaseException | None = None
    self._traj_sh = trainer_traj_shardings
    self._param_sh, self._dtype = rollout_param_shardings, dtype
    # Colocated roles share devices: an uncast publish onto the same sharding would alias the
    # trainer's buffers, which the optimizer step donates; copy instead.
    shared = bool(set(cluster.trainer.devices) & set(cluster.rollout.devices))
    self._copy = shared and dtype is None

  def _wait(self, pred, what: str):
    with self._cv:
      while not pred():
        if self.error is not None:
          raise PeerFailed(f'peer failed while waiting for {what}') from self.error
        interrupt.check(f'while waiting for {what}')
        self._cv.wait(0.2)

  def fail(self, e: BaseException):
    with self._cv:
      self.error = e
      self._cv.notify_all()

  # weights
  def publish(self, params, version: int) -> None:
    policy = publish.publish(self._weights, params, version, self._dtype)
    moved = jax.device_put(policy.params, self._param_sh)
    if self._copy:
      moved = jax.tree.map(jnp.copy, moved)
    policy = dataclasses.replace(policy, params=jax.block_until_ready(moved))
    with self._cv:
      self._policies = {v: p for v, p in self._policies.items() if v >= version - 1}
      self._policies[version] = policy
      self._cv.notify_all()

  def weights_delivered(self) -> None:
    pass

  def close(self) -> None:
    pass

  def policy_ready(self, version: int) -> bool:
    with self._cv:
      return version in self._policies

  def wait_policy(self, version: int) -> tuple[publish.Policy, float]:
    self._wait(lambda: version in self._policies, f'policy {version}')
    with self._cv:
      return publish.accept(self._weights, self._policies[version], version), 0.0

  # small shared values (prompts, eval rows)
  def put(self, key: str, value) -> None:
    with self._cv:
      self._kv[key] = value
      self._cv.notify_all()

  def get(self, key: str):
    self._wait(lambda: key in self._kv, key)
    with self._cv:
      return self._kv[key]

  # claims
  def claim(self, step: int, f: int, who: str) -> bool:
    with self._cv:
      if (step, f) in self._claims:
        return False
      self._claims[(step, f)] = {'who': who, 't': time.time()}
      return True

  def claims(self, step: int, num: int) -> dict[int, dict]:
    with self._cv:
      return {f: self._claims[(step, f)] for f in range(num) if (step, f) in self._claims}

  # fragments
  def send_fragment(self, frag: Fragment, spans: list[dict]) -> None:
    traj = jax.block_until_ready(jax.device_put(frag.traj, self._traj_sh))
    self._frags.put((dataclasses.replace(frag, traj=traj, arrived=time.time()), spans))

  def poll(self) -> bool:
    return not self._frags.empty()

  def receive_fragment(self) -> tuple[Fragment, list[dict], float]:
    while True:
      try:
        frag, spans = self._frags.get(timeout=0.2)
        return frag, spans, 0.0
      except queue.Empty:
        if self.error is not None:
          raise PeerFailed('rollout failed') from self.error
        interrupt.check('while waiting for a fragment')

  def release_before(self, step: int) -> None:
    pass

  def finish_rollout(self) -> None:
    pass


class ChannelLink:
  """Trainer and rollout in two processes: transfer.Channel for weights and fragments, the
  jax.distributed key-value store for prompts, claims and eval rows."""

  def __init__(
      self,
      cluster,
      me: str,
      *,
      weights,
      weights_abstract=None,
      frag_abstract=None,
      dtype=None,
      wait_for_pull: bool = False,
      shared_claims: bool = True,
  ):
    peer = cluster.rollout.process if me == 'trainer' else cluster.trainer.process
    self.wait_for_pull = wait_for_pull  # rollout side: see config.schedule.wait_for_pull
    # Claims go through the key-value store only when the trainer may sample too (TAG): each
    # store operation is a round trip to the coordinator, on the trainer's busy host.
    self.shared_claims = shared_claims
    self.chan = transfer.Channel(peer, name='pipeline', timeout_s=PEER_TIMEOUT_S)
    self._weights = weights  # the run's Weights: LoRA manifests out and checks in
    self._digest_sent = False
    self._weights_abstract, self._frag_abstract, self._dtype = (
        weights_abstract,
        frag_abstract,
        dtype,
    )
    self._held: list[tuple[int, Fragment]] = []  # sent fragments kept alive until pulled
    self._next_version: int | None = None
    self._weights_acked = True
    # Trainer side: a receiver thread pulls each fragment as soon as it is offered, so the
    # hand-over overlaps the gradient of the fragment before it instead of sitting between
    # two gradients (and a waiting rollout, schedule.wait_for_pull, is released at once).
    self._inbox: queue.Queue = queue.Queue()
    self._stop = threading.Event()
    self.error: BaseException | None = None
    self._receiver = None
    if frag_abstract is not None:
      self._receiver = threading.Thread(
          target=self._receive_loop, name='fragment-receiver', daemon=True
      )
      self._receiver.start()

  def _receive_loop(self):
    try:
      while not self._stop.is_set():
        if not self.chan.wait_posted(FRAG_TAG, 0.5):
          continue
        d = self.chan.receive_full(self._frag_abstract, FRAG_TAG)
        i = d.info
        frag = Fragment(
            i['step'],
            i['fragment'],
            i['version'],
            d.tree,
            np.asarray(i['rewards'], np.float32),
            'rollout',
            i['sample_s'],
            i['reward_s'],
            t_start=i['t_start'],
            t_end=i['t_end'],
            arrived=time.time(),
            eval_s=i['eval_s'],
            reward_parts=np.asarray(i['reward_parts'], np.float32),
            reward_info=i['reward_info'],
        )
        self._inbox.put((frag, i['spans'], d.pull_s))
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def fail(self, e):
    self.close()

  def close(self) -> None:
    """Stops the receiver thread (the trainer is done or failed)."""
    self._stop.set()
    if self._receiver is not None:
      self._receiver.join()

  def publish(self, params, version: int) -> None:
    # The first publish of a process carries an adapter digest (a host copy of the adapters);
    # later ones names and shapes only. Do not donate `params` before weights_delivered.
    policy = publish.publish(
        self._weights, params, version, self._dtype, digest=not self._digest_sent
    )
    self._digest_sent = True
    info = {'version': policy.version, 'manifest': policy.manifest}
    self.chan.send(policy.params, WEIGHTS_TAG, info=info)
    self._weights_acked = False

  def weights_delivered(self) -> None:
    """Blocks until the rollout holds the latest published weights (once per publish)."""
    if not self._weights_acked:
      self.chan.wait_delivered(WEIGHTS_TAG)
      self._weights_acked = True

  def policy_ready(self, version: int) -> bool:
    return self.chan.poll(WEIGHTS_TAG)

  def wait_policy(self, version: int) -> tuple[publish.Policy, float]:
    d = self.chan.receive_full(self._weights_abstract, WEIGHTS_TAG)
    policy = publish.Policy(d.tree, int(d.info['version']), d.info.get('manifest'))
    return publish.accept(self._weights, policy, version), d.pull_s

  def put(self, key: str, value) -> None:
    distributed.kv_set(f'{KV}/{key}', json.dumps(value), overwrite=True)

  def get(self, key: str):
    return json.loads(distributed.kv_get(f'{KV}/{key}', PEER_TIMEOUT_S))

  def claim(self, step: int, f: int, who: str) -> bool:
    if not self.shared_claims:  # only the rollout samples (no TAG): nothing to arbitrate
      return True
    try:
      distributed.kv_set(f'{KV}/claim/{step}/{f}', json.dumps({'who': who, 't': time.time()}))
      return True
    except jax.errors.JaxRuntimeError as e:
      if 'ALREADY_EXISTS' in str(e) or 'already exists' in str(e).lower():
        return False
      raise

  def claims(self, step: int, num: int) -> dict[int, dict]:
    out = {}
    for f in range(num):
      v = distributed.kv_try_get(f'{KV}/claim/{step}/{f}')
      if v is not None:
        out[f] = json.loads(v)
    return out

  def send_fragment(self, frag: Fragment, spans: list[dict]) -> None:
    info = {
        'step': frag.step,
        'fragment': frag.index,
        'version': frag.version,
        'rewards': [float(r) for r in frag.rewards],
        'sample_s': frag.sample_s,
        'reward_s': frag.reward_s,
        'spans': spans,
        't_start': frag.t_start,
        't_end': frag.t_end,
        'eval_s': frag.eval_s,
        'reward_parts': np.asarray(frag.reward_parts, np.float32).tolist(),
        'reward_info': frag.reward_info,
    }
    seq = self.chan.send(frag.traj, FRAG_TAG, info=info)
    self._held.append((frag.step, frag))
    if self.wait_for_pull:  # schedule.wait_for_pull: hand over before the next program starts
      self.chan.wait_delivered(FRAG_TAG, seq)

  def poll(self) -> bool:
    return not self._inbox.empty()

  def receive_fragment(self) -> tuple[Fragment, list[dict], float]:
    while True:
      try:
        return self._inbox.get(timeout=0.2)
      except queue.Empty:
        if self.error is not None:
          raise RuntimeError('receiving a fragment from the rollout failed') from self.error
        interrupt.check('while waiting for a fragment')

  def release_before(self, step: int) -> None:
    """Policy `step` arrived: the trainer has pulled every fragment of earlier steps."""
    self._held = [(s, f) for s, f in self._held if s >= step]

  def finish_rollout(self) -> None:
    # With wait_for_pull every fragment was already delivered (and its ack consumed).
    if self.chan.sent(FRAG_TAG) and not self.wait_for_pull:
      self.chan.wait_delivered(FRAG_TAG, timeout_s=PEER_TIMEOUT_S)
    self._held = []
