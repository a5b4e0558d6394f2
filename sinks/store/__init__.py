"""The ClickHouse schema and connection: opening a store (chDB or a server), migrations, cluster DDL,
the Kafka engine's tables, retention."""
