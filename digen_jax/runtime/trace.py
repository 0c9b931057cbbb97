"""Busy spans of every device, for trace.json (Chrome/Perfetto), timeline.png and utilization.

A span says: these devices ran `program` (rollout, update, grad, apply, tag_rollout, publish...)
for `role`, on `fragment` of the batch of `step`, with policy `version`, from t0 to t1 (wall
clock, time.time()). Callers take t1 after jax.block_until_ready, so a span is the device's
real busy interval, not the dispatch. Processes of one job on one machine share the clock; the
trainer process merges the rollout's spans (they travel with the batch info) and writes the
files. On a multi-node job the clocks may differ by the NTP error (milliseconds).

BTS decisions (runtime/bts.py) are recorded beside the spans and written as instant events
plus a top-level "decisions" list in trace.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from typing import Any, Iterable, Sequence

import jax

from digen_jax.outputs import figures


@dataclasses.dataclass(frozen=True)
class Span:
  """One busy interval of a set of devices (ids as jax.Device.id)."""

  devices: tuple[int, ...]
  role: str
  program: str
  t0: float
  t1: float
  step: int = -1
  fragment: int = -1
  version: int = -1

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @staticmethod
  def from_json(d: dict) -> 'Span':
    return Span(**{**d, 'devices': tuple(d['devices'])})


def device_ids(devices: Iterable[Any]) -> tuple[int, ...]:
  return tuple(sorted(int(d.id) for d in devices))


class Tracer:
  """Thread-safe span recorder. `span(...)` times a block; block on its device results inside."""

  def __init__(self, enabled: bool = True):
    self.enabled = enabled
    self._spans: list[Span] = []
    self._decisions: list[dict] = []
    self._lock = threading.Lock()
    self._sent = 0  # spans already handed to `take_new` (the rollout process ships them)
    self._scan_from = 0  # spans before this index ended before the last utilization window

  def add(self, span: Span) -> None:
    with self._lock:
      self._spans.append(span)

  def extend(self, spans: Iterable[Span]) -> None:
    with self._lock:
      self._spans.extend(spans)

  @contextlib.contextmanager
  def span(
      self,
      devices: Sequence[Any],
      role: str,
      program: str,
      *,
      step: int = -1,
      fragment: int = -1,
      version: int = -1,
  ):
    """Records the block as busy time of `devices` (jax.Device objects). The block must end
    with a jax.block_until_ready of what it dispatched."""
    t0 = time.time()
    yield
    self.add(Span(device_ids(devices), role, program, t0, time.time(), step, fragment, version))

  def decision(self, record: dict) -> None:
    with self._lock:
      self._decisions.append(dict(record))

  @property
  def spans(self) -> list[Span]:
    with self._lock:
      return list(self._spans)

  @property
  def decisions(self) -> list[dict]:
    with self._lock:
      return list(self._decisions)

  def take_new(self) -> list[dict]:
    """Spans recorded since the last call, as JSON (what the rollout process sends along)."""
    with self._lock:
      new = self._spans[self._sent :]
      self._sent = len(self._spans)
    return [s.to_json() for s in new]

  def utilization(self, t0: float, t1: float, num_devices: int) -> float:
    """Busy device-seconds inside [t0, t1] / (num_devices x (t1 - t0)). Overlapping spans of
    one device count once. Windows are asked in time order (one per step): spans that ended
    before an asked window are skipped from then on, so a long run does not rescan its past."""
    with self._lock:
      spans = self._spans[self._scan_from :]
      skip = 0
      while skip < len(spans) and spans[skip].t1 < t0:
        skip += 1
      self._scan_from += skip
    return utilization(spans[skip:], t0, t1, num_devices)

  def write(self, workdir: str, *, title: str = '') -> None:
    """<workdir>/trace.json and <workdir>/timeline.png (unless DIGEN_PLOTS=0)."""
    if not self.enabled:
      return
    spans, decisions = self.spans, self.decisions
    write_chrome_trace(os.path.join(workdir, 'trace.json'), spans, decisions)
    if figures.enabled():
      write_timeline(os.path.join(workdir, 'timeline.png'), spans, title=title)


def _merged_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
  out: list[list[float]] = []
  for a, b in sorted(intervals):
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return [(a, b) for a, b in out]


def busy_seconds(spans: Sequence[Span], t0: float, t1: float) -> dict[int, float]:
  """Per device id: seconds inside [t0, t1] covered by at least one span."""
  per_dev: dict[int, list[tuple[float, float]]] = {}
  for s in spans:
    a, b = max(s.t0, t0), min(s.t1, t1)
    if b > a:
      for d in s.devices:
        per_dev.setdefault(d, []).append((a, b))
  return {d: sum(b - a for a, b in _merged_intervals(iv)) for d, iv in per_dev.items()}


def utilization(spans: Sequence[Span], t0: float, t1: float, num_devices: int) -> float:
  """Busy device-seconds in [t0, t1] / (num_devices x wall)."""
  wall = t1 - t0
  if wall <= 0 or num_devices <= 0:
    return 0.0
  return min(1.0, sum(busy_seconds(spans, t0, t1).values()) / (num_devices * wall))


def write_chrome_trace(path: str, spans: Sequence[Span], decisions: Sequence[dict] = ()) -> None:
  """Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one complete event ('X')
  per span and device, pid = role, tid = device id; BTS decisions as instant events."""
  origin = min((s.t0 for s in spans), default=0.0)
  roles = sorted({s.role for s in spans})
  pid = {r: i for i, r in enumerate(roles)}
  events: list[dict] = []
  for r in roles:
    events.append({'ph': 'M', 'name': 'process_name', 'pid': pid[r], 'args': {'name': r}})
  for s in spans:
    for d in s.devices:
      events.append(
          {
              'ph': 'X',
              'name': s.program,
              'cat': s.role,
              'pid': pid[s.role],
              'tid': d,
              'ts': (s.t0 - origin) * 1e6,
              'dur': (s.t1 - s.t0) * 1e6,
              'args': {'step': s.step, 'fragment': s.fragment, 'version': s.version, 'device': d},
          }
      )
  for dec in decisions:
    if 't' in dec:
      events.append(
          {
              'ph': 'i',
              's': 'g',
              'name': f"bts:{dec.get('action', '?')}",
              'pid': 0,
              'tid': 0,
              'ts': (dec['t'] - origin) * 1e6,
              'args': dec,
          }
      )
  with open(path, 'w') as f:
    json.dump(
        {
            'traceEvents': events,
            'displayTimeUnit': 'ms',
            'origin_unix_s': origin,
            'decisions': list(decisions),
        },
        f,
    )


_COLORS = {
    'rollout': 'tab:blue',
    'tag_rollout': 'tab:cyan',
    'grad': 'tab:orange',
    'update': 'tab:orange',
    'apply': 'tab:red',
    'publish': 'tab:gray',
    'eval': 'tab:olive',
}


def write_timeline(
    path: str, spans: Sequence[Span], *, title: str = '', zoom_steps: int = 3
) -> None:
  """Gantt chart: one row per device, one bar per span, coloured by program (fragments sampled
  with a previous policy hatched). Top: the whole run; bottom: the last `zoom_steps` steps
  (the steady state, without compilation)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top

  devs = sorted({d for s in spans for d in s.devices})
  dev_row = {d: i for i, d in enumerate(devs)}
  role_of_dev: dict[int, str] = {}
  for s in spans:
    for d in s.devices:
      role_of_dev.setdefault(d, s.role)
  steps = sorted({s.step for s in spans if s.step >= 0})
  last = [s for s in spans if steps and s.step >= steps[max(0, len(steps) - zoom_steps)]]
  panels = [('whole run', spans)] + (
      [(f'last {zoom_steps} steps', last)] if last and len(steps) > zoom_steps else []
  )
  origin = min((s.t0 for s in spans), default=0.0)
  h = 0.8 + 0.4 * max(1, len(devs))
  fig, axes = plt.subplots(len(panels), 1, figsize=(12, h * len(panels) + 0.6), squeeze=False)
  for ax, (name, group) in zip(axes[:, 0], panels):
    # One artist per (device row, colour, hatch), not per span: a long run has thousands.
    bars: dict[tuple[int, str, bool], list[tuple[float, float]]] = {}
    for s in group:
      color = _COLORS.get(s.program, 'tab:purple')
      stale = s.program in ('rollout', 'tag_rollout') and 0 <= s.version < s.step
      for d in s.devices:
        bars.setdefault((dev_row[d], color, stale), []).append((s.t0 - origin, s.t1 - s.t0))
    for (row, color, stale), ranges in bars.items():
      ax.broken_barh(
          ranges,
          (row - 0.4, 0.8),
          facecolors=color,
          edgecolor='black',
          linewidth=0.3,
          hatch='//' if stale else None,
      )
    if group is not spans and group:
      ax.set_xlim(min(s.t0 for s in group) - origin, max(s.t1 for s in group) - origin)
    ax.set_yticks(range(len(devs)))
    ax.set_yticklabels([f'{role_of_dev[d]} dev{d}' for d in devs])
    ax.invert_yaxis()
    ax.set_title(f'{title or "device busy spans"} ({name})', fontsize=9)
  axes[-1, 0].set_xlabel('seconds since the first span')
  used = sorted({s.program for s in spans})
  axes[0, 0].legend(
      handles=[Patch(color=_COLORS.get(p, 'tab:purple'), label=p) for p in used],
      loc='upper left',
      fontsize=7,
      ncol=len(used) or 1,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def block(tree):
  """jax.block_until_ready, returning the tree (so spans end when the devices finish)."""
  return jax.block_until_ready(tree)
