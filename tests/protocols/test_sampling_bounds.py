"""SamplingParams refuses temperatures and top_p values too small for float32 (they passed and underflowed later)."""

from __future__ import annotations

import pytest

from stree.protocols.sampling import MIN_TEMPERATURE, MIN_TOP_P, SamplingParams


@pytest.mark.parametrize("field, value, limit", [
    ("temperature", 1e-300, f">= {MIN_TEMPERATURE}"),
    ("temperature", 1e-6, f">= {MIN_TEMPERATURE}"),
    ("top_p", 1e-300, f">= {MIN_TOP_P}"),
    ("top_p", 1e-9, f">= {MIN_TOP_P}"),
])
def test_tiny_values_are_refused_naming_the_field_and_limit(field, value, limit):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value) and limit in str(info.value)


def test_the_bounds_themselves_and_greedy_are_accepted():
    assert SamplingParams(temperature=MIN_TEMPERATURE, top_p=MIN_TOP_P).top_p == MIN_TOP_P
    assert SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize("top_k", [2**32, 10**400, float("inf"), float("nan")])
def test_top_k_past_its_range_is_refused_naming_the_bound(top_k):
    """A top_k past int64 is refused up front: it would break the engine's shared step (every request in it)."""
    with pytest.raises(ValueError, match="top_k must"):
        SamplingParams(temperature=1.0, top_k=top_k)
