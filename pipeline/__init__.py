"""sluice: every stage of an LLM request as a Kafka consumer/producer worker."""
