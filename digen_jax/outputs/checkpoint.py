"""Orbax checkpoints of the whole training state: a run restarted on the same workdir resumes.

Saved per step: params, optimizer state, the base RNG key (as raw uint32 data), and a JSON record
(step, data position, policy version). Restores onto the shardings of a template state, so a
resumed run continues on the same mesh layout without a host copy of the full model.

Storage faults (issue 18): orbax writes each step into a temporary directory and renames it when
complete, so a crash or a full disk during a save leaves the previous steps as they were (old
steps are deleted only after a new one is committed). Orbax does not notice bytes that change
later (a flipped bit in a chunk restores silently), so once a step is committed we write
<step>/digest.json (size and CRC32 of every file); `restore_latest` checks it, and a step that
fails the check or orbax's own reads is moved to <directory>.corrupt/ with a warning and the
previous step is used.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import zlib
from typing import Any

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

from digen_jax.outputs import faults

DIGEST_FILE = 'digest.json'
TMP_MARKER = (
    '.orbax-checkpoint-tmp'  # orbax names an uncommitted step <step>.orbax-checkpoint-tmp[-<time>]
)
_CHUNK = 1 << 22


def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
  return sorted(f for f in out if f != DIGEST_FILE)


def _crc32(path: str) -> int:
  crc = 0
  with open(path, 'rb') as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def write_digest(step_dir: str) -> None:
  """<step_dir>/digest.json: {relative path: [size, crc32]} of the committed step's files.
  CRC32, not a cryptographic hash: it guards against corruption (it runs at GB/s), not tampering
  (orbax and safetensors never execute what they read)."""
  files = {
      f: [os.path.getsize(os.path.join(step_dir, f)), _crc32(os.path.join(step_dir, f))]
      for f in _files(step_dir)
  }
  tmp = os.path.join(step_dir, DIGEST_FILE + '.tmp')
  with open(tmp, 'w') as fh:
    json.dump({'algorithm': 'crc32', 'files': files}, fh)
  os.replace(tmp, os.path.join(step_dir, DIGEST_FILE))


def verify_digest(step_dir: str) -> str | None:
  """None when the step's files match its digest (or it has none: a step committed just before a
  crash); else what differs."""
  path = os.path.join(step_dir, DIGEST_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as fh:
      files = json.load(fh)['files']
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f'unreadable {DIGEST_FILE} ({faults.short(e, 100)})'
  for rel, (size, crc) in files.items():
    f = os.path.join(step_dir, rel)
    if not os.path.isfile(f):
      return f'{rel} is missing'
    if os.path.getsize(f) != size:
      return f'{rel} has {os.path.getsize(f)} bytes, {size} were written'
    if _crc32(f) != crc:
      return f'{rel} does not match its checksum'
  return None


def remove_partial_saves(directory: str) -> list[str]:
  """Deletes the temporary directories of saves that never committed (a crash or a full disk
  mid-write); returns their names. orbax's own cleanup_tmp_directories is not relied on alone:
  whether it recognises a temporary directory depends on process-global orbax state, so a partial
  step could survive in one process and not in another."""
  if not os.path.isdir(directory):
    return []
  removed = []
  for name in sorted(os.listdir(directory)):
    if TMP_MARKER in name and os.path.isdir(os.path.join(directory, name)):
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
      removed.append(name)
  if removed:
    logging.warning('checkpoints: removed partial saves %s in %s', removed, directory)
  return removed


class Checkpointer:
  """Thin wrapper over ocp.CheckpointManager with a Composite of standard + JSON items."""

  def __init__(self, directory: str, *, max_to_keep: int = 2, save_every: int = 1):
    self.directory = os.path.abspath(directory)
    remove_partial_saves(self.directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=max(1, save_every),
            create=True,
            cleanup_tmp_directories=True,
        ),
    )
    self._init_bookkeeping()

  def _init_bookkeeping(self):
    self._undigested: list[int] = []  # committed (or committing) steps without digest.json
    self._saving: int | None = None  # the step of the save in flight

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], *, force: bool = False):
    """state: pytree of jax arrays (params, opt_state, rng); meta: JSON-serialisable dict.
    Asynchronous: a failure surfaces here at the next save or in wait()/close() as a
    CheckpointError; the steps committed before it stay readable."""
    self._finish_saves()
    try:
      saved = self._manager.save(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
          force=force,
      )
    except Exception as e:  # pylint: disable=broad-except  (orbax/tensorstore raise anything)
      raise self._save_error(step, e) from e
    if saved:
      self._saving = step
      self._undigested.append(step)

  def _finish_saves(self):
    """Waits for the save in flight, then digests every committed step that lacks one."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      failed = self._saving
      self._saving, self._undigested = None, [s for s in self._undigested if s != failed]
      raise self._save_error(failed, e) from e
    self._saving = None
    for s in self._undigested:
      if os.path.isdir(self.step_dir(s)):  # else deleted by max_to_keep, or never committed
        try:
          write_digest(self.step_dir(s))
        except OSError as e:  # e.g. a full disk: the step stays valid, just unguarded
          logging.warning(
              'checkpoint step %d: cannot write %s (%s); it is kept without one',
              s,
              DIGEST_FILE,
              faults.short(e, 200),
          )
    self._undigested = []

  def _save_error(self, step, e: BaseException) -> faults.CheckpointError:
    full = str(e)  # tensorstore's message: the errno may come after pages of spec
    if (
        getattr(e, 'errno', None) == errno.ENOSPC
        or 'No space left on device' in full
        or "os_error_code='28'" in full
    ):
      text = 'the disk is full (No space left on device)'
    else:
      text = faults.short(e, 400)
    # From the disk: after a failed save orbax's own list may already lack the step it meant to
    # delete once the new one committed (max_to_keep), which is still there.
    committed = [int(n) for n in os.listdir(self.directory) if n.isdigit() and int(n) != step]
    prev = (
        f'the previous checkpoint (step {max(committed)}) is intact'
        if committed
        else 'no earlier checkpoint exists'
    )
    return faults.CheckpointError(
        f'saving checkpoint step {step} in {self.directory} failed: {text}; {prev}: free space '
        '(or fix the cause) and rerun the same command to resume from it'
    )

  def restore(self, step: int, template: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores onto the shapes/dtypes/shardings of `template` (a pytree of jax arrays)."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        ),
    )
    return restored['state'], restored['meta']

  def restore_latest(
      self, template: dict[str, Any], *, move_aside: bool = True
  ) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
    """(step, state, meta) of the newest readable checkpoint, or None when there is none.

    A step whose files fail its digest, or that orbax cannot read although it has no digest,
    is corrupt: a warning, and the next older step is tried; once one restores, the corrupt
    newer ones move to <directory>.corrupt/ (move_aside), out of the way of the next saves.
    A step that passes its digest but does not restore onto `template` is not corrupt but
    another run's (changed model or optimizer): CheckpointError at once, as when no step is
    readable."""
    corrupt: list[tuple[int, str]] = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      bad = verify_digest(self.step_dir(step))
      if bad is None:
        has_digest = os.path.exists(os.path.join(self.step_dir(step), DIGEST_FILE))
        try:
          state, meta = self.restore(step, template)
        except Exception as e:  # pylint: disable=broad-except
          if has_digest:
            raise faults.CheckpointError(
                f'checkpoint step {step} in {self.directory} is intact but does not fit this '
                f'run ({faults.short(e, 200)}): was the model, optimizer or config changed? '
                'Resume with the config it was saved with, or use a new --workdir'
            ) from e
          bad = f'orbax cannot read it ({faults.short(e, 200)})'
        else:
          self._set_aside(corrupt, move_aside)
          return step, state, meta
      logging.warning(
          'checkpoint step %d in %s is corrupt: %s; trying the previous one',
          step,
          self.directory,
          bad,
      )
      corrupt.append((step, bad))
    if corrupt:
      listed = '; '.join(f'step {s}: {why}' for s, why in corrupt)
      raise faults.CheckpointError(
          f'no readable checkpoint in {self.directory} ({listed}): restore it from a backup, or '
          'move that directory away to start the run from step 0'
      )
    return None

  def _set_aside(self, corrupt: list[tuple[int, str]], move: bool):
    if not corrupt or not move:
      return
    aside = self.directory + '.corrupt'
    os.makedirs(aside, exist_ok=True)
    for step, why in corrupt:
      dest = os.path.join(aside, f'{step}-{time.strftime("%Y%m%d-%H%M%S")}')
      shutil.move(self.step_dir(step), dest)
      logging.warning('moved corrupt checkpoint step %d (%s) to %s', step, why, dest)
    self._manager.reload()

  def wait(self):
    self._finish_saves()

  def close(self):
    try:
      self._finish_saves()
    finally:
      self._manager.close()


class ProcessCheckpointer(Checkpointer):
  """A Checkpointer for a multi-process job in which only this process saves.

  orbax 0.12 refuses to save arrays that live on one process's devices when the job has
  several processes, so state goes through host memory (numpy) and is saved by this process
  alone (active_processes); NumpyHandler writes from process 0 only, hence the trainer is
  process 0. Restores come back as numpy and are placed on the template's shardings. Same
  on-disk format as Checkpointer: single-process tools (digen_jax.eval) read these checkpoints.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 2, save_every: int = 1):
    pid = jax.process_index()
    if pid != 0:
      raise ValueError(
          f'ProcessCheckpointer runs in process 0 (this is process {pid}): make the '
          'trainer process 0 (config.cluster.trainer.processes=(0,))'
      )
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)  # orbax cannot create it with active_processes
    remove_partial_saves(self.directory)
    mp = ocp.options.MultiprocessingOptions(primary_host=pid, active_processes={pid})
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=max(1, save_every),
            create=False,
            multiprocessing_options=mp,
            cleanup_tmp_directories=True,
        ),
        item_handlers={
            'state': ocp.StandardCheckpointHandler(multiprocessing_options=mp),
            'meta': ocp.JsonCheckpointHandler(multiprocessing_options=mp),
        },
    )
    self._init_bookkeeping()

  def save(self, step, state, meta, *, force=False):
    if self._manager.should_save(step) or force:
      super().save(step, jax.device_get(state), meta, force=force)

  def restore(self, step, template):
    host = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), template)
    restored = self._manager.restore(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardRestore(host), meta=ocp.args.JsonRestore()),
    )
    state = jax.tree.map(
        lambda x, t: jax.device_put(np.asarray(x, t.dtype), t.sharding), restored['state'], template
    )
    return state, restored['meta']


def key_to_data(key: jax.Array) -> jax.Array:
  """Typed PRNG key -> uint32 array (what orbax can store)."""
  return jax.random.key_data(key)


def data_to_key(data) -> jax.Array:
  return jax.random.wrap_key_data(
      np.asarray(data, dtype=np.uint32) if not isinstance(data, jax.Array) else data
  )
