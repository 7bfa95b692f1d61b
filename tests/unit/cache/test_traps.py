"""The trap check on handwritten pairs (none taken from fow-cache's data): what must conflict, what must not."""

from __future__ import annotations

import re

import msgspec
import pytest

from pipeline.cache.traps import Salient, conflicts, salient

MUST_CONFLICT = [
    # numbers, times, dates
    ("Reserve 4 seats on the ferry", "Reserve 6 seats on the ferry"),
    ("Where is parcel 77120?", "Where is parcel 77102?"),
    ("Is the gym open at 6am?", "Is the gym open at 6pm?"),
    ("Do you deliver on Thursday?", "Do you deliver on Friday?"),
    ("What's the fee for a two-week stay?", "What's the fee for a three-week stay?"),
    ("Book the dentist for today", "Book the dentist for tomorrow"),
    ("What was the rainfall in October?", "What was the rainfall in November?"),
    ("Is there a charge for bags over 20kg?", "Is there a charge for bags?"),
    # negation
    ("Should I refreeze thawed chicken?", "Should I not refreeze thawed chicken?"),
    ("Which trains have wifi?", "Which trains don't have wifi?"),
    ("Can I park here at night?", "Can I never park here at night?"),
    ("What's the rate for smokers?", "What's the rate for non-smokers?"),
    # names and acronyms
    ("How do I cancel my Spotify trial?", "How do I cancel my Netflix trial?"),
    ("Is the museum near Victoria station?", "Is the museum near Euston station?"),
    ("How do I file a VAT return?", "How do I file a PAYE return?"),
    ("How do I sync my calendar?", "How do I sync my calendar with Outlook?"),
    # antonyms by prefix, opposite words, substituted content words
    ("How do I archive a channel?", "How do I unarchive a channel?"),
    ("How do I mute a contact?", "How do I unmute a contact?"),
    ("How do I encrypt the backup?", "How do I decrypt the backup?"),
    ("Is the pool heated in summer?", "Is the pool heated in winter?"),
    ("How much leave do full-time staff get?", "How much leave do part-time staff get?"),
    ("What's the ticket price for adults?", "What's the ticket price for children?"),
    ("How do I upload a photo?", "How do I download a photo?"),
    ("Is the soup vegan?", "Is the salad vegan?"),
    ("Is parking free for residents?", "Is parking free for guests?"),
    # scope: a qualifier added
    ("How do I change the password?", "How do I change the router password?"),
    ("What vaccines do cats need?", "What vaccines do older cats need?"),
    # roles swapped
    ("Convert this file from CSV to JSON", "Convert this file from JSON to CSV"),
    ("Move my booking from the morning to the evening", "Move my booking from the evening to the morning"),
]

MUST_NOT_CONFLICT = [
    ("How do I get a quote for a boiler?", "How do I get a quotation for a boiler?"),
    ("How do I claim a refund?", "How do I claim refunds?"),
    ("Can I pay the deposit by card?", "Can I pay the deposit by card please?"),
    ("Hi team, how do I rotate my API key?", "How do I rotate my API key?"),
    ("okay so how do I rotate my API key", "How do I rotate my API key?"),
    ("um how do i export invoices", "How do I export invoices?"),
    ("How do I export invoices? Thanks!", "How do I export invoices?"),
    ("Hello there! How do I export invoices? Many thanks", "how do I export invoices"),
    ("WHERE IS THE NEAREST PHARMACY?", "Where is the nearest pharmacy?"),
    ("what's the refund window on Amazon", "What is the refund window on Amazon?"),
    ("I don't see my invoice", "I do not see my invoice"),
    ("Why can't I log in?", "Why cannot I log in?"),
    ("For new customers, is delivery free?", "Is delivery free for new customers?"),
    ("What's the cancellation policy?", "What is the policy on cancellation?"),
    ("How do I update my billing address?", "How do I updte my billing adress?"),
    ("Is the office open on Saturdays?", "Is the office open on Saturday?"),
    ("Can I bring twenty-five guests?", "Can I bring 25 guests?"),
    ("Is the train at 5pm on time?", "Is the train at 17:00 on time?"),
    ("What is 20% of £1,500?", "What is twenty percent of fifteen hundred pounds?"),
    ("How do I set up Wi-Fi calling?", "How do I set up wi-fi calling?"),
    ("Which trains don't have wifi?", "Which trains do not have wifi?"),
    ("What are the cleaner's opening hours?", "What are the cleaners' opening hours?"),
]


# WordNet (pipeline/cache/synonyms.py): a synonym is no substitution; an antonym conflicts however much else
# was reworded; a synonym elsewhere in the question does not hide a number, a negation, a name or a co-hyponym.
SYNONYMS = [
    ("Where is the nearest shop that sells batteries?", "Where is the nearest store that sells batteries?"),
    ("What's the quickest route to the airport?", "What's the fastest route to the airport?"),
    ("Do kids travel free on the tram?", "Do children travel free on the tram?"),
    ("What does a replacement passport cost?", "What is the price of a replacement passport?"),
    ("Can I phone the surgery after six?", "Can I call the surgery after six?"),
]
STILL_CONFLICT = [
    ("Is the gallery cheap for a family to visit?", "Would a family find the gallery expensive to visit?"),
    ("Does the fee include VAT?", "Will they exclude VAT from what the fee comes to?"),
    ("Is the bakery cheap?", "Is the bakery expensive?"),
    ("Can I buy a season ticket at the station?", "Can I sell a season ticket at the station?"),
    ("Is the shop open on Sunday?", "Is the store open on Monday?"),
    ("Does the shop sell stamps?", "Doesn't the store sell stamps?"),
    ("Is the Tesco shop open late?", "Is the Asda store open late?"),
    ("Do kids travel free on the tram?", "Do adults travel free on the tram?"),
]


@pytest.mark.parametrize(("a", "b"), MUST_CONFLICT + STILL_CONFLICT)
def test_conflicts(a: str, b: str) -> None:
    assert conflicts(salient(a), salient(b))
    assert conflicts(salient(b), salient(a))


@pytest.mark.parametrize(("a", "b"), MUST_NOT_CONFLICT + SYNONYMS)
def test_no_conflict(a: str, b: str) -> None:
    assert not conflicts(salient(a), salient(b))
    assert not conflicts(salient(b), salient(a))


@pytest.mark.parametrize("text", [a for a, _ in MUST_CONFLICT + MUST_NOT_CONFLICT + SYNONYMS + STILL_CONFLICT])
def test_same_text_never_conflicts(text: str) -> None:
    assert not conflicts(salient(text), salient(text))


def test_holds_no_raw_word() -> None:
    text = "Hi, can Margaret transfer £2,500 from Barclays savings to her Monzo account on Tuesday at 3pm?"
    value = salient(text)
    encoded = msgspec.json.encode(value).decode().lower()
    for word in re.findall(r"[A-Za-z]{3,}", text):
        assert word.lower() not in encoded
    entries = [d for field in value.__struct_fields__ for d in getattr(value, field)]
    assert entries and all(re.fullmatch(r"[0-9a-f]{8}|[0-9a-f]{16}", d) for d in entries)


def test_round_trips_and_is_sorted() -> None:
    value = salient("Does the Gold plan include 3 free returns, not 2?")
    assert msgspec.json.decode(msgspec.json.encode(value), type=Salient) == value
    for field in value.__struct_fields__:
        digests = getattr(value, field)
        assert list(digests) == sorted(digests)
        assert all(re.fullmatch(r"[0-9a-f]{8}|[0-9a-f]{16}", d) for d in digests)


def test_an_entry_stored_before_synonyms_still_compares() -> None:
    # Entries on llm.cache.entries written before `senses` and `opposites` existed decode with them empty:
    # a synonym is then a substitution again (a miss), never a wrong hit.
    old = msgspec.structs.replace(salient("Where is the nearest shop?"), senses=(), opposites=())
    new = salient("Where is the nearest store?")
    assert conflicts(old, new) and conflicts(new, old)
    assert not conflicts(salient("Where is the nearest shop?"), new)


def test_empty_text() -> None:
    assert salient("") == Salient()
    assert not conflicts(salient(""), salient("  "))
