"""patcher.patchset: the provider a patch declares."""

from __future__ import annotations

from pathlib import Path

from conftest import requires_vllm
from packaging.specifiers import SpecifierSet

from patcher.patchset import Patch, provider_specs, select

PATCH = select(["cpu_fused_norms"])[0]


@requires_vllm
def test_the_provider_is_what_its_module_declares():
    from patches.cpu_fused_norms import provider

    spec = PATCH.provider()
    assert spec["module"] == "patches.cpu_fused_norms.provider"
    assert spec["patch"] == PATCH.name
    assert spec["name"] == provider.PROVIDER
    assert spec["ops"] == list(provider.OPS)
    assert spec["opt_in_env"] == provider.OPT_IN_ENV
    assert spec["upstream"] == provider.UPSTREAM_PROVIDER
    assert spec["reference"]  # the bench's minimal reference provider
    assert provider_specs([PATCH]) == [spec]


def test_a_patch_without_a_provider_table_declares_none():
    bare = Patch("bare", "t", SpecifierSet(">=0"), (), Path("."), meta={})
    assert bare.provider() is None
    assert provider_specs([bare]) == []
