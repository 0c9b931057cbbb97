"""Prompt datasets: tfds array_record builders read through tfds data sources, and PromptIterator."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from digen_jax.data import prompts as P
from digen_jax.tasks.shapes import grammar as G
from digen_jax.tasks.shapes import prompts as SP


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tfds")
  SP.prepare_shapes_bench(str(d))
  return str(d)


def test_shapes_bench_splits_and_fields(data_dir):
  splits = G.split_prompts()
  assert set(splits) == {"train", "eval", "val", "rl"}
  for split in splits:
    seq = P.load_prompts("shapes_bench", split, data_dir)
    assert len(seq) == len(splits[split])
    assert list(seq) == [p.to_text() for p in splits[split]]  # generation order kept
    for i in (0, len(seq) // 2, -1):
      rec = seq.record(i)
      p = G.parse(rec["prompt"])
      assert rec == SP.shapes_record(p) | {"count_a": p.objects[0].count}
  ver = os.path.join(data_dir, "shapes_bench", str(SP.ShapesBench.VERSION))
  assert any(f.startswith("shapes_bench-train.array_record") for f in os.listdir(ver))
  assert "tensorflow" not in sys.modules  # built and read without TensorFlow


def test_readable_by_plain_tfds_in_fresh_process(data_dir, tmp_path):
  pf = tmp_path / "p.txt"
  pf.write_text("a cat\na dog on a mat\n")
  P.build_prompt_file_dataset("pets", {"train": str(pf)}, data_dir)
  code = (
      "import json, sys\n"
      "import tensorflow_datasets as tfds\n"
      f"d = {data_dir!r}\n"
      "sb = tfds.data_source('shapes_bench', split='eval', data_dir=d)\n"
      "pf = tfds.data_source('prompt_file/pets', split='train', data_dir=d)\n"
      "print(json.dumps({'n_eval': len(sb), 'eval0': sb[0]['prompt'].decode(),\n"
      "  'pets': [pf[i]['prompt'].decode() for i in range(len(pf))],\n"
      "  'tf': 'tensorflow' in sys.modules, 'ours': 'digen_jax' in sys.modules}))\n"
  )
  out = subprocess.run(
      [sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  assert res == {
      "n_eval": len(G.split_prompts()["eval"]),
      "eval0": G.split_prompts()["eval"][0].to_text(),
      "pets": ["a cat", "a dog on a mat"],
      "tf": False,
      "ours": False,
  }


def test_stale_shapes_bench_detected(data_dir, monkeypatch):
  real = G.split_prompts()
  monkeypatch.setattr(
      SP, "split_prompts", lambda: {"train": real["train"][:-1], "eval": real["eval"]}
  )
  with pytest.raises(ValueError, match="different grammar"):
    SP.prepare_shapes_bench(data_dir)


def test_a_dataset_changed_after_its_check_is_checked_again(tmp_path):
  """The check is memoized per process on the dataset's info files: a rewritten one (here with
  another grammar's digest) is checked again, not taken as current."""
  d = str(tmp_path / "data")
  path = SP.prepare_shapes_bench(d)
  assert SP.prepare_shapes_bench(d) == path
  meta_file = os.path.join(path, "metadata.json")
  with open(meta_file) as f:
    meta = json.load(f)
  assert meta["sha256_train"] == SP.grammar_digests(G.split_prompts)["sha256_train"]
  with open(meta_file, "w") as f:
    json.dump({**meta, "sha256_train": "0" * 64}, f)
  os.utime(meta_file, ns=(0, os.stat(meta_file).st_mtime_ns + 1))
  with pytest.raises(ValueError, match="sha256_train differs"):
    SP.prepare_shapes_bench(d)


def test_data_dir_is_the_config_s_then_the_environment_s_then_the_workdir_s(monkeypatch):
  monkeypatch.delenv(P.DATA_DIR_ENV, raising=False)
  assert P.resolve_data_dir("", "/w") == "/w/data"
  monkeypatch.setenv(P.DATA_DIR_ENV, "/shared")
  assert P.resolve_data_dir("", "/w") == "/shared"
  assert P.resolve_data_dir("/mine", "/w") == "/mine"


def test_runs_sharing_a_data_dir_build_shapes_bench_once(tmp_path):
  """A process that finds ShapesBench being built in its data_dir waits for it and reuses it
  (without the lock it would build it again or read it half-written)."""
  import threading

  d = str(tmp_path / "shared")
  path = os.path.join(d, SP.SHAPES_BENCH, str(SP.ShapesBench.VERSION))
  done = []
  waiter = threading.Thread(target=lambda: done.append(SP.prepare_shapes_bench(d)))
  with P.exclusive(d):  # another run, building it
    waiter.start()
    waiter.join(timeout=3)
    assert waiter.is_alive() and not done  # it waits for the lock
    P.prepare_builder(SP.ShapesBench(data_dir=d, file_format="array_record"))
    built = os.stat(os.path.join(path, "dataset_info.json")).st_mtime_ns
  waiter.join(timeout=60)
  assert done == [path]
  assert os.stat(os.path.join(path, "dataset_info.json")).st_mtime_ns == built  # not rebuilt
  assert sorted(os.listdir(os.path.join(d, SP.SHAPES_BENCH))) == [str(SP.ShapesBench.VERSION)]


def test_prompt_file_builder(tmp_path):
  d = str(tmp_path / "data")
  tr, ev = tmp_path / "train.txt", tmp_path / "eval.txt"
  tr.write_text("first prompt\n  second prompt  \r\nthird, with punctuation!\n")
  ev.write_text("only eval")  # no trailing newline
  path = P.build_prompt_file_dataset("mine", {"train": str(tr), "eval": str(ev)}, d)
  assert os.path.isfile(os.path.join(path, "dataset_info.json"))
  train = P.load_prompts("prompt_file/mine", "train", d)
  assert list(train) == ["first prompt", "second prompt", "third, with punctuation!"]
  assert [train.record(i)["line"] for i in range(3)] == [1, 2, 3]
  assert train[-1] == train[2] and train[0:2] == ["first prompt", "second prompt"]
  assert list(P.load_prompts("prompt_file/mine", "eval", d)) == ["only eval"]
  with pytest.raises(ValueError, match="no split 'test'"):
    P.load_prompts("prompt_file/mine", "test", d)
  # Same files -> reused; changed file -> refused unless overwrite.
  assert P.build_prompt_file_dataset("mine", {"train": str(tr), "eval": str(ev)}, d) == path
  tr.write_text("a new prompt\n")
  with pytest.raises(ValueError, match="overwrite=True"):
    P.build_prompt_file_dataset("mine", {"train": str(tr), "eval": str(ev)}, d)
  P.build_prompt_file_dataset("mine", {"train": str(tr), "eval": str(ev)}, d, overwrite=True)
  assert list(P.load_prompts("prompt_file/mine", "train", d)) == ["a new prompt"]


def test_load_by_alias_and_by_path(data_dir, tmp_path):
  assert list(P.load_prompts("shapes", "eval", data_dir)) == list(
      P.load_prompts("shapes_bench", "eval", data_dir)
  )
  f = tmp_path / "My Prompts.txt"
  f.write_text("one\ntwo\n")
  d = str(tmp_path / "data")
  assert list(P.load_prompts(str(f), "train", d)) == ["one", "two"]
  assert list(P.load_prompts(str(f), "train", d)) == ["one", "two"]  # reused
  f.write_text("three\n")  # an edited file becomes a new dataset (content-hash name)
  assert list(P.load_prompts(str(f), "train", d)) == ["three"]
  assert len(os.listdir(os.path.join(d, "prompt_file"))) == 2
  assert all(n.startswith("my_prompts_") for n in os.listdir(os.path.join(d, "prompt_file")))
  with pytest.raises(ValueError, match="no split 'eval'"):
    P.load_prompts(str(f), "eval", d)
  with pytest.raises(ValueError, match="not found"):
    P.load_prompts(str(tmp_path / "missing.txt"), "train", d)
  f.write_text("fine\n\n")
  with pytest.raises(ValueError, match=":2: empty line"):
    P.load_prompts(str(f), "train", d)


def test_prompt_file_validation(tmp_path):
  d = str(tmp_path / "data")
  f = tmp_path / "bad.txt"
  f.write_text("ok\n\nalso ok\n")
  with pytest.raises(ValueError, match=rf"{f}:2: empty line"):
    P.build_prompt_file_dataset("bad", str(f), d)
  f.write_text("ok\n   \n")
  with pytest.raises(ValueError, match=rf"{f}:2: empty line"):
    P.build_prompt_file_dataset("bad", str(f), d)
  f.write_text("short\n" + "x" * 41 + "\n")
  with pytest.raises(ValueError, match=rf"{f}:2: prompt has 41 characters, more than max_chars=40"):
    P.build_prompt_file_dataset("bad", str(f), d, max_chars=40)
  P.build_prompt_file_dataset("long_ok", str(f), d, max_chars=41)
  f.write_text("")
  with pytest.raises(ValueError, match="empty"):
    P.build_prompt_file_dataset("bad", str(f), d)
  f.write_bytes(b"caf\xe9\n")
  with pytest.raises(ValueError, match="UTF-8"):
    P.build_prompt_file_dataset("bad", str(f), d)
  with pytest.raises(ValueError, match="name="):
    P.build_prompt_file_dataset("Bad Name", str(f), d)
  with pytest.raises(ValueError, match="not found"):
    P.build_prompt_file_dataset("missing", str(tmp_path / "nope.txt"), d)
  assert not os.path.exists(os.path.join(d, "prompt_file", "bad"))  # nothing half-written
  with pytest.raises(ValueError, match="build_prompt_file_dataset"):
    P.load_prompts("prompt_file/never_built", "train", d)


# ------------------------------------------------------------------------------ PromptIterator


def _stream(it, n):
  return [next(it) for _ in range(n)]


def test_iterator_epochs_are_permutations():
  src = [f"p{i}" for i in range(10)]
  it = P.PromptIterator(src, batch_prompts=4, seed=0)
  flat = [p for b in _stream(it, 10) for p in b]  # 40 prompts = 4 epochs, crossing boundaries
  assert it.position == 40 and it.epoch == 4
  epochs = [flat[i : i + 10] for i in range(0, 40, 10)]
  for e in epochs:
    assert sorted(e) == sorted(src)
  assert len({tuple(e) for e in epochs}) == 4  # reshuffled each epoch


def test_iterator_deterministic_and_resumable(data_dir):
  seq = P.load_prompts("shapes_bench", "eval", data_dir)
  a = P.PromptIterator(seq, 7, seed=5)
  full = _stream(a, 40)  # 280 prompts over 100: crosses epochs mid-batch
  assert _stream(P.PromptIterator(seq, 7, seed=5), 40) == full
  nb = P.PromptIterator(seq, 7, seed=5)
  assert [nb.next_batch() for _ in range(3)] == full[:3] and nb.position == 21
  assert _stream(P.PromptIterator(seq, 7, seed=6), 40) != full
  for k in (0, 13, 14, 29):
    b = P.PromptIterator(seq, 7, seed=5)
    _stream(b, k)
    pos = b.position
    assert pos == 7 * k
    c = P.PromptIterator(seq, 7, seed=5)
    c.restore(pos)
    assert _stream(c, 40 - k) == full[k:]
  assert all(isinstance(p, str) for batch in full for p in batch)


def test_iterator_errors():
  with pytest.raises(ValueError, match="no prompts"):
    P.PromptIterator([], 2)
  with pytest.raises(ValueError, match="batch_prompts"):
    P.PromptIterator(["a"], 0)
  it = P.PromptIterator(["a", "b"], 1)
  with pytest.raises(ValueError, match="position"):
    it.restore(-1)
  with pytest.raises(ValueError, match="position"):
    it.restore(1.5)
  np.testing.assert_equal(it.position, 0)
