"""Backends behind one protocol (`base.Backend`); `load` builds the ones the config file names."""

from __future__ import annotations

from pipeline.backends.base import Backend
from pipeline.settings import BackendSettings, Settings


def load(settings: Settings, only_pools: frozenset[str] | None = None) -> dict[str, Backend]:
    """One backend per `[[backends]]` entry (optionally only those of some pools), keyed by name."""
    return {b.name: _build(settings, b) for b in settings.backends if only_pools is None or b.pool in only_pools}


def _build(settings: Settings, config: BackendSettings) -> Backend:
    if config.kind == "local":
        import torch

        from pipeline.backends.local import LocalBackend
        from pipeline.models import MODEL_DIRNAME

        torch.set_num_threads(settings.runtime.torch_threads)
        path = settings.model_cache / MODEL_DIRNAME
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run `make setup` to convert the default model")
        store = None
        if config.kv_store_dir:
            from pathlib import Path

            from pipeline.engine.kv_files import FileKVStore

            store = FileKVStore(Path(config.kv_store_dir), config.kv_store_mib * 2**20, config.kv_store_ttl_s)
        speculative = None
        if config.speculative == "ngram":
            from pipeline.engine.params import SpeculativeParams

            speculative = SpeculativeParams(num_draft_tokens=config.num_draft_tokens)
        backend = LocalBackend.from_path(
            path, name=config.name, max_batch=config.max_batch, kv_store=store, speculative=speculative, dtype=config.dtype,
            interrupt_batch_steps=config.interrupt_batch_steps,
        )
        # running, waiting and KV usage at /metrics; here, not in LocalBackend: Triton's environment
        # (sluice_llm runs the engine inside it) has no prometheus_client, and Triton has metrics of its own
        from pipeline.observability import collectors

        collectors.watch_engine(config.name, backend.engine.engine)
        return backend
    if config.kind == "instant":
        from pipeline.backends.instant import InstantBackend

        return InstantBackend(name=config.name, token_delay_ms=config.token_delay_ms)
    if config.kind == "openai":
        from pipeline.backends.openai_compat import OpenAIBackend

        model = config.upstream_model or config.model
        return OpenAIBackend.from_env(config.name, config.base_url, model, config.api_key_env, config.timeout_s,
                                      stream_upstream=config.stream_upstream)
    if config.kind == "triton":
        from pipeline.backends.triton import TritonBackend

        return TritonBackend(config.url, config.triton_model, name=config.name, timeout_s=config.timeout_s)
    raise ValueError(f"unknown backend kind {config.kind!r}")
