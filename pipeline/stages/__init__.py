"""The stage handlers: pure async functions of a message, bound to topics by `workers/`."""
