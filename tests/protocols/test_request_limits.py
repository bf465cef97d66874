"""The one schema of request bounds both front ends check (``protocols.request_limits``): each refusal names
the field as the caller spells it, echoes little of the value, and every value it lets through is one the
engine can run."""

from __future__ import annotations

import math

import pytest

from stree.protocols.request_limits import (
    MAX_ECHO_CHARS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    FieldError,
    check_drafter_name,
    check_prompt_ids,
    check_prompt_size,
    check_request_id,
    check_sampling,
    check_stop_ids,
    check_stops,
    check_text,
    log_field,
    prompt_byte_limit,
    shorten,
)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=1e308), "sampling.temperature"),
    (dict(temperature=2.5), "sampling.temperature"),
    (dict(temperature=1e-300), "sampling.temperature"),
    (dict(temperature=math.nan), "sampling.temperature"),
    (dict(temperature=math.inf), "sampling.temperature"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(top_k=2**32), "sampling.top_k"),
    (dict(top_k=-1), "sampling.top_k"),
    (dict(top_k=1.5), "sampling.top_k"),
    (dict(seed=2**64), "sampling.seed"),
    (dict(temperature=True), "sampling.temperature"),
])
def test_sampling_values_past_their_bounds_name_the_field(kwargs, field):
    with pytest.raises(FieldError) as err:
        check_sampling(**kwargs, prefix="sampling.")
    assert err.value.field == field and field in str(err.value)


def test_sampling_values_within_bounds_pass():
    p = check_sampling(temperature=2.0, top_k=2**32 - 1, top_p=1e-6, seed=-(2**63))
    assert (p.temperature, p.top_k, p.top_p, p.seed) == (2.0, 2**32 - 1, 1e-6, -(2**63))
    assert check_sampling().greedy


@pytest.mark.parametrize("stops, what", [
    ([""], "1 to"),
    (["x"] * (MAX_STOPS + 1), "over the limit"),
    (["x" * (MAX_STOP_CHARS + 1)], "1 to"),
    (["a\ud800b"], "surrogate"),
    ([7], "strings"),
])
def test_stop_strings_are_few_short_and_valid(stops, what):
    with pytest.raises(FieldError, match=what) as err:
        check_stops(stops, "stop")
    assert err.value.field.startswith("stop")


def test_token_ids_name_the_first_one_outside_the_vocabulary():
    with pytest.raises(FieldError, match=r"prompt\[0\] = -1 is outside the vocabulary \(token ids are 0..63\)"):
        check_prompt_ids([-1, 2], 64)
    with pytest.raises(FieldError, match=r"prompt\[1\] = 64 "):
        check_prompt_ids([3, 64, -5], 64)
    with pytest.raises(FieldError, match="empty"):
        check_prompt_ids([], 64)
    with pytest.raises(FieldError, match="over the limit"):
        check_stop_ids(list(range(65)), 100)
    assert check_stop_ids([0, 63], 64) == [0, 63]


def test_text_ids_and_names():
    with pytest.raises(FieldError, match=r"U\+DC00.*character 1") as err:
        check_text("a\udc00", "messages[0].content")
    assert err.value.field == "messages[0].content"
    for bad in ("line\nforged=1", "x" * 129, "tab\there"):
        with pytest.raises(FieldError) as err:
            check_request_id(bad)
        assert err.value.field == "request_id" and len(str(err.value)) < 200
    with pytest.raises(FieldError) as err:
        check_drafter_name("d" * 100_000)
    assert err.value.field == "drafter" and len(str(err.value)) < 200
    assert check_request_id("req-42") == "req-42" and check_drafter_name("") == ""


def test_prompt_bytes_are_checked_before_anything_reads_the_prompt():
    assert prompt_byte_limit(8, 4) == 32 and prompt_byte_limit(8, 100) == 64  # at most 8 bytes a token
    cap = 64
    check_prompt_size("é" * 32, cap)  # 64 bytes
    with pytest.raises(FieldError, match="65 bytes"):
        check_prompt_size("é" * 32 + "x", cap)
    with pytest.raises(FieldError, match="characters"):
        check_prompt_size("x" * 3_900_000, cap)


def test_echoes_and_log_fields_are_short_and_escaped():
    assert len(shorten("m" * 100_000)) < MAX_ECHO_CHARS + 40
    assert log_field("id\nINFO forged line") == "id\\nINFO forged line"
    assert len(log_field("z" * 10_000)) <= 131
