"""The cache's keys cover every sampling field: each one changes the exact key and the semantic context,
including a field added to `Sampling` after `keys.py` was written; and deriving them from the struct left
existing keys as they were."""

from __future__ import annotations

import msgspec

from pipeline.cache import keys
from topics.requests import ChatMessage, Request, Sampling

BASE = Sampling(max_tokens=16, temperature=0.5, top_p=0.9, stop=("\n",), seed=7)
CHANGED = {"max_tokens": 17, "temperature": 0.6, "top_p": 0.8, "stop": ("\n", "."), "seed": 8}  # one new value per field


def request(sampling: Sampling) -> Request:
    turns = (ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi"))
    return Request(id="r1", reply_to="llm.responses.bridge", model="m", created_at=1.0, messages=turns,
                   sampling=sampling, task="code")


def test_every_sampling_field_changes_the_exact_key_and_the_context() -> None:
    names = [field.name for field in msgspec.structs.fields(Sampling)]
    assert set(names) == set(CHANGED), "give a new Sampling field a changed value in CHANGED"
    before = request(BASE)
    for name in names:
        after = request(msgspec.structs.replace(BASE, **{name: CHANGED[name]}))
        assert keys.exact_key("t", after) != keys.exact_key("t", before), name
        assert keys.context("t", after) != keys.context("t", before), name


class WiderSampling(Sampling, frozen=True):
    """`Sampling` with a field added, as a later change to topics/requests.py might add one."""

    min_p: float = 0.0


def test_a_field_added_to_sampling_is_in_the_keys_without_a_change_to_keys_py() -> None:
    fields = msgspec.structs.asdict(BASE)
    before, after = request(WiderSampling(**fields)), request(WiderSampling(**fields, min_p=0.1))
    assert keys.exact_key("t", after) != keys.exact_key("t", before)
    assert keys.context("t", after) != keys.context("t", before)


def test_existing_keys_are_unchanged() -> None:
    """The digests the hand-written field list gave: a change here misses every stored entry once (a
    flush, not a wrong answer), so make it on purpose and say so in docs/caching.md."""
    one = Request(id="a", reply_to="t", model="m", created_at=1.0, messages=(ChatMessage(role="user", content="hi"),),
                  sampling=Sampling(max_tokens=5, stop=("x",), seed=3), task="code")
    assert keys.exact_key("t", one) == keys.scope("t", "m") + "7859afde2cd226ca26c9c65d248e608a5aaa48113c8cc232fa423fb4ae0b26d5"
    assert keys.context("t", one) == "a9adb600b7ca6bf502209cf6a17ec8f69bb0736aac884b420a182669550f12c0"
