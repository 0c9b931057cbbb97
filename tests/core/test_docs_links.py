"""Every page and section the repository cites exists: relative markdown links in the .md files,
and `docs/<page>.md#<anchor>`-style citations in the .py and .md files, resolve to a file and, when
they name one, to a heading of that file (GitHub's anchor of it)."""

import os
import re
from pathlib import Path

# The checkout's root: the nearest folder above this file holding pyproject.toml (the file may
# sit at any depth under tests/).
ROOT = next(p for p in Path(__file__).resolve().parents if (p / 'pyproject.toml').exists())
FENCE = re.compile(r'^\s*(```|~~~)')
HEADING = re.compile(r'^(#{1,6})\s+(.*?)\s*#*\s*$')
# [text](target) and ![alt](target); the target ends at the first space or ')'.
MD_LINK = re.compile(r'!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')
# A path from the repository's root to a markdown page, cited in prose or code:
# docs/<page>.md#<anchor>. One right after another repository's name ('owner/name docs/a.md') is
# that repository's file, not this one's.
ROOT_CITE = re.compile(
    r'(?<![\w/.-])((?:docs|benchmarks|assets|tests|configs)/[\w./-]*\.md)(#[\w-]+)?'
)
OTHER_REPO = re.compile(r'(?:^|[\s\'"(])[\w.-]+/[\w.-]+[\s:]$')
EXTERNAL = ('http://', 'https://', 'mailto:', 'ftp://')


def _repo_files(suffixes):
  for top, dirs, files in os.walk(ROOT):
    dirs[:] = [
        d
        for d in dirs
        if not d.startswith('.')
        and d not in ('__pycache__', 'node_modules', 'build')
        and not d.endswith('.egg-info')
        and not (Path(top) / d / 'pyvenv.cfg').exists()
    ]
    for f in files:
      if f.endswith(suffixes):
        yield Path(top) / f


def slug(text: str) -> str:
  """GitHub's anchor of a heading: its rendered text lower-cased, punctuation dropped (word
  characters, '-' and spaces kept), each space a '-'."""
  text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', text)  # a link renders as its text
  text = re.sub(r'<[^>]+>', '', text)  # inline HTML tags render as nothing
  text = text.replace('`', '').lower()
  return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(page: Path) -> set[str]:
  """Every heading's anchor on `page`, with GitHub's -1, -2, ... suffixes for repeats."""
  seen: dict[str, int] = {}
  out = set()
  fenced = False
  for line in page.read_text(encoding='utf-8').splitlines():
    if FENCE.match(line):
      fenced = not fenced
      continue
    m = None if fenced else HEADING.match(line)
    if m:
      base = slug(m.group(2))
      n = seen.get(base, 0)
      seen[base] = n + 1
      out.add(base if n == 0 else f'{base}-{n}')
  return out


def _prose(text: str) -> str:
  """`text` without its fenced code blocks (link syntax inside them is code, not a link)."""
  keep, fenced = [], False
  for line in text.splitlines():
    if FENCE.match(line):
      fenced = not fenced
    elif not fenced:
      keep.append(line)
  return '\n'.join(keep)


def _rel(path: Path) -> str:
  return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _check(source: Path, target: Path, anchor: str, cited: str, cache: dict) -> str | None:
  """None if `cited` (from `source`) names an existing file and, if any, a heading of it."""
  if not target.exists():
    return f'{_rel(source)}: {cited}: no file {_rel(target)}'
  if anchor and target.suffix == '.md':
    if target not in cache:
      cache[target] = anchors(target)
    if anchor not in cache[target]:
      return f'{_rel(source)}: {cited}: no heading #{anchor} in {_rel(target)}'
  return None


def broken_links() -> list[str]:
  bad, cache = [], {}
  for page in _repo_files(('.md',)):
    text = _prose(page.read_text(encoding='utf-8'))
    for m in MD_LINK.finditer(text):
      target = m.group(1)
      if target.startswith(EXTERNAL):
        continue
      path, _, anchor = target.partition('#')
      resolved = (page.parent / path).resolve() if path else page
      bad.append(_check(page, resolved, anchor, target, cache))
    bad += _root_citations(page, MD_LINK.sub('', text), cache)
  for src in _repo_files(('.py',)):
    bad += _root_citations(src, src.read_text(encoding='utf-8'), cache)
  return sorted(b for b in bad if b)


def _root_citations(source: Path, text: str, cache: dict) -> list[str | None]:
  out = []
  for m in ROOT_CITE.finditer(text):
    if not OTHER_REPO.search(text[max(0, m.start() - 100) : m.start()]):
      out.append(_check(source, ROOT / m.group(1), (m.group(2) or '#')[1:], m.group(0), cache))
  return out


def test_slug_is_githubs():
  assert slug('2. The math (float32 for all sampling/likelihood arithmetic)') == (
      '2-the-math-float32-for-all-samplinglikelihood-arithmetic'
  )
  assert slug('Memory per device of the real Qwen-Image-20B programs (`benchmarks/memory.py`)') == (
      'memory-per-device-of-the-real-qwen-image-20b-programs-benchmarksmemorypy'
  )
  assert (
      slug('Counted objects: 3 (84.0 -> 94.4 %), RL +39.5') == 'counted-objects-3-840---944--rl-395'
  )


def test_a_broken_link_is_found(tmp_path):
  page = tmp_path / 'p.md'
  page.write_text('# One\n## One\n```\n# not a heading\n```\n')
  assert anchors(page) == {'one', 'one-1'}
  assert _check(ROOT / 'README.md', page, 'two', 'p.md#two', {}) is not None
  assert _check(ROOT / 'README.md', page, 'one-1', 'p.md#one-1', {}) is None
  assert _check(ROOT / 'README.md', tmp_path / 'q.md', '', 'q.md', {}) is not None


def test_every_cited_page_and_heading_exists():
  bad = broken_links()
  assert not bad, '\n'.join(bad)
