"""Prompt sets as tensorflow-datasets (tfds) array_record datasets, read without TensorFlow.

The builders (each a `tfds.core.GeneratorBasedBuilder`, written with file_format='array_record'; in
tfds 4.9.10 writing array_record and reading it through `tfds.data_source` need no TensorFlow,
only `tfds.load` / `as_dataset` do, and we never call them):

  a task's prompt set  (e.g. 'shapes_bench', tasks/shapes/prompts.py), registered here by name
  PromptFile   ('prompt_file/<name>') a user's text file(s) of prompts, one per line (surrounding
      whitespace stripped); features: prompt, line (1-based line in the source file). Empty lines
      and prompts longer than max_chars are ValueErrors naming the file and line.

Both land in `<data_dir>/<name>[/<config>]/<version>/` as ordinary tfds datasets, so
`tfds.data_source('shapes_bench', data_dir=...)` or `tfds.data_source('prompt_file/mine',
data_dir=...)` read them, even in a process that never imported this module (tfds then loads
from the files). Each dataset records a sha256 of its prompts (ShapesBench) or source files
(PromptFile) in its metadata, so a stale dataset is detected instead of silently reused.

`load_prompts(name, split, data_dir)` returns a `PromptSequence` (len / [i] -> str); name may
also be 'shapes' or a text file's path, and ShapesBench / file datasets are built on first use.
`PromptIterator` streams fixed-size batches over a sequence forever, reshuffling each epoch
from (seed, epoch); its state is one int, `position` (prompts consumed), so a checkpointed run
resumes at the same data position with `restore(position)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import inspect
import os
import re
import shutil
import tempfile
import unicodedata
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import numpy as np
import tensorflow_datasets as tfds
from etils import epath
from google.protobuf import message
from tensorflow_datasets.core.utils import tqdm_utils
from tensorflow_datasets.proto import tf_example_pb2

DEFAULT_MAX_CHARS = 512
PROMPT_FILE = "prompt_file"
_CONFIG_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_]*")
FILE_FORMAT = "array_record"
# Where prompt datasets go when config.data.data_dir is empty (else <workdir>/data): one folder
# that many runs share, so ShapesBench or a prompt file is prepared once, not once per workdir.
DATA_DIR_ENV = "DIGEN_DATA_DIR"


# Named prompt sets that tasks provide: name -> prepare(data_dir) (builds the dataset under
# data_dir if absent, checks a present one is current). Each task's module registers its own
# (register_prompt_set) when digen_jax.tasks is imported.
_PROMPT_SETS: dict[str, Callable[[str], str]] = {}
_ALIASES: dict[str, str] = {}


def register_prompt_set(name: str, prepare: Callable[[str], str], aliases: Sequence[str] = ()):
  """Makes load_prompts(name or an alias, ...) run prepare(data_dir) and read tfds dataset
  `name`."""
  _PROMPT_SETS[name] = prepare
  _ALIASES.update({a: name for a in aliases})


def registered_prompt_sets() -> list[str]:
  """The registered prompt sets' names and aliases."""
  return sorted({*_PROMPT_SETS, *_ALIASES})


def resolve_data_dir(configured: str, workdir: str) -> str:
  """The tfds data_dir of a run: config.data.data_dir, else $DIGEN_DATA_DIR, else
  <workdir>/data."""
  return configured or os.environ.get(DATA_DIR_ENV) or os.path.join(workdir, "data")


def sha256_texts(texts: Sequence[str]) -> str:
  h = hashlib.sha256()
  for t in texts:
    h.update(t.encode("utf-8") + b"\n")
  return h.hexdigest()


def _sha256_file(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


@contextlib.contextmanager
def _quiet_progress():
  """Turns tfds' progress bars off while building (restores the caller's setting)."""
  prev = getattr(tqdm_utils, "_active", True)
  tfds.display_progress_bar(False)
  try:
    yield
  finally:
    tfds.display_progress_bar(prev)


@contextlib.contextmanager
def exclusive(data_dir: str):
  """Holds an exclusive lock on data_dir (its file .prepare.lock): processes sharing a data_dir
  (a sweep's runs, $DIGEN_DATA_DIR) check and build a dataset one at a time, so each is built
  once and none reads another's half-written one."""
  os.makedirs(data_dir, exist_ok=True)
  with open(os.path.join(data_dir, ".prepare.lock"), "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def prepare_builder(builder: tfds.core.DatasetBuilder) -> None:
  # Downloads go to a throwaway dir: these builders download nothing, and tfds would otherwise
  # leave an empty <data_dir>/downloads behind.
  with _quiet_progress(), tempfile.TemporaryDirectory() as tmp:
    builder.download_and_prepare(
        download_dir=tmp,
        download_config=tfds.download.DownloadConfig(try_download_gcs=False),
    )


def module_code_path(cls) -> epath.Path:
  """Replacement for tfds' DatasetBuilder.code_path.

  tfds 4.9.10 evaluates `importlib_resources.abc.Traversable` there for any builder defined in
  a package, and that backport is not installed (nor needed on Python >= 3.9), so
  download_and_prepare fails with ModuleNotFoundError. tfds only uses code_path to look for a
  checksums file next to the code; our builders download nothing, so the module path serves.
  """
  return epath.Path(inspect.getfile(cls))


def is_prepared(path) -> bool:
  return os.path.isfile(os.path.join(os.fspath(path), "dataset_info.json"))


# ----------------------------------------------------------------------------- PromptFile


class PromptTooLong(ValueError):
  """A prompt file's line is longer than the limit the caller set (its message names the file,
  the line and the limit; the caller names the setting that raises it)."""


def read_prompt_file(path: str, max_chars: int = DEFAULT_MAX_CHARS) -> list[tuple[int, str]]:
  """[(1-based line, prompt)] of a UTF-8 text file with one prompt per line.

  Surrounding whitespace is stripped. ValueError naming the file and line for an empty line,
  a control character (a binary file) or a prompt longer than max_chars; for an empty or
  undecodable file.
  """
  if not isinstance(max_chars, int) or max_chars < 1:
    raise ValueError(f"max_chars={max_chars!r} must be a positive int")
  try:
    with open(path, "rb") as f:
      text = f.read().decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path}: not UTF-8 text ({e})") from e
  lines = text.split("\n")
  if lines and lines[-1] == "":
    lines.pop()  # the final newline terminates the last line, it does not start a new one
  if not lines:
    raise ValueError(f"{path}: no prompts (the file is empty)")
  out = []
  for i, raw in enumerate(lines, start=1):
    prompt = raw.strip()
    if not prompt:
      raise ValueError(f"{path}:{i}: empty line; remove it (one prompt per line)")
    # NUL and other control bytes decode as UTF-8 but are no prompt: a binary file that
    # happens to decode would otherwise train on garbage.
    bad = next((c for c in prompt if unicodedata.category(c) == "Cc" and c != "\t"), None)
    if bad is not None:
      raise ValueError(
          f"{path}:{i}: control character {bad!r} at column "
          f"{prompt.index(bad) + 1}; a prompt file is UTF-8 text, one prompt "
          "per line (is this a binary file?)"
      )
    if len(prompt) > max_chars:
      raise PromptTooLong(
          f"{path}:{i}: prompt has {len(prompt)} characters, more than max_chars={max_chars}"
      )
    out.append((i, prompt))
  return out


@dataclasses.dataclass(eq=False)
class PromptFileConfig(tfds.core.BuilderConfig):
  """files: split name -> path of its prompt file. max_chars: longest allowed prompt."""

  files: Mapping[str, str] = dataclasses.field(default_factory=dict)
  max_chars: int = DEFAULT_MAX_CHARS


class PromptFile(tfds.core.GeneratorBasedBuilder):
  """Prompts from user text files; configs are made per dataset by `build_prompt_file_dataset`."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  code_path = tfds.core.utils.classproperty(classmethod(module_code_path))
  BUILDER_CONFIGS: list = []

  def _info(self) -> tfds.core.DatasetInfo:
    cfg = self.builder_config
    return tfds.core.DatasetInfo(
        builder=self,
        # Keep generation order on disk (grammar / file line order); PromptIterator shuffles.
        disable_shuffling=True,
        description=f"Prompts from text files {dict(cfg.files)}.",
        features=tfds.features.FeaturesDict({"prompt": tfds.features.Text(), "line": np.int32}),
        metadata=tfds.core.MetadataDict(
            {
                "max_chars": cfg.max_chars,
                **{f"sha256_{k}": _sha256_file(v) for k, v in cfg.files.items()},
            }
        ),
    )

  def _split_generators(self, dl_manager):
    cfg = self.builder_config
    return {
        k: self._generate_examples(read_prompt_file(v, cfg.max_chars)) for k, v in cfg.files.items()
    }

  def _generate_examples(self, rows):
    for line, prompt in rows:
      yield line, {"prompt": prompt, "line": np.int32(line)}


def build_prompt_file_dataset(
    name: str,
    files: Mapping[str, str] | str,
    data_dir: str,
    max_chars: int = DEFAULT_MAX_CHARS,
    overwrite: bool = False,
) -> str:
  """Writes tfds dataset 'prompt_file/<name>' under data_dir; returns its directory.

  files: {split: path} or one path (split 'train'). All files are validated before anything
  is written. If the dataset exists and was built from identical files, it is reused; if the
  files changed, ValueError unless overwrite=True (which rebuilds it).
  """
  if not isinstance(name, str) or not _CONFIG_NAME_RE.fullmatch(name):
    raise ValueError(f"name={name!r} must match [a-z0-9][a-z0-9_]* (it becomes a tfds config name)")
  if isinstance(files, (str, os.PathLike)):
    files = {"train": files}
  if not files:
    raise ValueError("files must name at least one split's prompt file")
  files = {str(k): os.path.abspath(os.fspath(v)) for k, v in files.items()}
  for split, path in files.items():
    if not re.fullmatch(r"[a-z][a-z0-9_]*", split):
      raise ValueError(f"split name {split!r} must match [a-z][a-z0-9_]*")
    if not os.path.isfile(path):
      raise ValueError(f"prompt file for split {split!r} not found: {path}")
    read_prompt_file(path, max_chars)  # fail before writing anything
  cfg = PromptFileConfig(name=name, version=PromptFile.VERSION, files=files, max_chars=max_chars)
  builder = PromptFile(config=cfg, data_dir=os.fspath(data_dir), file_format=FILE_FORMAT)
  with exclusive(os.fspath(data_dir)):
    return _build_prompt_file(builder, files, max_chars, overwrite)


def _build_prompt_file(builder, files: Mapping[str, str], max_chars: int, overwrite: bool) -> str:
  """build_prompt_file_dataset's check-and-build, with data_dir locked."""
  name = builder.builder_config.name
  path = os.fspath(builder.data_path)
  if is_prepared(path):
    stored = tfds.builder_from_directory(path).info
    want = {f"sha256_{k}": _sha256_file(v) for k, v in files.items()}
    same = (
        set(stored.splits.keys()) == set(files)
        and all((stored.metadata or {}).get(k) == v for k, v in want.items())
        and (stored.metadata or {}).get("max_chars") == max_chars
    )
    if same:
      return path
    if not overwrite:
      raise ValueError(
          f"dataset prompt_file/{name} at {path} was built from different files "
          f"or settings; pass overwrite=True or choose another name"
      )
    shutil.rmtree(path)
  prepare_builder(builder)
  return path


# ----------------------------------------------------------------------------- loading


class PromptSequence(Sequence[str]):
  """Random-access prompts of one split: len(seq), seq[i] -> str, seq.record(i) -> dict.

  source: the split's tfds data source of serialized tf.Examples (DeserializeMethod.RAW_BYTES);
  features: the dataset's FeaturesDict. Prompts are parsed from the serialized record alone
  (one field: ~10x faster than tfds decoding every feature, which a run's full read of its
  prompts spent ~0.35 s on); record(i) decodes every feature. A record that cannot be read
  (a file cut short) is None."""

  def __init__(self, source, features, field: str = "prompt"):
    self.source = source
    self.features = features
    self.field = field

  def __len__(self) -> int:
    return len(self.source)

  @staticmethod
  def _decode(v):
    return v.decode("utf-8") if isinstance(v, bytes) else v

  def _text(self, raw) -> str | None:
    if not raw:
      return None
    try:
      value = tf_example_pb2.Example.FromString(raw).features.feature[self.field].bytes_list.value
    except message.DecodeError as e:
      raise ValueError(f"a record is not a serialized tf.Example: {e}") from None
    return value[0].decode("utf-8") if value else None

  def _index(self, i) -> int:
    n = len(self)
    i = int(i)
    if not -n <= i < n:
      raise IndexError(f"index {i} out of range for {n} prompts")
    return i % n

  def __getitem__(self, i):
    if isinstance(i, slice):
      return self.get_batch(range(*i.indices(len(self))))
    return self._text(self.source[self._index(i)])

  def __iter__(self):
    # In batches: the record source reads one record per call much slower than many at once.
    for start in range(0, len(self), 4096):
      yield from self.get_batch(range(start, min(start + 4096, len(self))))

  def get_batch(self, indices: Sequence[int]) -> list[str]:
    return [self._text(r) for r in self.source.__getitems__([self._index(i) for i in indices])]

  def record(self, i: int) -> dict[str, Any]:
    r = self.features.deserialize_example_np(self.source[self._index(i)])
    return {
        k: self._decode(v.item() if isinstance(v, np.ndarray) and v.ndim == 0 else v)
        for k, v in r.items()
    }


def _file_dataset_name(path: str) -> str:
  """'prompt_file/<stem>_<content hash>' for a prompt file given by path: editing the file gives
  a new dataset instead of silently changing (or refusing) an existing one."""
  stem = re.sub(r"[^a-z0-9_]+", "_", os.path.splitext(os.path.basename(path))[0].lower()).strip("_")
  return f"{stem or 'prompts'}_{_sha256_file(path)[:12]}"


def load_prompts(
    name: str, split: str, data_dir: str, max_chars: int = DEFAULT_MAX_CHARS
) -> PromptSequence:
  """Prompts of `split` of a prompt dataset under data_dir.

  name: 'shapes_bench' (alias 'shapes'; built on first use), 'prompt_file/<x>' (built earlier
  by `build_prompt_file_dataset`), or the path of a text file with one prompt per line, which
  becomes dataset 'prompt_file/<stem>_<content hash>' with the single split 'train' (built on
  first use, validated with max_chars).
  """
  data_dir = os.fspath(data_dir)
  name = _ALIASES.get(name, name)
  if name in _PROMPT_SETS:
    _PROMPT_SETS[name](data_dir)
  elif os.path.isfile(name) or (
      not name.startswith(PROMPT_FILE + "/") and (name.endswith(".txt") or os.sep in name)
  ):
    if not os.path.isfile(name):
      raise ValueError(
          f"prompt file {name!r} not found (give 'shapes', 'prompt_file/<name>' "
          "or the path of a text file with one prompt per line)"
      )
    auto = _file_dataset_name(name)
    build_prompt_file_dataset(auto, {"train": name}, data_dir, max_chars=max_chars)
    name = f"{PROMPT_FILE}/{auto}"
  else:
    dataset_root = os.path.join(data_dir, *name.split("/"))
    has_version = os.path.isdir(dataset_root) and any(
        is_prepared(os.path.join(dataset_root, v)) for v in os.listdir(dataset_root)
    )
    if not has_version:
      hint = (
          f"; build it with build_prompt_file_dataset({name.split('/', 1)[1]!r}, ...)"
          if name.startswith(PROMPT_FILE + "/")
          else ""
      )
      raise ValueError(
          f"no prepared tfds dataset {name!r} under data_dir={data_dir}{hint} (config.data.prompts: "
          f"a registered prompt set {registered_prompt_sets()}, a prompt file's path, or a "
          "prepared tfds dataset)"
      )
  sources = tfds.data_source(
      name,
      data_dir=data_dir,
      download=False,
      deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES,
  )
  if split not in sources:
    raise ValueError(f"dataset {name!r} has no split {split!r}; splits: {sorted(sources)}")
  return PromptSequence(sources[split], sources[split].dataset_info.features)


class PromptIterator(Iterator[list[str]]):
  """Endless batches of `batch_prompts` prompts; each epoch is a fresh permutation.

  Epoch e uses permutation default_rng([seed, e]) of range(len(source)); batches run straight
  across epoch boundaries. The whole state is `position` (prompts consumed so far), so
  `restore(position)` on a new iterator with the same source/seed replays the same stream.
  """

  def __init__(self, source: Sequence[str], batch_prompts: int, seed: int = 0):
    if len(source) == 0:
      raise ValueError("source has no prompts")
    if not isinstance(batch_prompts, (int, np.integer)) or batch_prompts < 1:
      raise ValueError(f"batch_prompts={batch_prompts!r} must be a positive int")
    self.source, self.batch_prompts, self.seed = source, int(batch_prompts), int(seed)
    self._n = len(source)
    self._position = 0
    self._perm_epoch: Optional[int] = None
    self._perm: Optional[np.ndarray] = None

  @property
  def position(self) -> int:
    return self._position

  @property
  def epoch(self) -> int:
    return self._position // self._n

  def restore(self, position: int) -> None:
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
      raise ValueError(f"position={position!r} must be a non-negative int")
    self._position = int(position)

  def _permutation(self, epoch: int) -> np.ndarray:
    if self._perm_epoch != epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(self._n)
      self._perm_epoch = epoch
    return self._perm

  def indices(self, start: int, count: int) -> list[int]:
    """Source indices of stream positions start .. start + count - 1."""
    return [int(self._permutation(p // self._n)[p % self._n]) for p in range(start, start + count)]

  def __iter__(self) -> "PromptIterator":
    return self

  def next_batch(self) -> list[str]:
    """The next `batch_prompts` prompts (same as next(iterator))."""
    return next(self)

  def __next__(self) -> list[str]:
    idx = self.indices(self._position, self.batch_prompts)
    get_batch = getattr(self.source, "get_batch", None)
    batch = get_batch(idx) if get_batch is not None else [self.source[i] for i in idx]
    self._position += self.batch_prompts
    return list(batch)
