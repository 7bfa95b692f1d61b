"""Toxicity beyond a profanity list: the MiniLM head (toxicity_backend = "minilm") reads meaning, so an
insult without a rude word can score high. Its training set is 24 written threats and insults, so it
is brittle: the misses below are strict expected failures, to be promoted when a better head lands.
The sentences here are in neither its training set (train_toxicity.py) nor the benchmark's."""

from __future__ import annotations

import pytest

from pipeline.guard.config import GuardSettings
from pipeline.guard.loader import InputGuard, toxicity_scorer
from pipeline.guard.toxicity import WEIGHTS, MiniLmToxicity, ProfanityCheck
from pipeline.settings import Settings


@pytest.fixture(scope="module")
def head(input_guard: InputGuard) -> MiniLmToxicity:
    return MiniLmToxicity(input_guard.embedder, WEIGHTS)


def test_the_head_scores_what_the_word_model_misses_and_keeps_what_it_catches(head: MiniLmToxicity) -> None:
    threat = "You are a spineless fool and nobody will ever respect you, I promise you that."
    assert ProfanityCheck().scores([threat])[0] < 0.8 <= head.scores([threat])[0]
    assert head.scores(["The recipe says to beat the eggs until they are stiff."])[0] < 0.5
    assert head.scores(["You are a fucking idiot."])[0] >= 0.8  # profane abuse: the word model's score is kept


@pytest.mark.xfail(strict=True, reason="24 written training sentences: a threat phrased unlike them is missed")
def test_a_threat_about_someones_children_is_flagged(head: MiniLmToxicity) -> None:
    assert head.scores(["Think twice before you call the police, because I know which school your kids go to."])[0] >= 0.5


@pytest.mark.xfail(strict=True, reason="24 written training sentences: 'kill' in a shell command still reads as violence")
def test_a_docker_kill_command_is_not_flagged(head: MiniLmToxicity) -> None:
    assert head.scores(["To stop the container, run docker kill followed by its name."])[0] < 0.5


def test_the_backend_is_chosen_in_settings(input_guard: InputGuard) -> None:
    assert isinstance(toxicity_scorer(GuardSettings(toxicity_backend="minilm"), Settings().model_cache), MiniLmToxicity)
    assert isinstance(toxicity_scorer(GuardSettings()), ProfanityCheck)
