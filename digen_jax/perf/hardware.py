"""Accelerator figures for the time model, each with its public source, and cluster specs.

Units: FLOP/s and bytes/s, memory in bytes. Bandwidths are per device and per direction: a
vendor's bidirectional NVLink / ICI figure is halved (what one device can send while it also
receives, the quantity ring collectives and point-to-point copies are limited by). Peak compute
is dense bf16 (no 2:4 sparsity). `inter_node_bw` is the NIC bandwidth per device of the usual
system built around the part; where no vendor system fixes it, the figure is an assumption and
its source says so.

Extend it with `register(Accelerator(...))` or `load_json(path)` (a list of objects with the
Accelerator fields, bandwidths in bytes/s; `aliases` optional).

What fraction of these peaks an engine's programs reach: perf/calibrations.py.

    parse_cluster('8xH100+8xH20') -> (ClusterPart(8, H100 SXM), ClusterPart(8, H20))
"""

from __future__ import annotations

import dataclasses
import json
import re

TERA = 1e12
GB = 1e9  # vendors quote decimal GB/s and GB
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """One accelerator kind."""

  name: str
  peak_bf16_flops: float  # dense bf16 FLOP/s
  hbm_bw: float  # device memory bytes/s
  memory_bytes: int  # device memory
  intra_node_bw: float  # device-to-device inside a node (NVLink / ICI / PCIe), one direction
  inter_node_bw: float  # per device across nodes (NIC / DCN), one direction
  host_bw: float  # device <-> host memory (PCIe), one direction: offload traffic
  source: str  # where the figures come from
  aliases: tuple[str, ...] = ()

  def __post_init__(self):
    for field in (
        'peak_bf16_flops',
        'hbm_bw',
        'memory_bytes',
        'intra_node_bw',
        'inter_node_bw',
        'host_bw',
    ):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f'Accelerator {self.name!r}: {field} must be > 0, got {value!r}')


PCIE5_X16 = 64 * GB  # PCIe 5.0 x16: 128 GB/s both directions together
PCIE4_X16 = 32 * GB  # PCIe 4.0 x16: 64 GB/s both directions together
NDR_400G = 50 * GB  # ConnectX-7 400 Gb/s InfiniBand NDR, one NIC per GPU in DGX/HGX H100/H200
HDR_200G = 25 * GB  # ConnectX-6 200 Gb/s InfiniBand HDR, one NIC per GPU in DGX A100

_BUILTIN = (
    Accelerator(
        'H100 SXM',
        peak_bf16_flops=989.4 * TERA,
        hbm_bw=3.35e12,
        memory_bytes=80 * 10**9,
        intra_node_bw=450 * GB,
        inter_node_bw=NDR_400G,
        host_bw=PCIE5_X16,
        source='NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/): '
        'SXM BF16 1,979 TFLOPS with sparsity (989.4 dense), 80 GB HBM3 3.35 TB/s, NVLink '
        '900 GB/s, PCIe Gen5 128 GB/s; DGX H100 user guide: 8x ConnectX-7 400 Gb/s.',
        aliases=('h100', 'h100sxm', 'h100-sxm', 'h100_sxm'),
    ),
    Accelerator(
        'H200',
        peak_bf16_flops=989.4 * TERA,
        hbm_bw=4.8e12,
        memory_bytes=141 * 10**9,
        intra_node_bw=450 * GB,
        inter_node_bw=NDR_400G,
        host_bw=PCIE5_X16,
        source='NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/): '
        'SXM BF16 1,979 TFLOPS with sparsity, 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s, '
        'PCIe Gen5 128 GB/s; HGX H200 with 400 Gb/s NDR per GPU.',
        aliases=('h200', 'h200sxm', 'h200-sxm'),
    ),
    Accelerator(
        'H800',
        peak_bf16_flops=989.4 * TERA,
        hbm_bw=3.35e12,
        memory_bytes=80 * 10**9,
        intra_node_bw=200 * GB,
        inter_node_bw=NDR_400G,
        host_bw=PCIE5_X16,
        source="NVIDIA H800 SXM5 (the H100 SXM5's compute and memory with NVLink cut to 400 GB/s "
        "both directions; NVIDIA HGX H800 as reported, e.g. Tom's Hardware, Mar 2023): BF16 "
        '989.4 TFLOPS dense, 80 GB HBM3 3.35 TB/s, PCIe Gen5; NIC: assumed 400 Gb/s as HGX H100.',
        aliases=('h800', 'h800sxm', 'h800-sxm'),
    ),
    Accelerator(
        'H20',
        peak_bf16_flops=148 * TERA,
        hbm_bw=4.0e12,
        memory_bytes=96 * 10**9,
        intra_node_bw=450 * GB,
        inter_node_bw=NDR_400G,
        host_bw=PCIE5_X16,
        source='NVIDIA HGX H20 product brief as reported (no public nvidia.com datasheet; e.g. '
        'SemiAnalysis "Nvidia\'s New China AI Chips", Nov 2023): BF16 148 TFLOPS dense, '
        '96 GB HBM3 4.0 TB/s, NVLink 900 GB/s, PCIe Gen5; NIC: assumed 400 Gb/s as '
        'HGX H100.',
        aliases=('h20',),
    ),
    Accelerator(
        'A100 80GB',
        peak_bf16_flops=312 * TERA,
        hbm_bw=2.039e12,
        memory_bytes=80 * 10**9,
        intra_node_bw=300 * GB,
        inter_node_bw=HDR_200G,
        host_bw=PCIE4_X16,
        source='NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/a100/): '
        'BF16 312 TFLOPS dense (624 sparse), 80GB HBM2e SXM 2,039 GB/s, NVLink 600 GB/s, '
        'PCIe Gen4 64 GB/s; DGX A100: 8x ConnectX-6 200 Gb/s.',
        aliases=('a100', 'a100-80gb', 'a100_80gb', 'a10080gb'),
    ),
    Accelerator(
        'L40S',
        peak_bf16_flops=362.05 * TERA,
        hbm_bw=864 * GB,
        memory_bytes=48 * 10**9,
        intra_node_bw=PCIE4_X16,
        inter_node_bw=HDR_200G,
        host_bw=PCIE4_X16,
        source='NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s/): BF16 Tensor Core '
        '362.05 TFLOPS dense (733 sparse), 48 GB GDDR6 864 GB/s, PCIe Gen4 x16 64 GB/s, no '
        'NVLink (device-to-device over PCIe); NIC: assumed 200 Gb/s per GPU.',
        aliases=('l40s',),
    ),
    Accelerator(
        'RTX 4090',
        peak_bf16_flops=165.2 * TERA,
        hbm_bw=1008 * GB,
        memory_bytes=24 * 10**9,
        intra_node_bw=PCIE4_X16,
        inter_node_bw=12.5 * GB,
        host_bw=PCIE4_X16,
        source='NVIDIA Ada GPU architecture whitepaper v2.1, Appendix A (RTX 4090): peak BF16 '
        'Tensor TFLOPS with FP32 accumulate 165.2 dense (330.4 sparse), 24 GB GDDR6X '
        '1,008 GB/s, PCIe Gen4 x16, no NVLink; NIC: assumed 100 Gb/s Ethernet per GPU.',
        aliases=('4090', 'rtx4090', 'rtx-4090', 'rtx_4090'),
    ),
    Accelerator(
        'TPU v5e',
        peak_bf16_flops=197 * TERA,
        hbm_bw=819 * GB,
        memory_bytes=16 * GIB,
        intra_node_bw=100 * GB,
        inter_node_bw=12.5 * GB,
        host_bw=PCIE4_X16,
        source='Google Cloud TPU v5e documentation (cloud.google.com/tpu/docs/v5e): 197 TFLOPS '
        'bf16, 16 GiB HBM2 819 GB/s, inter-chip interconnect 1,600 Gbps (halved here: one '
        'direction); DCN and host link: assumed 100 Gb/s and PCIe Gen4 per chip.',
        aliases=('v5e', 'tpuv5e', 'tpu-v5e', 'tpu_v5e', 'v5litepod'),
    ),
    Accelerator(
        'TPU v5p',
        peak_bf16_flops=459 * TERA,
        hbm_bw=2765 * GB,
        memory_bytes=95 * GIB,
        intra_node_bw=300 * GB,
        inter_node_bw=25 * GB,
        host_bw=PCIE4_X16,
        source='Google Cloud TPU v5p documentation (cloud.google.com/tpu/docs/v5p): 459 TFLOPS '
        'bf16, 95 GiB HBM2e 2,765 GB/s, inter-chip interconnect 4,800 Gbps (halved: one '
        'direction); DCN and host link: assumed 200 Gb/s and PCIe Gen4 per chip.',
        aliases=('v5p', 'tpuv5p', 'tpu-v5p', 'tpu_v5p'),
    ),
)

_REGISTRY: dict[str, Accelerator] = {}


def _key(name: str) -> str:
  return re.sub(r'[\s_\-]', '', name.lower())


def register(acc: Accelerator, *, replace: bool = False) -> Accelerator:
  """Adds `acc` under its name and aliases (case, spaces, '-' and '_' ignored). A name already
  taken by another kind is an error unless `replace`."""
  for key in {_key(acc.name), *(_key(a) for a in acc.aliases)}:
    taken = _REGISTRY.get(key)
    if taken is not None and taken.name != acc.name and not replace:
      raise ValueError(
          f'accelerator name {key!r} of {acc.name!r} is taken by {taken.name!r}; '
          'pass replace=True to override it'
      )
    _REGISTRY[key] = acc
  return acc


def load_json(path: str, *, replace: bool = False) -> list[Accelerator]:
  """Registers every kind in a JSON file: a list of objects with Accelerator's fields."""
  with open(path) as f:
    entries = json.load(f)
  if isinstance(entries, dict):
    entries = [entries]
  out = []
  for i, entry in enumerate(entries):
    try:
      acc = Accelerator(**dict(entry, aliases=tuple(entry.get('aliases', ()))))
    except TypeError as e:
      raise ValueError(f'{path}: entry {i}: {e}') from e
    out.append(register(acc, replace=replace))
  return out


def known() -> list[str]:
  """Names of every registered kind, in registration order."""
  return list(dict.fromkeys(a.name for a in _REGISTRY.values()))


def get(name: str) -> Accelerator:
  acc = _REGISTRY.get(_key(name))
  if acc is None:
    raise ValueError(
        f'unknown accelerator {name!r}; known: {", ".join(known())} '
        '(hardware.register or hardware.load_json adds one)'
    )
  return acc


for _acc in _BUILTIN:
  register(_acc)


@dataclasses.dataclass(frozen=True)
class ClusterPart:
  count: int
  accelerator: Accelerator


_PART = re.compile(r'^\s*(\d+)\s*[xX*]\s*(\S.*?)\s*$')


def parse_cluster(spec: str) -> tuple[ClusterPart, ...]:
  """'8xH100+8xH20' -> one ClusterPart per '+'-separated 'COUNTxKIND' part (a bare kind counts
  1). Raises ValueError naming the part that is wrong."""
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f'cluster spec {spec!r} is empty; expected e.g. "8xH100+8xH20"')
  parts = []
  for raw in spec.split('+'):
    if not raw.strip():
      raise ValueError(
          f'cluster spec {spec!r}: empty part (a stray "+"); expected e.g. ' '"8xH100+8xH20"'
      )
    match = _PART.match(raw)
    if match:
      count, kind = int(match.group(1)), match.group(2)
    elif re.match(r'^\s*\d', raw):
      raise ValueError(
          f'cluster spec {spec!r}: part {raw.strip()!r} is not COUNTxKIND ' '(e.g. 8xH100)'
      )
    else:
      count, kind = 1, raw.strip()
    if count < 1:
      raise ValueError(
          f'cluster spec {spec!r}: part {raw.strip()!r} has {count} devices; ' 'needs at least 1'
      )
    try:
      acc = get(kind)
    except ValueError as e:
      raise ValueError(f'cluster spec {spec!r}: part {raw.strip()!r}: {e}') from None
    parts.append(ClusterPart(count, acc))
  return tuple(parts)
