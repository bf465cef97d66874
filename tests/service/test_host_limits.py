"""DrafterHost limits checked before any Ray actor starts: served names only, bounded pools, required options."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from stree.drafter_service.actors import DrafterHost, DrafterSpec, PoolLimitReached  # noqa: E402


def _host(**kwargs) -> tuple[DrafterHost, list]:
    """A host whose pool start records the name instead of starting actors."""
    host = DrafterHost(lambda name: {}, **kwargs)
    started = []

    async def fake_start(spec):
        started.append(spec.name)
        host.pools[spec.name] = object()
        return host.pools[spec.name]

    host._start = fake_start
    return host, started


def test_fusion_and_retrieval_without_options_name_the_missing_option():
    with pytest.raises(ValueError, match=r"drafter 'fusion' needs option\(s\) drafters"):
        DrafterSpec.resolve("fusion", {})
    with pytest.raises(ValueError, match=r"drafter 'retrieval' needs option\(s\) datastore .*retrieval.datastore"):
        DrafterSpec.resolve("retrieval", {})
    assert DrafterSpec.resolve("ngram", {}).name == "ngram"


def test_only_served_drafters_start():
    host, started = _host(served=["ngram"])
    asyncio.run(host.pool("ngram"))
    with pytest.raises(ValueError, match=r"'chain' is not served here \(served: ngram\)"):
        asyncio.run(host.pool("chain"))
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        asyncio.run(host.pool("nope"))
    assert started == ["ngram"]


def test_pool_count_is_bounded():
    host, started = _host(max_pools=1)
    asyncio.run(host.pool("ngram"))
    asyncio.run(host.pool("ngram"))  # a running pool is reused, not counted twice
    with pytest.raises(PoolLimitReached, match="already runs 1 drafters"):
        asyncio.run(host.pool("chain"))
    assert started == ["ngram"]
