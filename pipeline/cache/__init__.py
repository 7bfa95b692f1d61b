"""The answer cache: exact keys and Redis tier, the per-tenant semantic index, the trap check."""
