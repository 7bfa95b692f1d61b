"""TextStream with the real SmolLM2 tokenizer: each token decodes only the last few tokens, and the deltas
are those of decoding the whole completion after every token (held-back characters, stops, resumes)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from transformers import PreTrainedTokenizerBase

from pipeline.backends.base import Delta
from pipeline.backends.text_stream import TextStream
from tests.unit.test_chat_template import tokenizer

__all__ = ["tokenizer"]  # fixtures
MIXED = "Plain words, 日本語の文章, emoji 😀🎉👩‍👩‍👧 and accents: héllo wörld. "




class _Decode:
    """The local backend's detokenizer, recording how many ids each call decoded."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer, self.sizes = tokenizer, []  # type: ignore[var-annotated]

    def __call__(self, ids: Sequence[int]) -> str:
        self.sizes.append(len(ids))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False))


class _WholeText(TextStream):
    """The stream as it was: the whole completion decoded after every token (the reference)."""

    def _extended(self) -> str:
        return self._detokenize(self._ids)


def test_each_token_decodes_a_few_tokens_not_the_whole_completion(tokenizer: PreTrainedTokenizerBase) -> None:
    """Decoding the whole completion after every token cost 1.4 ms a token at 8,000 tokens, on the loop
    every stream shares (4.7 s of it for one 8,000-token answer)."""
    ids = tokenizer(MIXED * 200, add_special_tokens=False)["input_ids"][:2000]
    decode = _Decode(tokenizer)
    stream = TextStream.start(decode, resume_ids=(), stops=("never said",), max_tokens=len(ids), eos_ids=())
    deltas = [stream.push(t) for t in ids]
    assert "".join(d.text for d in deltas) == decode(ids) and deltas[-1].finish_reason == "length"
    assert all("\ufffd" not in d.text for d in deltas)
    assert max(decode.sizes[:-1]) <= 8 and len(decode.sizes) <= 2 * len(ids) + 1


def test_a_resumed_stream_decodes_its_resume_tokens_once(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer(MIXED * 40, add_special_tokens=False)["input_ids"][:600]
    decode = _Decode(tokenizer)
    stream = TextStream.start(decode, resume_ids=ids[:500], stops=(), max_tokens=len(ids), eos_ids=())
    cut = decode.tokenizer.decode(ids[:500])
    assert cut.endswith("\ufffd")  # the resume point is inside a character, sent whole after it
    text = "".join(stream.push(t).text for t in ids[500:])
    assert cut.rstrip("\ufffd") + text == decode(ids)
    # `start` and the stream decode the resume tokens once each and, as they end inside a character, so does
    # each new token until that character is whole (at most 3 more); every other call decodes a few tokens.
    assert len([n for n in decode.sizes if n > 8]) <= 5 and len(decode.sizes) <= 2 * 100 + 5


def _pool(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that make incomplete characters likely: single bytes (lead and continuation), the tokens of
    emoji and CJK text, control tokens (skipped when decoding)."""
    vocab = tokenizer.get_vocab()
    single_bytes = [i for token, i in vocab.items() if len(token) == 1]
    text = tokenizer("😀🎉👩‍👩‍👧 日本語の文章 中文字符 한국어 Ünïcödé", add_special_tokens=False)["input_ids"]
    return single_bytes + text * 8 + list(range(17))


@pytest.mark.parametrize("seed", range(4))
def test_the_deltas_are_those_of_decoding_the_whole_completion(tokenizer: PreTrainedTokenizerBase, seed: int) -> None:
    """500 random 20-token sequences a seed (2,000 in all), from the whole vocabulary and from ids that
    split characters, some resumed after a few tokens, some with a stop string taken from their text."""
    rng = random.Random(seed)
    pool, vocab_size = _pool(tokenizer), len(tokenizer)
    decode = _Decode(tokenizer)
    for _ in range(500):
        ids = [rng.choice(pool) if rng.random() < 0.6 else rng.randrange(vocab_size) for _ in range(20)]
        whole = decode(ids)
        stops: tuple[str, ...] = ()
        if rng.random() < 0.5 and len(whole) > 4:
            at = rng.randrange(len(whole) - 3)
            stops = (whole[at : at + rng.randint(1, 3)],)
        resume = rng.choice((0, 0, 1, 3, 7))
        common = {"resume_ids": ids[:resume], "stops": stops, "max_tokens": 20, "eos_ids": (2,) if rng.random() < 0.3 else ()}
        streams = [kind.start(decode, **common) for kind in (TextStream, _WholeText)]  # type: ignore[arg-type]
        for token in ids[resume:]:
            got, expected = (stream.push(token) for stream in streams)
            assert got == expected, (ids, resume, stops)
            if expected.finish_reason is not None:
                break


def test_after_first_and_a_takeover_continue_the_same_text(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer("😀 日本語 " * 30, add_special_tokens=False)["input_ids"][:60]
    decode = _Decode(tokenizer)
    reference = [_WholeText.start(decode, resume_ids=ids[:10], stops=(), max_tokens=60, eos_ids=())]
    deltas: list[Delta] = [reference[0].push(t) for t in ids[10:30]]
    first = TextStream.after_first(
        decode, resume_ids=ids[:10], first_token_id=ids[10], first_text=deltas[0].text, stops=(), max_tokens=60, eos_ids=()
    )
    sent = len(decode(ids[:10]).rstrip("\ufffd")) + sum(len(d.text) for d in deltas)
    takeover = TextStream(decode, completion_ids=ids[:30], sent_chars=sent, stops=(), max_tokens=60, eos_ids=())
    assert [first.push(t) for t in ids[11:30]] == deltas[1:]
    assert [takeover.push(t) for t in ids[30:]] == [reference[0].push(t) for t in ids[30:]]
