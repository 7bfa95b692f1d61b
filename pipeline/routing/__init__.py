"""Routing: rules that pick a request's candidate backends, the health every generation worker
publishes, and the choice among healthy candidates (power of two choices on load, prefix affinity,
outlier ejection), with the ordered fallbacks a failure before the first token moves on to."""
