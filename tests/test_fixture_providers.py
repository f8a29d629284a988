"""Every registered fixture provider answers the interface `difftest fixtures` and cases use."""

from __future__ import annotations

from importlib import metadata

import pytest

from difftest.run.case_run import FIXTURE_GROUP

PROVIDERS = sorted(metadata.entry_points(group=FIXTURE_GROUP), key=lambda ep: ep.name)


def test_fixture_providers_are_registered():
    assert {"builtin", "catalogue"} <= {ep.name for ep in PROVIDERS}


@pytest.mark.parametrize("ep", PROVIDERS, ids=[ep.name for ep in PROVIDERS])
def test_each_fixture_provider_has_the_provider_interface(ep):
    module = ep.load()
    for name in ("resolve_fixture", "build_all"):  # what cases and `difftest fixtures` call
        assert hasattr(module, name), f"{ep.value} lacks {name}"
    assert module.resolve_fixture("no-such-fixture") is None
