"""Turn a growing list of completion token ids into text deltas, stop strings and finish reasons.

Pure bookkeeping, no torch: the whole completion is decoded after every token and diffed against
what was already sent, so a multi-byte character split across tokens is never sent in halves (a
trailing U+FFFD is held back until the next token completes it); a detokenizer whose text is the
concatenation of each token's (`token_text`) has its text extended instead. Text that may be the
start of a stop string is held back until the next tokens show it is not; when a stop string
completes, the text is cut just before it.

The state is fully described by (completion ids, characters sent), so a decode worker in another
process rebuilds it from the request's resume tokens and the `Prefilled` it was handed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from pipeline.backends.base import Delta, FinishReason

__all__ = ["TextStream"]

Detokenize = Callable[[Sequence[int]], str]
TokenText = Callable[[int], str]
_PARTIAL = "\ufffd"  # what a tokenizer renders for an incomplete UTF-8 sequence


class TextStream:
    """The text side of one sequence: feed it each new token, get back the `Delta` to send."""

    def __init__(
        self,
        detokenize: Detokenize,
        *,
        completion_ids: Sequence[int],
        sent_chars: int,
        stops: tuple[str, ...],
        max_tokens: int,
        eos_ids: Collection[int],
        token_text: TokenText | None = None,
    ) -> None:
        """`token_text`: one token's text, given only where `detokenize(ids)` is always the concatenation
        of `token_text(i)` over ids (the instant backend's numbered tokens; never a real tokenizer's,
        whose merges and multi-byte characters span tokens): each token then costs its own text, not a
        decode of the whole completion."""
        self._detokenize = detokenize
        self._ids = list(completion_ids)
        self._token_text = token_text
        self._text = detokenize(self._ids) if token_text is not None else ""
        self._sent = sent_chars
        self._stops = tuple(s for s in stops if s)
        self._max_tokens = max_tokens
        self._eos_ids = frozenset(eos_ids)

    @classmethod
    def start(
        cls,
        detokenize: Detokenize,
        *,
        resume_ids: Sequence[int],
        stops: tuple[str, ...],
        max_tokens: int,
        eos_ids: Collection[int],
    ) -> TextStream:
        """A stream before its first new token; the text of `resume_ids` counts as already sent."""
        sent = len(detokenize(resume_ids).rstrip(_PARTIAL)) if resume_ids else 0
        return cls(
            detokenize, completion_ids=resume_ids, sent_chars=sent, stops=stops, max_tokens=max_tokens, eos_ids=eos_ids
        )

    @classmethod
    def after_first(
        cls,
        detokenize: Detokenize,
        *,
        resume_ids: Sequence[int],
        first_token_id: int,
        first_text: str,
        stops: tuple[str, ...],
        max_tokens: int,
        eos_ids: Collection[int],
    ) -> TextStream:
        """The stream as `prefill` left it: resume tokens and the first token sent, `first_text` with them."""
        stream = cls.start(detokenize, resume_ids=resume_ids, stops=stops, max_tokens=max_tokens, eos_ids=eos_ids)
        stream._ids.append(first_token_id)
        stream._sent += len(first_text)
        return stream

    @property
    def completion_tokens(self) -> int:
        """Completion tokens so far, resume tokens included."""
        return len(self._ids)

    def push(self, token_id: int) -> Delta:
        """Account for one new token; the returned delta's `finish_reason` is set when the stream ends."""
        self._ids.append(token_id)
        if self._token_text is not None:
            text = self._text = self._text + self._token_text(token_id)
        else:
            text = self._detokenize(self._ids)
        stop_at = self._find_stop(text)
        if stop_at is not None:
            return self._emit(text[:stop_at], token_id, "stop")
        if token_id in self._eos_ids:
            return self._emit(text, token_id, "stop")
        if len(self._ids) >= self._max_tokens:
            return self._emit(text, token_id, "length")
        return self._emit(text[: self._safe_end(text)], token_id, None)

    def _emit(self, text_upto: str, token_id: int, finish: FinishReason | None) -> Delta:
        new = text_upto[self._sent :]
        self._sent = max(self._sent, len(text_upto))
        return Delta(text=new, token_ids=(token_id,), finish_reason=finish)

    def _find_stop(self, text: str) -> int | None:
        # Held-back text is never more than a stop-string prefix, so a stop cannot start before `_sent`.
        hits = [i for i in (text.find(stop, self._sent) for stop in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self, text: str) -> int:
        """Where the sendable text ends: before a trailing partial character or a possible stop start."""
        end = len(text.rstrip(_PARTIAL))
        for start in range(max(self._sent, end - self._longest_stop() + 1), end):
            tail = text[start:end]
            if any(stop.startswith(tail) for stop in self._stops):
                return start
        return end

    def _longest_stop(self) -> int:
        return max((len(s) for s in self._stops), default=0)
