"""Turn a growing list of completion token ids into text deltas, stop strings and finish reasons.

Pure bookkeeping, no torch. The text of the whole completion is kept, and each token extends it by
decoding only the last few tokens (vLLM's incremental detokenizer): the tokens since the text last
ended on a whole character, after a few before them as context (a tokenizer may render a token by its
neighbours, a leading space at the start of a text), minus the context's own text. So a token costs a
decode of a few tokens, not of the whole completion (1.4 ms a token at 8,000 tokens, on the loop every
stream shares), and the text is the one decoding it all would give. A multi-byte character split
across tokens is never sent in halves (a trailing U+FFFD is held back until the next token completes
it); a detokenizer whose text is the concatenation of each token's (`token_text`) has its text
extended by that instead. Text that may be the start of a stop string is held back until the next
tokens show it is not; when a stop string completes, the text is cut just before it.

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
_CONTEXT = 5  # at most this many tokens (at least one) are decoded again before the new ones, as context


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
        whose merges and multi-byte characters span tokens): each token then costs its own text, no
        decode at all."""
        self._detokenize = detokenize
        self._ids = list(completion_ids)
        self._token_text = token_text
        # `_text` is the text of ids[:_read], which ends on a whole character (not in U+FFFD); the next
        # token decodes ids[_prefix:] and adds what follows the text of ids[_prefix:_read] (the context).
        self._text, self._prefix, self._read = "", 0, 0
        if token_text is not None:
            self._text, self._read = detokenize(self._ids), len(self._ids)
        elif self._ids:
            self._restart()
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
            text = self._extended()
        stop_at = self._find_stop(text)
        if stop_at is not None:
            return self._emit(text[:stop_at], token_id, "stop")
        if token_id in self._eos_ids:
            return self._emit(text, token_id, "stop")
        if len(self._ids) >= self._max_tokens:
            return self._emit(text, token_id, "length")
        return self._emit(text[: self._safe_end(text)], token_id, None)

    def _extended(self) -> str:
        """The text of all the ids, from a decode of the last few. `_read` moves up to the end once the
        text ends on a whole character again (a run of invalid bytes, never whole, is decoded again with
        each token until it ends)."""
        context = self._detokenize(self._ids[self._prefix : self._read]) if self._prefix < self._read else ""
        window = self._detokenize(self._ids[self._prefix :])
        if not window.startswith(context):  # a tokenizer that renders the context otherwise before more tokens
            return self._restart()
        text = self._text + window[len(context) :]
        if not window.endswith(_PARTIAL):
            self._text, self._prefix, self._read = text, max(self._read, len(self._ids) - _CONTEXT), len(self._ids)
        return text

    def _restart(self) -> str:
        """Decode all the ids (once at the start, and where the last few cannot be decoded alone)."""
        text = self._detokenize(self._ids)
        if not text.endswith(_PARTIAL):
            self._text, self._prefix, self._read = text, max(len(self._ids) - _CONTEXT, 0), len(self._ids)
        return text

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
