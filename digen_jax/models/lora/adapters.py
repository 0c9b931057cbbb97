"""LoRA adapters for the MMDiT as pure functions over parameter trees, saved in diffusers naming.

An adapter on a Linear kernel W [in, out] is a pair A [in, r], B [r, out]; the model runs on
W' = W + (alpha / r) * A @ B (PEFT's `W + scaling * lora_B @ lora_A` in our [in, out] layout).
Stacked block kernels [L, in, out] get stacked adapters A [L, in, r], B [L, r, out]. The base is
never an argument of jax.grad: programs call `merge(base, adapters, cfg)` and run the ordinary
forward on the result.

    cfg = LoraConfig(rank=16, alpha=16.0, targets=ATTENTION_TARGETS)
    table = convert.diffusers_key_table(model_config)
    paths = target_paths(abstract_base, table, cfg)   # ['blocks.attn.add_k_proj.kernel', ...]
    adapters = init_adapters(abstract_base, paths, cfg, jax.random.key(0))
    out = nnx.merge(graphdef, merge(base, adapters, cfg))(latents, sigma, text, mask, img_shape=...)
    save_diffusers_lora(folder, adapters, cfg, table)     # pipe.load_lora_weights(folder) reads it

Targets are chosen by diffusers module names (the weight key minus ".weight", e.g.
"transformer_blocks.3.attn.to_q") with `re.search` (PEFT re.fullmatch-es a string
`target_modules`; here "to_q|to_k" is enough, add "$" to stop a prefix match). A stacked kernel
holds one module per layer; adapters cover whole stacks, so a pattern must match every layer of
a stack or none.

Files: `pytorch_lora_weights.safetensors` holding "transformer.<module>.lora_A.weight" [r, in]
and "...lora_B.weight" [out, r] (float32), and in the safetensors metadata diffusers' own
"lora_adapter_metadata" (a PEFT LoraConfig: r, lora_alpha, target_modules), which diffusers'
QwenImage loader passes to PEFT, so alpha != r loads with the right scale. We write no ".alpha"
keys: diffusers' QwenImage loader folds those into the weights AND would still apply the
metadata's lora_alpha (double scaling). Tools that ignore the metadata see scale 1 (alpha = r).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from pathlib import Path
import re
import tempfile
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: files from other tools may be bf16)
import numpy as np
from safetensors import numpy as safetensors_numpy
from safetensors import safe_open

from digen_jax.models.io.tensor_source import KeyTable

# diffusers' names (diffusers.loaders.lora_base: LORA_WEIGHT_NAME_SAFE, LORA_ADAPTER_METADATA_KEY).
WEIGHT_NAME = 'pytorch_lora_weights.safetensors'
DIFFUSERS_METADATA_KEY = 'lora_adapter_metadata'
# diffusers' QwenImageLoraLoaderMixin.transformer_name: every key starts with "transformer.".
PREFIX = 'transformer'
# Our own metadata entry (diffusers ignores it): the config that made the file, targets included.
OUR_METADATA_KEY = 'digen_jax_lora'
# The attention projections of both streams, the usual LoRA targets for QwenImage.
ATTENTION_TARGETS = r'attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$'

Adapters = dict[str, dict[str, Any]]  # {kernel path: {'a': [..., in, r], 'b': [..., r, out]}}

_KEY_RE = re.compile(r'^' + PREFIX + r'\.(.+)\.lora_(A|B)\.weight$')


def _field(name: str) -> str:
  return f'config.model.lora.{name}'


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank r >= 1; alpha > 0 (the update is scaled by alpha / r); targets: a regex searched in
  diffusers module names; dropout: must be 0 (adapters are merged into the weights, which leaves
  no per-activation path to drop)."""

  rank: int
  alpha: float
  targets: str
  dropout: float = 0.0

  def __post_init__(self):
    if not isinstance(self.rank, (int, np.integer)) or isinstance(self.rank, bool) or self.rank < 1:
      raise ValueError(
          f'{_field("rank")} must be an int >= 1, got {self.rank!r} '
          '(LoRA is off when the config asks for rank 0)'
      )
    if (
        not isinstance(self.alpha, (int, float, np.integer, np.floating))
        or isinstance(self.alpha, bool)
        or not math.isfinite(self.alpha)
        or self.alpha <= 0
    ):
      raise ValueError(
          f'{_field("alpha")} must be a finite number > 0, got {self.alpha!r} '
          f'(alpha = rank gives scale 1)'
      )
    if not isinstance(self.targets, str) or not self.targets:
      raise ValueError(
          f'{_field("targets")} must be a non-empty regex string, got '
          f'{self.targets!r}; e.g. {ATTENTION_TARGETS!r}'
      )
    try:
      re.compile(self.targets)
    except re.error as e:
      raise ValueError(f'{_field("targets")}={self.targets!r} is not a valid regex: {e}') from e
    if self.dropout != 0:
      raise ValueError(
          f'{_field("dropout")}={self.dropout!r}: only 0 is supported (adapters are '
          'merged into the weights); set it to 0'
      )
    object.__setattr__(self, 'rank', int(self.rank))
    object.__setattr__(self, 'alpha', float(self.alpha))

  @property
  def scale(self) -> float:
    """alpha / rank, the factor on A @ B."""
    return self.alpha / self.rank


# ------------------------------------------------------------------------------------------------
# Paths and modules.


def _path_str(path) -> str:
  """A jax key path as our dotted param path (nnx.Variable's trailing `.value` dropped)."""
  parts = []
  for i, k in enumerate(path):
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      if not (k.name == 'value' and i == len(path) - 1):
        parts.append(k.name)
    else:
      parts.append(str(k))
  return '.'.join(parts)


def _flat(params) -> dict[str, Any]:
  """{dotted path: leaf} of an nnx.State, a nested dict or a flat {path: leaf} dict."""
  return {_path_str(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params)}


def _table_kernels(table: KeyTable) -> dict[str, tuple[str, ...]]:
  """Linear kernels of a key table: our path -> diffusers module names (one per layer)."""
  out = {}
  for path, src in table.items():
    if (
        path.endswith('.kernel')
        and src.perm == (1, 0)
        and all(k.endswith('.weight') for k in src.keys)
    ):
      out[path] = tuple(k[: -len('.weight')] for k in src.keys)
  return out


def _linear_kernels(flat: Mapping[str, Any], table: KeyTable) -> dict[str, tuple[str, ...]]:
  """The table's Linear kernels that `flat` holds as 2-D (3-D when stacked) arrays."""
  return {
      p: mods
      for p, mods in _table_kernels(table).items()
      if p in flat and len(flat[p].shape) == 2 + table[p].stacked
  }


def _layer_pattern(modules: tuple[str, ...]) -> str:
  """An anchored regex for one kernel's modules, a varying layer index written as \\d+."""
  cols = zip(*(m.split('.') for m in modules))
  return r'\.'.join(re.escape(c[0]) if len(set(c)) == 1 else r'\d+' for c in cols)


def _match(kernels: Mapping[str, tuple[str, ...]], cfg: LoraConfig) -> list[str]:
  """Sorted paths whose modules all match cfg.targets; ValueError for none or part of a stack."""
  pattern = re.compile(cfg.targets)
  paths, partial = [], []
  for path, modules in sorted(kernels.items()):
    hits = [m for m in modules if pattern.search(m)]
    if len(hits) == len(modules):
      paths.append(path)
    elif hits:
      missed = [m for m in modules if not pattern.search(m)]
      partial.append(
          f'{path} ({len(hits)} of {len(modules)} layers: matches {hits[0]}, ' f'not {missed[0]})'
      )
  if partial:
    raise ValueError(
        f'{_field("targets")}={cfg.targets!r} matches only some layers of stacked kernels: '
        f'{"; ".join(partial)}. Adapters here cover whole stacks of layers (one adapter with a '
        f'layer axis per kernel): match every transformer_blocks.<i> of a module or none'
    )
  if not paths:
    examples = sorted({m for mods in kernels.values() for m in mods[:1]})
    raise ValueError(
        f'{_field("targets")}={cfg.targets!r} matches no Linear module (re.search on diffusers '
        f'module names). Names it could match: {", ".join(examples)} (block modules exist for '
        f'every transformer_blocks.<i>); e.g. {ATTENTION_TARGETS!r}'
    )
  return paths


def target_paths(abstract_params, table: KeyTable, cfg: LoraConfig) -> list[str]:
  """Sorted kernel paths (e.g. 'blocks.attn.to_q.kernel') whose diffusers module names match
  cfg.targets. abstract_params: nnx.State or dict of arrays / ShapeDtypeStructs; table:
  convert.diffusers_key_table(config). Only Linear kernels (2-D, 3-D stacked) are eligible."""
  kernels = _linear_kernels(_flat(abstract_params), table)
  if not kernels:
    raise ValueError(
        'no Linear kernel of the params appears in the key table (a table for ' 'another model?)'
    )
  return _match(kernels, cfg)


# ------------------------------------------------------------------------------------------------
# Init and merge.


def _kernel_shape(flat: Mapping[str, Any], path: str) -> tuple[int, ...]:
  if path not in flat:
    raise ValueError(
        f'LoRA target {path!r} is not a param path (e.g. '
        f'{next(iter(sorted(flat)), "?")!r}); take paths from lora.target_paths'
    )
  shape = tuple(flat[path].shape)
  if not path.endswith('.kernel') or len(shape) not in (2, 3):
    raise ValueError(
        f'LoRA target {path!r} has shape {shape}; only Linear kernels (".kernel") '
        '[in, out] or stacked [layers, in, out] take adapters'
    )
  return shape


def init_adapters(abstract_params, paths, cfg: LoraConfig, key: jax.Array) -> Adapters:
  """{path: {'a': [..., in, r], 'b': [..., r, out]}} float32 ('...' = the layer axis of stacked
  kernels). A ~ U(-1/sqrt(in), 1/sqrt(in)) like PEFT's default (kaiming_uniform_(a=sqrt(5)) on
  torch's [r, in]); B = 0, so the merged model starts equal to the base. The values depend on
  `key` and on the set of paths (one draw, cut in sorted path order)."""
  flat = _flat(abstract_params)
  paths = sorted(paths)
  if len(set(paths)) != len(paths):
    raise ValueError(f'LoRA target paths repeat: {paths}')
  shapes = tuple((p, _kernel_shape(flat, p)) for p in paths)
  return _init(key, shapes, cfg.rank)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _init(key, shapes, rank):
  # One uniform draw cut into pieces: one random-bits op to compile instead of one per adapter.
  sizes = [math.prod(shape[:-1]) * rank for _, shape in shapes]
  u = jax.random.uniform(key, (sum(sizes),), jnp.float32, -1.0, 1.0)
  out, start = {}, 0
  for size, (path, (*lead, n_in, n_out)) in zip(sizes, shapes):
    a = u[start : start + size].reshape(*lead, n_in, rank) * np.float32(1.0 / math.sqrt(n_in))
    out[path] = {'a': a, 'b': jnp.zeros((*lead, rank, n_out), jnp.float32)}
    start += size
  return out


@jax.custom_jvp
def _add_delta(w: jax.Array, delta: jax.Array) -> jax.Array:
  """w + delta, except w itself where delta == 0: -0.0 + 0.0 is +0.0, so a plain add would not
  return W bit for bit when B = 0. The derivative is that of w + delta."""
  return jnp.where(delta == 0, w, w + delta)


@_add_delta.defjvp
def _add_delta_jvp(primals, tangents):
  return _add_delta(*primals), tangents[0] + tangents[1]


def _check_adapters(flat: Mapping[str, Any], adapters: Adapters, cfg: LoraConfig) -> None:
  for path in sorted(adapters):
    entry = adapters[path]
    *lead, n_in, n_out = _kernel_shape(flat, path)
    if not isinstance(entry, Mapping) or set(entry) != {'a', 'b'}:
      raise ValueError(
          f'adapter {path!r} must be a dict with keys "a" and "b", got '
          f'{sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__}'
      )
    want = {'a': (*lead, n_in, cfg.rank), 'b': (*lead, cfg.rank, n_out)}
    got = {n: tuple(entry[n].shape) for n in ('a', 'b')}
    if got != want:
      raise ValueError(
          f'adapter {path!r} has shapes a {got["a"]}, b {got["b"]}; the kernel '
          f'{tuple(flat[path].shape)} with {_field("rank")}={cfg.rank} needs '
          f'a {want["a"]}, b {want["b"]}'
      )


def merge(params, adapters: Adapters, cfg: LoraConfig):
  """`params` (nnx.State or dict, same structure returned) with each adapted kernel W replaced by
  W + scale * A @ B, computed in float32 and cast to W's dtype; B = 0 returns W bit for bit.
  Pure and jittable; differentiable in the adapters (and in W)."""
  _check_adapters(_flat(params), adapters, cfg)
  scale = np.float32(cfg.scale)

  def one(path, w):
    entry = adapters.get(_path_str(path))
    if entry is None:
      return w
    a, b = entry['a'].astype(jnp.float32), entry['b'].astype(jnp.float32)
    # HIGHEST: float32 matmul on accelerators too (their default may use bf16 passes).
    delta = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST) * scale
    return _add_delta(w.astype(jnp.float32), delta).astype(w.dtype)

  return jax.tree_util.tree_map_with_path(one, params)


# ------------------------------------------------------------------------------------------------
# Manifests.


def _digest(entry: Mapping[str, Any]) -> str:
  h = hashlib.sha256()
  for name in ('a', 'b'):
    x = np.ascontiguousarray(np.asarray(entry[name]))
    h.update(f'{name}:{x.dtype.name}:{x.shape};'.encode())
    h.update(x.tobytes())
  return h.hexdigest()


def manifest(adapters: Adapters, *, digest: bool = True) -> dict[str, dict[str, Any]]:
  """{path: {'a': {'shape', 'dtype'}, 'b': {...}, 'sha256': hex or None}}, JSON-ready. The digest
  covers names, shapes, dtypes and values (host copy of the arrays); it is None when `digest` is
  False or the leaves are ShapeDtypeStructs (an expectation of names and shapes only)."""
  out = {}
  for path in sorted(adapters):
    entry = adapters[path]
    abstract = any(isinstance(entry[n], jax.ShapeDtypeStruct) for n in ('a', 'b'))
    out[path] = {
        n: {'shape': [int(d) for d in entry[n].shape], 'dtype': jnp.dtype(entry[n].dtype).name}
        for n in ('a', 'b')
    }
    out[path]['sha256'] = _digest(entry) if digest and not abstract else None
  return out


def check_manifest(expected: Mapping[str, Any], got: Mapping[str, Any]) -> None:
  """ValueError listing adapters missing from `got`, unexpected in it, with other shapes or
  dtypes, or with other values (sha256; skipped where either side has None)."""
  missing = sorted(set(expected) - set(got))
  unexpected = sorted(set(got) - set(expected))
  shapes, values = [], []
  for path in sorted(set(expected) & set(got)):
    e, g = expected[path], got[path]
    if any(e[n] != g[n] for n in ('a', 'b')):
      shapes.append(f'{path} (expected a {e["a"]}, b {e["b"]}; got a {g["a"]}, b {g["b"]})')
    elif e['sha256'] is not None and g['sha256'] is not None and e['sha256'] != g['sha256']:
      values.append(path)
  problems = [
      f'{title} ({len(items)}): {", ".join(items)}'
      for title, items in (
          ('missing', missing),
          ('unexpected', unexpected),
          ('wrong shape or dtype', shapes),
          ('different values (sha256)', values),
      )
      if items
  ]
  if problems:
    raise ValueError('LoRA adapters do not match the expected manifest: ' + '; '.join(problems))


def num_bytes(adapters: Adapters) -> int:
  """Bytes of all adapter arrays (ShapeDtypeStructs count as their arrays would)."""
  return int(
      sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(adapters))
  )


# ------------------------------------------------------------------------------------------------
# diffusers files.


def save_diffusers_lora(folder, adapters: Adapters, cfg: LoraConfig, table: KeyTable) -> Path:
  """Writes folder/pytorch_lora_weights.safetensors (atomically: temp file + rename) for
  `QwenImagePipeline.load_lora_weights(folder)`; returns its path. Keys
  "transformer.<module>.lora_A.weight" [r, in] and ".lora_B.weight" [out, r], float32."""
  kernels = _table_kernels(table)
  tensors, modules = {}, []
  for path in sorted(adapters):
    if path not in kernels:
      raise ValueError(
          f'adapter {path!r} is not a Linear kernel of the key table; it has no '
          'diffusers module name'
      )
    a, b = (np.asarray(adapters[path][n], np.float32) for n in ('a', 'b'))
    names = kernels[path]
    lead = (len(names),) if table[path].stacked else ()
    if (
        a.ndim != len(lead) + 2
        or a.shape[:-2] != lead
        or a.shape[-1] != cfg.rank
        or b.shape != (*lead, cfg.rank, b.shape[-1])
    ):
      raise ValueError(
          f'adapter {path!r} has shapes a {a.shape}, b {b.shape}; expected '
          f'a [{", ".join(map(str, lead + ("in",)))}, {cfg.rank}], '
          f'b [{", ".join(map(str, lead))}{", " if lead else ""}{cfg.rank}, out] '
          f'({_field("rank")}={cfg.rank})'
      )
    for i, module in enumerate(names):
      ai, bi = (a[i], b[i]) if lead else (a, b)
      tensors[f'{PREFIX}.{module}.lora_A.weight'] = np.ascontiguousarray(ai.T)
      tensors[f'{PREFIX}.{module}.lora_B.weight'] = np.ascontiguousarray(bi.T)
      modules.append(module)
  if not tensors:
    raise ValueError('no adapters to save')
  # A PEFT LoraConfig's fields, "transformer."-prefixed as diffusers' save_lora_weights writes
  # them; its loader strips the prefix and calls peft.LoraConfig(**fields).
  peft_fields = {
      'r': cfg.rank,
      'lora_alpha': cfg.alpha,
      'target_modules': sorted(modules),
      'lora_dropout': 0.0,
      'bias': 'none',
      'use_rslora': False,
      'use_dora': False,
      'lora_bias': False,
  }
  metadata = {
      'format': 'pt',
      DIFFUSERS_METADATA_KEY: json.dumps(
          {f'{PREFIX}.{k}': v for k, v in peft_fields.items()}, indent=2, sort_keys=True
      ),
      OUR_METADATA_KEY: json.dumps({'rank': cfg.rank, 'alpha': cfg.alpha, 'targets': cfg.targets}),
  }
  data = safetensors_numpy.save(tensors, metadata=metadata)
  folder = Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  target = folder / WEIGHT_NAME
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f'.{WEIGHT_NAME}.', suffix='.tmp')
  try:
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, target)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise
  return target


def _read_metadata(meta: Mapping[str, str], file: Path) -> tuple[dict, dict]:
  """(PEFT LoraConfig fields without the prefix, our config dict); empty dicts when absent."""
  out = []
  for key in (DIFFUSERS_METADATA_KEY, OUR_METADATA_KEY):
    try:
      out.append(json.loads(meta[key]) if meta.get(key) else {})
    except ValueError as e:
      raise ValueError(f'{file}: metadata {key!r} is not JSON: {e}') from e
  peft = {k[len(PREFIX) + 1 :]: v for k, v in out[0].items() if k.startswith(PREFIX + '.')}
  return peft, out[1]


def load_diffusers_lora(
    folder, table: KeyTable
) -> tuple[dict[str, dict[str, np.ndarray]], LoraConfig]:
  """(adapters as float32 numpy arrays, their LoraConfig) from folder/pytorch_lora_weights
  .safetensors written by save_diffusers_lora or by diffusers' save_lora_weights (PEFT-format
  transformer LoRA). Alpha comes from diffusers' metadata (absent: alpha = r, diffusers' rule)."""
  file = Path(folder) / WEIGHT_NAME
  if not file.is_file():
    raise FileNotFoundError(f'no {WEIGHT_NAME} in {folder}')
  try:
    with safe_open(str(file), framework='np') as handle:
      tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # adapters are small
      meta = handle.metadata() or {}
  except Exception as e:  # noqa: BLE001 - safetensors raises several types; report them uniformly
    raise ValueError(f'cannot read safetensors file {file}: {e}') from e
  peft, ours = _read_metadata(meta, file)
  if not tensors:
    raise ValueError(f'{file} holds no tensors')
  kernels = _table_kernels(table)
  adapters = _adapters_from_tensors(file, tensors, kernels, table)
  paths = sorted(adapters)
  cfg = _config_from_file(file, adapters, peft, ours, kernels)
  if _match(kernels, cfg) != paths:
    raise ValueError(
        f'{file}: targets {cfg.targets!r} in its metadata select '
        f'{_match(kernels, cfg)}, but the file holds adapters for {paths}'
    )
  return adapters, cfg


def _lora_modules(file: Path, tensors: Mapping[str, Any]) -> dict[str, dict[str, str]]:
  """{diffusers module: {'A': key, 'B': key}} of a file's tensors; ValueError for a key of another
  format or a module without both halves."""
  by_module: dict[str, dict[str, str]] = {}
  bad = []
  for k in tensors:
    m = _KEY_RE.match(k)
    if m:
      by_module.setdefault(m.group(1), {})[m.group(2)] = k
    else:
      bad.append(k)
  if bad:
    raise ValueError(
        f'{file}: keys that are not "{PREFIX}.<module>.lora_A/lora_B.weight": '
        f'{sorted(bad)[:10]}{" ..." if len(bad) > 10 else ""} (other LoRA formats: '
        f'load the file with diffusers and save it again with save_lora_weights)'
    )
  unpaired = sorted(m for m, ab in by_module.items() if set(ab) != {'A', 'B'})
  if unpaired:
    raise ValueError(f'{file}: modules without both lora_A and lora_B: {unpaired[:10]}')
  return by_module


def _adapters_from_tensors(
    file: Path,
    tensors: Mapping[str, Any],
    kernels: Mapping[str, tuple[str, ...]],
    table: KeyTable,
) -> dict[str, dict[str, np.ndarray]]:
  """The file's lora_A / lora_B tensors as our adapters {kernel path: {'a', 'b'}} (float32, our
  [in, r] / [r, out] layout, stacked over the layers of stacked kernels)."""
  by_module = _lora_modules(file, tensors)
  where = {m: (path, i) for path, mods in kernels.items() for i, m in enumerate(mods)}
  unknown = sorted(m for m in by_module if m not in where)
  if unknown:
    raise ValueError(
        f'{file}: LoRA modules that are not Linear layers of this model: '
        f'{unknown[:10]} (a LoRA for another architecture or size?)'
    )
  adapters = {}
  for path in sorted({where[m][0] for m in by_module}):
    mods = kernels[path]
    absent = [m for m in mods if m not in by_module]
    if absent:
      raise ValueError(
          f'{file}: has adapters for only {len(mods) - len(absent)} of {len(mods)} '
          f'layers of {path} (missing {absent[0]}, ...); adapters here cover whole '
          'stacks of layers'
      )
    a = [np.asarray(tensors[by_module[m]['A']], np.float32).T for m in mods]
    b = [np.asarray(tensors[by_module[m]['B']], np.float32).T for m in mods]
    if table[path].stacked:
      try:
        adapters[path] = {'a': np.stack(a), 'b': np.stack(b)}
      except ValueError as e:
        raise ValueError(f'{file}: the layers of {path} have different adapter shapes: {e}') from e
    else:
      adapters[path] = {'a': a[0], 'b': b[0]}
  return adapters


def _config_from_file(
    file: Path,
    adapters: Mapping[str, Mapping[str, np.ndarray]],
    peft: Mapping[str, Any],
    ours: Mapping[str, Any],
    kernels: Mapping[str, tuple[str, ...]],
) -> LoraConfig:
  """The LoraConfig of a file's adapters: their one rank, alpha from diffusers' metadata (absent:
  alpha = r), targets from our metadata or else matching exactly the adapted modules. ValueError
  for what plain LoRA here cannot load or for metadata that disagrees with the weights."""
  ranks = {ad['a'].shape[-1] for ad in adapters.values()} | {
      ad['b'].shape[-2] for ad in adapters.values()
  }
  if len(ranks) != 1:
    raise ValueError(f'{file}: adapters have several ranks {sorted(ranks)}; one rank is supported')
  rank = ranks.pop()
  if peft.get('r', rank) != rank:
    raise ValueError(f'{file}: metadata says r={peft["r"]} but the weights have rank {rank}')
  for field in ('rank_pattern', 'alpha_pattern'):
    if peft.get(field):
      raise ValueError(f'{file}: per-module {field} {peft[field]} is not supported')
  for field in ('use_dora', 'use_rslora', 'lora_bias'):
    if peft.get(field):
      raise ValueError(f'{file}: {field}=True is not supported (plain LoRA only)')
  targets = ours.get('targets') or (
      '^(?:' + '|'.join(_layer_pattern(kernels[p]) for p in sorted(adapters)) + ')$'
  )
  cfg = LoraConfig(rank=rank, alpha=float(peft.get('lora_alpha', rank)), targets=targets)
  if ours and (ours.get('rank'), ours.get('alpha')) != (cfg.rank, cfg.alpha):
    raise ValueError(
        f'{file}: our metadata (rank {ours.get("rank")}, alpha {ours.get("alpha")}) '
        f"disagrees with diffusers' (r {cfg.rank}, lora_alpha {cfg.alpha})"
    )
  return cfg
