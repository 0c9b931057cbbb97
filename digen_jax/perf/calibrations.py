"""Measured fractions of peak: how fast each engine's programs run on an accelerator kind.

For one engine ('digen_jax', or 'torch': the peers' PyTorch stack, veRL-Omni's as its own
figures show it) on one kind, a Calibration holds three fractions of peak dense bf16 FLOP/s,
counting the FLOPs a program executes:

  sampling      the rollout's transformer forward (the sampler's calls)
  training      forward + backward with per-block checkpointing: 4 forwards of full fine-tuning
                (forward, recompute, backward as two), 3 of LoRA (no weight gradient)
  forward_only  a forward on the training engine without gradients (a colocated system's
                behaviour pass: veRL's old_log_prob)

Each fraction rests on one Figure, a timed workload in a record committed under benchmarks/
(file, row and fields cited; tests/perf/test_calibration.py reads every cited field back from
its file), or says in `assumed` what it assumes instead. Every plan prints the assumptions it
uses (`assumptions`). A kind without its own record borrows a measured kind's fractions
(BORROWED_FROM), which is itself an assumption and printed as one.
"""

from __future__ import annotations

import dataclasses

from digen_jax.perf import hardware
from digen_jax.perf import timing

WORKS = ('sampling', 'training', 'forward_only')
ENGINES = ('digen_jax', 'torch')

# Matmul FLOPs of one Qwen-Image-20B forward on one row of 1024 image tokens (512 px) and 128 /
# 64 text tokens (models/transformers/mmdit flops_per_forward of the released architecture;
# tests/perf/test_calibration.py recomputes both).
QWEN_IMAGE_512PX_FORWARD = 16.650874650624e12
QWEN_IMAGE_512PX_64TXT_FORWARD = 15.67403802624e12

H200_RECORD = 'benchmarks/gpu/h200_2026-11-28'
VERL_OMNI_RECORD = 'benchmarks/peers/verl_omni.jsonl'


@dataclasses.dataclass(frozen=True)
class Figure:
  """A timed workload read from a committed record (JSON lines), and the fraction of peak it
  implies: forward_rows forwards of one row per device, flops_per_forward each, in `seconds`."""

  record: str  # repo-relative file
  row: tuple[str, str]  # (key, value) choosing the record's line
  cited: tuple[tuple[str, float], ...]  # the fields read, with their values as recorded
  seconds: float  # the workload's time, from the cited fields (`how` says how)
  forward_rows: float
  flops_per_forward: float
  how: str
  kind: str = 'H200'  # the accelerator it ran on

  def fraction(self) -> float:
    peak = hardware.get(self.kind).peak_bf16_flops
    return self.forward_rows * self.flops_per_forward / (self.seconds * peak)

  def describe(self) -> str:
    fields = ', '.join(f'{k} = {v:g}' for k, v in self.cited)
    return f'{self.record} ({self.row[0]}={self.row[1]}): {fields}; {self.how}'


@dataclasses.dataclass(frozen=True)
class Fraction:
  """One fraction of peak: from its figure, or an assumption (`assumed` says which, and why)."""

  value: float
  figure: Figure | None = None
  assumed: str = ''  # '' when the figure is the engine's own measurement of this work

  def __post_init__(self):
    if not 0 < self.value <= 1:
      raise ValueError(f'Fraction {self.value!r} not in (0, 1]')
    if self.figure is None and not self.assumed:
      raise ValueError('a Fraction without a figure must say what it assumes')

  @classmethod
  def of(cls, figure: Figure, assumed: str = '') -> Fraction:
    return cls(figure.fraction(), figure, assumed)

  def source(self) -> str:
    parts = [self.figure.describe()] if self.figure else []
    return '; '.join(parts + ([f'assumed: {self.assumed}'] if self.assumed else []))


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The three fractions of one engine on one kind (module docstring)."""

  engine: str
  accelerator: str
  sampling: Fraction
  training: Fraction
  forward_only: Fraction
  date: str
  measured_on: str = ''  # set when a kind borrows another kind's figures

  def of(self, work: str) -> float:
    if work not in WORKS:
      raise ValueError(f'work {work!r}: use one of {WORKS}')
    return getattr(self, work).value


def _probe(file: str, fw: str, field: str, ms: float, rows: int, passes: int, how: str):
  return Figure(
      record=f'{H200_RECORD}/{file}',
      row=('fw', fw),
      cited=((field, ms),),
      seconds=ms / 1e3,
      forward_rows=rows * passes,
      flops_per_forward=QWEN_IMAGE_512PX_FORWARD,
      how=how,
  )


# veRL-Omni's full fine-tuning recipe (configs/verl_omni_ocr.py:full) as verl-omni#124 timed it
# on 4 H200s: 512 images, 2 trained steps each (sde_window_size=2), no CFG, 64-token prompts (the
# config's assumption). Its own MFU counter counts 6 x params x tokens with its own timestep
# count, so the fractions come from the measured seconds and our count of the same work.
_VERL_IMAGES, _VERL_TRAINED_STEPS, _VERL_GPUS = 512, 2, 4
_UPDATE_ACTOR_S, _ACTOR_MFU, _ACTOR_INFER_MFU = 115.59, 0.223, 0.327
_VERL_ROW = ('id', 'verl-omni#124')

_OURS_FORWARD = _probe(
    'probe_cudnn.jsonl',
    'jax',
    'fwd_ms',
    521.1,
    16,
    1,
    'forward at batch 16 with cuDNN fused attention (the GPU default)',
)
_OURS_H200 = Calibration(
    'digen_jax',
    'H200',
    sampling=Fraction.of(_OURS_FORWARD),
    training=Fraction.of(
        _probe(
            'probe_cudnn.jsonl',
            'jax',
            'grad_ms',
            389.0,
            2,
            4,
            'forward + backward with per-block checkpointing at batch 2 (4 forwards a row)',
        )
    ),
    forward_only=Fraction(
        _OURS_FORWARD.fraction(),
        assumed="our trainer runs no gradient-free forward; it is taken at the rollout forward's "
        'rate (used only by a baseline priced with our own programs)',
    ),
    date='2026-11-28',
)
_TORCH_H200 = Calibration(
    'torch',
    'H200',
    sampling=Fraction.of(
        _probe(
            'probe_plain.jsonl',
            'torch',
            'fwd_ms',
            656.1,
            16,
            1,
            'diffusers QwenImageTransformer2DModel forward at batch 16, eager',
        ),
        assumed='veRL-Omni samples with vLLM-Omni, whose rollout MFU it does not publish '
        "(verl-omni#124: 'Rollout MFU ... a follow-up'); taken at diffusers eager's measured rate",
    ),
    training=Fraction.of(
        Figure(
            record=VERL_OMNI_RECORD,
            row=_VERL_ROW,
            cited=(('update_actor_s', _UPDATE_ACTOR_S),),
            seconds=_UPDATE_ACTOR_S,
            forward_rows=_VERL_IMAGES * _VERL_TRAINED_STEPS * 4 / _VERL_GPUS,
            flops_per_forward=QWEN_IMAGE_512PX_64TXT_FORWARD,
            how='veRL-Omni full fine-tuning on 4 H200s, its measured update: 512 images x 2 '
            'trained steps x 4 forwards (checkpointing), 64-token prompts, over 4 GPUs',
        )
    ),
    forward_only=Fraction.of(
        Figure(
            record=VERL_OMNI_RECORD,
            row=_VERL_ROW,
            cited=(
                ('update_actor_s', _UPDATE_ACTOR_S),
                ('actor/mfu', _ACTOR_MFU),
                ('actor_infer/mfu', _ACTOR_INFER_MFU),
            ),
            # Its counter gives the forward-only pass a third of the update's FLOPs (the same
            # samples and timesteps): seconds = update_actor_s x actor/mfu / (3 actor_infer/mfu).
            seconds=_UPDATE_ACTOR_S * _ACTOR_MFU / (3 * _ACTOR_INFER_MFU),
            forward_rows=_VERL_IMAGES * _VERL_TRAINED_STEPS / _VERL_GPUS,
            flops_per_forward=QWEN_IMAGE_512PX_64TXT_FORWARD,
            how="veRL-Omni's old_log_prob pass over the same 512 images x 2 steps, its time "
            'from its two MFU figures and the update time',
        )
    ),
    date='2026-12-02',
)
CALIBRATIONS = {('digen_jax', 'H200'): _OURS_H200, ('torch', 'H200'): _TORCH_H200}

# Kinds that borrow a measured kind's fractions: the same Hopper tensor cores at the same clocks
# (H100 SXM, H800, H200: 989.4 TFLOP/s), or Hopper at a lower clock (H20; its 4.0 TB/s HBM per
# FLOP is 5x an H200's, so the compute fraction is, if anything, higher). Other generations fall
# back to the H200's figures too; every plan prints the borrowing as an assumption.
BORROWED_FROM = {'H100 SXM': 'H200', 'H800': 'H200', 'H20': 'H200'}


def calibration(engine: str, accelerator: hardware.Accelerator) -> Calibration:
  """`engine` on `accelerator`: its own record, else the measured kind it borrows from (with
  measured_on naming it)."""
  if engine not in ENGINES:
    raise ValueError(f'engine {engine!r} has no calibration; known: {ENGINES}')
  own = CALIBRATIONS.get((engine, accelerator.name))
  if own is not None:
    return own
  source = BORROWED_FROM.get(accelerator.name, 'H200')
  base = CALIBRATIONS[(engine, source)]
  return dataclasses.replace(base, accelerator=accelerator.name, measured_on=source)


def describe(engine: str, kinds, *, sources: bool = False) -> list[str]:
  """One line per kind: the fractions used and where they come from (with `sources`, each
  fraction's figure and assumption)."""
  out = []
  for acc in kinds:
    c = calibration(engine, acc)
    where = f"{c.measured_on}'s" if c.measured_on else 'its own'
    works = ', '.join(
        f'{w.replace("_", "-")} {c.of(w):.3f}' + (' (assumed)' if getattr(c, w).assumed else '')
        for w in WORKS
    )
    out.append(f'{engine} on {acc.name}: {works} of peak ({where} figures, {c.date})')
    if sources:
      out += [f'    {w}: {getattr(c, w).source()}' for w in WORKS]
  return out


def assumptions(engines, kinds, eff: timing.Efficiency, *, uniform: bool) -> list[str]:
  """What a plan with these engines on these kinds takes without a measurement, one line each."""
  out = [
      f'HBM at {eff.hbm:.0%} and every link (NVLink, NIC, host) at {eff.link:.0%} of its peak '
      'bandwidth (perf/timing.Efficiency: no measurement)'
  ]
  if uniform:
    out.append(f'our programs at {eff.mfu:.0%} of peak FLOP/s (--mfu: no measurement)')
  for engine in dict.fromkeys(engines):
    measured = {}  # the records used, once each
    for acc in kinds:
      c = calibration(engine, acc)
      if c.measured_on:
        out.append(
            f'{engine} on {acc.name} reaches the {c.measured_on} fractions (not measured on '
            f'{acc.name})'
        )
      measured.setdefault(c.measured_on or c.accelerator, c)
    for c in measured.values():
      out += [
          f'{engine} {w.replace("_", "-")}: {getattr(c, w).assumed}'
          for w in WORKS
          if getattr(c, w).assumed
      ]
  return out
