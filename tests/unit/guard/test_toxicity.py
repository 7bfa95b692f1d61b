"""Toxicity beyond a profanity list: the MiniLM head (toxicity_backend = "minilm", opt-in) reads
meaning, so an insult without a rude word can score high. It is trained on a few hundred written
sentences (data/toxicity_train.jsonl), so it is still brittle: the misses below are strict expected
failures, to be promoted when a better head lands. The sentences here are in none of its training,
validation or benchmark sets.

Two of the misses sit near the threshold, and the int8 embedder's output moves with the host: on the
hosts where they were written, and on an Intel Xeon with AVX-512 VNNI (2026-12-07), the head gives 0.44
and 0.82; on an AMD EPYC with AVX2 and no AVX-512 or VNNI (2026-12-05) it gave 0.54 and 0.74, past the
line. So those two are expected failures that may pass (not strict: CI runs on whatever host it gets);
what they record is that the head cannot be trusted on such sentences, wherever it lands. Every xfail
here has `raises=AssertionError`: only the score missing its mark is the expected failure, an error on
the way (a broken head, a shape error) fails the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.guard.config import GuardSettings
from pipeline.guard.loader import InputGuard, toxicity_scorer
from pipeline.guard.toxicity import WEIGHTS, MiniLmToxicity, ProfanityCheck
from pipeline.guard.train_toxicity import LABELLED, TRAIN, VALIDATION
from pipeline.settings import Settings


@pytest.fixture(scope="module")
def head(input_guard: InputGuard) -> MiniLmToxicity:
    return MiniLmToxicity(input_guard.embedder, WEIGHTS)


def test_the_head_scores_what_the_word_model_misses_and_keeps_what_it_catches(head: MiniLmToxicity) -> None:
    threat = "You are a spineless fool and nobody will ever respect you, I promise you that."
    assert ProfanityCheck().scores([threat])[0] < 0.8 <= head.scores([threat])[0]
    assert head.scores(["The recipe says to beat the eggs until they are stiff."])[0] < 0.5
    assert head.scores(["You are a fucking idiot."])[0] >= 0.8  # profane abuse: the word model's score is kept


@pytest.mark.xfail(strict=False, raises=AssertionError, reason="a veiled threat phrased unlike the written training threats: 0.44 (0.54 on another host)")
def test_a_threat_about_someones_children_is_flagged(head: MiniLmToxicity) -> None:
    assert head.scores(["Think twice before you call the police, because I know which school your kids go to."])[0] >= 0.5


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="alt-profanity-check gives 'docker kill' 0.94 and the served score is the larger")
def test_a_docker_kill_command_is_not_flagged(head: MiniLmToxicity) -> None:
    assert head.scores(["To stop the container, run docker kill followed by its name."])[0] < 0.5


@pytest.mark.xfail(strict=False, raises=AssertionError, reason="the written threats are often conditional: a bare 'If your ...' opening scores 0.82 (0.74 on another host)")
def test_the_opening_of_a_conditional_sentence_is_not_flagged(head: MiniLmToxicity) -> None:
    # Postguard scores an unfinished sentence once its start is about to leave the holdback window.
    assert head.scores(["If your suitcase was delayed,"])[0] < 0.8


def test_the_backend_is_chosen_in_settings(input_guard: InputGuard) -> None:
    assert isinstance(toxicity_scorer(GuardSettings(toxicity_backend="minilm"), Settings().model_cache), MiniLmToxicity)
    assert isinstance(toxicity_scorer(GuardSettings()), ProfanityCheck)


def texts(path: Path) -> set[str]:
    return {" ".join(json.loads(line)["text"].lower().split()) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


def test_training_validation_and_benchmark_sentences_are_disjoint() -> None:
    train, validation, benchmark = texts(TRAIN), texts(VALIDATION), texts(LABELLED)
    assert not train & validation and not train & benchmark and not validation & benchmark
    labels = [json.loads(line)["label"] for line in TRAIN.read_text(encoding="utf-8").splitlines()]
    assert labels.count(1) >= 150 and labels.count(0) >= 200
