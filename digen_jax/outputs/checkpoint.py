"""Orbax checkpoints of the whole training state: a run restarted on the same workdir resumes.

Saved per step: params, optimizer state, the base RNG key (as raw uint32 data), and a JSON record
(step, data position, policy version). Restores onto the shardings of a template state, so a
resumed run continues on the same mesh layout without a host copy of the full model.

Storage faults: orbax writes each step into a temporary directory and renames it
when complete, so a crash or a full disk during a save leaves the previous steps as they were
(old steps are deleted only after a new one is committed). Orbax does not notice bytes that
change later (a flipped bit in a chunk restores silently), so every step holds
<step>/digest.json (size and CRC32 of every file), written into the temporary directory before
orbax renames it: a committed step has its digest, and a step without one is not trusted (a
save that did not finish, or a deleted file). `restore_latest` checks it; a step that fails the
check or orbax's own reads is moved to <directory>.corrupt/ with a warning and the previous step
is used.
"""

from __future__ import annotations

import errno
import json
import logging as logging_std
import os
import shutil
import sys
import time
import zlib
from typing import Any

from absl import logging
import jax
import numpy as np
import orbax.checkpoint as ocp

from digen_jax.outputs import faults

DIGEST_FILE = 'digest.json'
# orbax's step metadata (item names, timestamps): rewritten after the commit, so it cannot be in
# a digest written before it, and not needed to restore (a garbled or missing one restores).
UNDIGESTED = (DIGEST_FILE, '_CHECKPOINT_METADATA')
TMP_MARKER = (
    '.orbax-checkpoint-tmp'  # orbax names an uncommitted step <step>.orbax-checkpoint-tmp[-<time>]
)
_CHUNK = 1 << 22


def _files(step_dir: str) -> list[str]:
  out = []
  for root, _, names in os.walk(step_dir):
    out += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
  return sorted(f for f in out if f not in UNDIGESTED)


def _crc32(path: str) -> int:
  crc = 0
  with open(path, 'rb') as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def write_digest(step_dir: str) -> None:
  """<step_dir>/digest.json: {relative path: [size, crc32]} of the step's files (but UNDIGESTED),
  written into its temporary directory just before orbax commits it. CRC32, not a cryptographic hash: it guards against corruption (it runs at GB/s), not tampering
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
  """None when the step's files match its digest; else what is wrong, a missing digest included:
  every step this module commits holds one, so a step without it is not known to be whole."""
  path = os.path.join(step_dir, DIGEST_FILE)
  if not os.path.exists(path):
    return (
        f'it has no {DIGEST_FILE} (a save that did not finish, or the file was deleted), so its '
        'files cannot be checked'
    )
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


class _DropOrbaxFailureLogs(logging_std.Filter):
  """orbax logs a failed save or restore with its traceback, once per thread involved (dozens of
  records for one full disk), before raising it; Checkpointer turns that exception into one
  CheckpointError line or a fallback warning that names the cause, so the records would only
  repeat it at length."""

  def filter(self, record):
    orbax = '/orbax/' in record.pathname.replace(os.sep, '/')
    return not (orbax and (record.levelno >= logging_std.ERROR or record.exc_info))


def _drop_abandoned_io_noise(previous):
  """A sys.unraisablehook for what a failed save or restore leaves behind, reported as unraisable
  with a traceback apiece though the failure itself is already raised: tensorstore completing
  the writes still in flight by calling back into the asyncio loop orbax closed ('Event loop is
  closed'), and orbax's read or write coroutines that nobody awaits any more, collected at exit."""

  def hook(unraisable):
    e, obj = unraisable.exc_value, unraisable.object
    if isinstance(e, RuntimeError) and str(e) == 'Event loop is closed':
      return
    code = getattr(obj, 'cr_code', None)  # a coroutine
    if code is not None and '/orbax/' in code.co_filename.replace(os.sep, '/'):
      return
    previous(unraisable)

  hook.digen_quiet = True
  return hook


def quiet_storage_failures() -> None:
  """Keeps orbax's and tensorstore's own reports of a storage failure off stderr (idempotent):
  the Checkpointer reports each failure itself, in one line."""
  absl_logger = logging_std.getLogger('absl')  # orbax logs through absl
  if not any(isinstance(f, _DropOrbaxFailureLogs) for f in absl_logger.filters):
    absl_logger.addFilter(_DropOrbaxFailureLogs())
  if not getattr(sys.unraisablehook, 'digen_quiet', False):
    sys.unraisablehook = _drop_abandoned_io_noise(sys.unraisablehook)


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
    self._init_bookkeeping()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=max(1, save_every),
            create=True,
            cleanup_tmp_directories=True,
            async_options=self._async_options(),
        ),
    )

  def _init_bookkeeping(self):
    quiet_storage_failures()
    self._saving: int | None = None  # the step of the save in flight

  def _async_options(self) -> ocp.AsyncOptions:
    # orbax calls this in its save thread once the step's files are complete, just before it
    # renames the temporary directory: the digest is committed with the step it describes.
    return ocp.AsyncOptions(post_finalization_callback=self._digest_before_commit)

  def _digest_before_commit(self) -> None:
    step = self._saving
    prefix = f'{step}{TMP_MARKER}'
    tmp = [n for n in os.listdir(self.directory) if n.startswith(prefix)]
    # No temporary directory: a storage that commits in place (not a local file system).
    write_digest(os.path.join(self.directory, tmp[0]) if len(tmp) == 1 else self.step_dir(step))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], *, force: bool = False):
    """state: pytree of jax arrays (params, opt_state, rng); meta: JSON-serialisable dict.
    Asynchronous: a failure surfaces as a CheckpointError at the next save, wait() or close();
    the steps committed before it stay readable."""
    self._finish_saves()
    self._saving = step  # before save(): its thread may reach the commit before save() returns
    try:
      saved = self._manager.save(
          step,
          args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
          force=force,
      )
    except Exception as e:  # pylint: disable=broad-except  (orbax/tensorstore raise anything)
      self._saving = None
      raise self._save_error(step, e) from e
    if not saved:
      self._saving = None

  def _finish_saves(self):
    """Waits for the save in flight; CheckpointError if it failed."""
    step = self._saving
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise self._save_error(step, e) from e
    finally:
      self._saving = None  # read by _digest_before_commit until the save is done

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

    A step whose files fail its digest, that has no digest, or that orbax cannot read is not
    used: a warning, and the next older step is tried; once one restores, the newer ones move to
    <directory>.corrupt/ (move_aside), out of the way of the next saves. A step that passes its
    digest but does not restore onto `template` is not corrupt but another run's (changed model
    or optimizer): CheckpointError at once, as when no step is readable."""
    corrupt: list[tuple[int, str]] = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      bad = verify_digest(self.step_dir(step))
      if bad is None:
        try:
          state, meta = self.restore(step, template)
        except Exception as e:  # pylint: disable=broad-except
          raise faults.CheckpointError(
              f'checkpoint step {step} in {self.directory} is intact but does not fit this '
              f'run ({faults.short(e, 200)}): was the model, optimizer or config changed? '
              'Resume with the config it was saved with, or use a new --workdir'
          ) from e
        self._set_aside(corrupt, move_aside)
        return step, state, meta
      logging.warning(
          'checkpoint step %d in %s is corrupt or incomplete: %s; trying the previous one',
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
    self._init_bookkeeping()
    mp = ocp.options.MultiprocessingOptions(primary_host=pid, active_processes={pid})
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=max(1, save_every),
            create=False,
            multiprocessing_options=mp,
            cleanup_tmp_directories=True,
            async_options=self._async_options(),
        ),
        item_handlers={
            'state': ocp.StandardCheckpointHandler(multiprocessing_options=mp),
            'meta': ocp.JsonCheckpointHandler(multiprocessing_options=mp),
        },
    )

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
