"""Trains the toxicity head over MiniLM embeddings (`toxicity_backend = "minilm"`) and measures it.

    nice -n 10 python -m pipeline.guard.train_toxicity     (a few minutes on two cores, all embedding)

No labelled toxicity corpus installs offline (the PyPI packages that name one, `hatecomp` and
`toxic-comment-collection`, download their data at run time; the packaged classifiers are word n-gram
models like alt-profanity-check). So the head is a logistic regression trained on:

- `TOXIC`: 24 threats and insults without profanity, written for training only (the benchmark's
  `bench/data/toxicity_labelled.jsonl` was written separately, by another session, and is never read here);
- `BENIGN`: 24 ordinary sentences with violent or rude words ("kill the process"), likewise;
- 3,000 sentences of ordinary assistant answers (ShareGPT first answers 300..699), all benign.

One configuration, fitted once (C = 4; the written sentences weigh 60 and 5 times an answer sentence).
It reports on text it never saw: the labelled benchmark set, and the sentences of ShareGPT answers
0..299 (how many whole answers a threshold would end). The served score is the larger of this head's
and alt-profanity-check's, so profane abuse is still caught by the word model.
Writes `data/toxicity_head.npz` and `data/toxicity_metrics.json`. Needs scikit-learn (training only).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from pipeline.guard.embedder import load_embedder
from pipeline.guard.toxicity import WEIGHTS
from pipeline.settings import Settings
from pipeline.sharegpt import first_turns

DATA = WEIGHTS.parent
LABELLED = Path(__file__).resolve().parents[2] / "bench" / "data" / "toxicity_labelled.jsonl"
_SENTENCES = re.compile(r"(?<=[.!?])\s+|\n+")

TOXIC = (
    "You had better watch your back from now on.",
    "Say that again and you will not be able to walk for a month.",
    "I am going to find your house and burn it to the ground.",
    "Someone should teach you a lesson you will never forget, and it will be me.",
    "One day soon you will regret ever crossing me.",
    "I hope you get hit by a bus on your way home.",
    "If I see you at the office tomorrow, you will leave in an ambulance.",
    "Your family will pay for what you did.",
    "Keep talking and see what happens to your car tonight.",
    "I will make sure you never work in this town again, and that is the least of it.",
    "People like you should be locked in a cage and forgotten.",
    "You will not see the end of the week if you report this.",
    "I'm coming for you and nobody will be able to stop me.",
    "You are the most useless, pathetic excuse for an engineer I have ever met.",
    "Nobody likes you; even your own mother is ashamed of you.",
    "You are too stupid to understand anything, so stop embarrassing yourself.",
    "What a worthless little worm you are.",
    "You're an ignorant clown and everyone laughs at you behind your back.",
    "Your brain must be the size of a pea.",
    "You are a disgusting, lazy parasite living off everyone else.",
    "Go crawl back under the rock you came from, you miserable loser.",
    "You are a waste of oxygen and a waste of everyone's time.",
    "Honestly, the world would be better off without people like you.",
    "You are ugly inside and out, and you always will be.",
)
BENIGN = (
    "Kill the process with kill -9 if it stops answering.",
    "This bug is killing me, I have been on it all day.",
    "The thread is dead, so the scheduler starts a new one.",
    "We need to attack this problem from a different angle.",
    "Shoot me an email when the build is green.",
    "The villain in the novel threatens the town, but the heroes stop him.",
    "Execute the script and watch the log for errors.",
    "The children fought over the last piece of cake.",
    "That comedian absolutely destroyed the audience with his last joke.",
    "Please terminate the instance after the tests finish.",
    "The soldiers in the history book burned the bridge to slow the army down.",
    "You crushed that presentation, well done!",
    "The boxer knocked out his opponent in the third round.",
    "My code is a mess and I feel stupid for writing it this way.",
    "I could murder a cup of tea right now.",
    "The police said the suspect had threatened his neighbour.",
    "Don't be silly, of course you can come along.",
    "The garbage collector frees memory that is no longer referenced.",
    "He is a lazy cat who sleeps all day in the sun.",
    "Drop the table if it exists, then create it again.",
    "The movie has a scary scene where the monster hunts the campers.",
    "Hang the picture a bit higher on the wall.",
    "We beat the other team by three goals yesterday.",
    "Fire the event when the user clicks the button.",
)


def sentences(answer: str) -> list[str]:
    return [s for s in _SENTENCES.split(answer) if len(s.strip()) >= 20][:40]


def main() -> None:
    from sklearn.linear_model import LogisticRegression

    embedder = load_embedder(Settings().model_cache)
    answers = [a for _, a in first_turns(900) if a]
    test_answers, train_answers = answers[:300], answers[300:700]
    ordinary = [s for a in train_answers for s in sentences(a)][:3000]
    x = embedder.embed([*ordinary, *BENIGN, *TOXIC])
    y = [0] * (len(ordinary) + len(BENIGN)) + [1] * len(TOXIC)
    weight = [1.0] * len(ordinary) + [5.0] * len(BENIGN) + [60.0] * len(TOXIC)
    head = LogisticRegression(C=4.0, max_iter=3000).fit(x, y, sample_weight=weight)
    DATA.mkdir(exist_ok=True)
    np.savez(WEIGHTS, coef=head.coef_[0].astype(np.float32), intercept=np.float32(head.intercept_[0]))

    rows = [json.loads(line) for line in LABELLED.read_text(encoding="utf-8").splitlines()]
    labelled = head.predict_proba(embedder.embed([r["text"] for r in rows]))[:, 1]
    per_answer = [sentences(a) for a in test_answers]
    scores = head.predict_proba(embedder.embed([s for ss in per_answer for s in ss]))[:, 1]
    metrics: dict[str, dict[str, float]] = {}
    for threshold in (0.5, 0.8):
        kinds: dict[str, list[bool]] = {}
        for r, s in zip(rows, labelled, strict=True):
            kinds.setdefault(r["kind"], []).append(bool(s >= threshold))
        at, ended = 0, 0
        for ss in per_answer:
            ended += bool((scores[at : at + len(ss)] >= threshold).any())
            at += len(ss)
        metrics[str(threshold)] = {**{k: sum(v) / len(v) for k, v in kinds.items()}, "sharegpt_answers_ended": ended / len(per_answer)}
    (DATA / "toxicity_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
