"""Input lines: every kind of bad line is refused with its line number and a reason; good lines parse."""

from __future__ import annotations

import json

from pipeline.batch.validation import parse_input

CHAT = "/v1/chat/completions"


def line(custom_id: object = "a", url: str = CHAT, body: object = None, **extra: object) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if body is None else body
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra}).encode() + b"\n"


def test_good_lines_parse_with_their_line_numbers_counting_blank_lines() -> None:
    lines, refused = parse_input([line("a"), b"\n", line("b")], CHAT)
    assert refused == []
    assert [(x.number, x.custom_id, x.key) for x in lines] == [(1, "a", "a"), (3, "b", "b")]
    assert lines[0].parsed.messages[0].content == "hi" and lines[0].parsed.model == "m"


def test_each_bad_line_is_refused_with_its_line_number_and_the_rest_go_on() -> None:
    raw = [
        line("ok1"),
        b"{not json\n",  # 2
        b"[1, 2]\n",  # 3
        line(None),  # 4: no custom_id
        line("ok1"),  # 5: duplicate
        line("u", url="/v1/embeddings"),  # 6
        line("b", body={"model": "m", "messages": []}),  # 7: invalid body
        line("s", body={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}),  # 8
        line("g", method="GET"),  # 9
        line("t", body={"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),  # 10
        line("ok2"),  # 11
    ]
    lines, refused = parse_input(raw, CHAT)
    assert [x.custom_id for x in lines] == ["ok1", "ok2"]
    got = {r.number: (r.code, r.param) for r in refused}
    assert got == {
        2: ("invalid_json", None), 3: ("invalid_json", None), 4: ("invalid_custom_id", "custom_id"),
        5: ("duplicate_custom_id", "custom_id"), 6: ("invalid_url", "url"), 7: ("invalid_body", "body.messages"),
        8: ("invalid_body", "body.stream"), 9: ("invalid_method", "method"), 10: ("invalid_body", "body.temperature"),
    }
    duplicate = next(r for r in refused if r.number == 5)
    assert "first on line 1" in duplicate.message and duplicate.key == "#5"


def test_completions_lines_need_a_prompt() -> None:
    good = line("p", url="/v1/completions", body={"model": "m", "prompt": "Once"})
    bad = line("q", url="/v1/completions", body={"model": "m"})
    lines, refused = parse_input([good, bad], "/v1/completions")
    assert [x.parsed.prompt for x in lines] == ["Once"]
    assert [(r.number, r.param) for r in refused] == [(2, "body.prompt")]


def test_a_line_for_the_other_endpoint_is_refused() -> None:
    _, refused = parse_input([line("a")], "/v1/completions")
    assert refused[0].code == "invalid_url" and "/v1/completions" in refused[0].message


def test_a_number_no_float_holds_and_a_line_over_a_kafka_record_are_that_lines_errors() -> None:
    from pipeline.batch.validation import MAX_LINE_BYTES

    huge = line("t", body={"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 10**400})
    big = line("big", body={"model": "m", "messages": [{"role": "user", "content": "x" * MAX_LINE_BYTES}]})
    lines, refused = parse_input([huge, big, line("ok")], CHAT)
    assert [x.custom_id for x in lines] == ["ok"]
    assert {r.number: r.code for r in refused} == {1: "invalid_body", 2: "line_too_large"}
