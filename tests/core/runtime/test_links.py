"""runtime/links.py: both transports implement the Link protocol the schedules use."""

import inspect

import pytest

from digen_jax.runtime import links


def _members(cls):
  return {n for n, v in vars(cls).items() if callable(v) and not n.startswith('_')}


@pytest.mark.parametrize('impl', [links.LocalLink, links.ChannelLink])
def test_transports_implement_the_link_protocol(impl):
  wanted = _members(links.Link)
  assert wanted >= {'publish', 'wait_policy', 'claim', 'send_fragment', 'receive_fragment'}
  assert wanted <= _members(impl), wanted - _members(impl)
  for name in wanted:  # same parameters, so a schedule can call either the same way
    assert list(inspect.signature(getattr(impl, name)).parameters) == list(
        inspect.signature(getattr(links.Link, name)).parameters
    ), name
