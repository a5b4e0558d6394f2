"""The write path: Kafka -> ClickHouse, with checkpoints in a strict commit order, idempotent inserts and dead letters."""
