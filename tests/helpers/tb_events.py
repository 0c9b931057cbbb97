"""TensorBoard event files read back in tests (tensorboardX's protos; no TensorFlow)."""

import glob
import os


def events(folder):
  """(file, Event) of every TensorBoard record under `folder` (TFRecord framing: length, its
  CRC, data, its CRC)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

  out = []
  for path in sorted(glob.glob(os.path.join(folder, 'events.*'))):
    data = open(path, 'rb').read()
    i = 0
    while i < len(data):
      n = int.from_bytes(data[i : i + 8], 'little')
      out.append((path, event_pb2.Event.FromString(data[i + 12 : i + 12 + n])))
      i += 12 + n + 4
  return out


def scalars(folder) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} of the scalars under `folder` (the last value of a step wins)."""
  out = {}
  for _, event in events(folder):
    for value in event.summary.value:
      out.setdefault(value.tag, {})[event.step] = value.simple_value
  return out
