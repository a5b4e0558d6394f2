"""Kafka -> ClickHouse: the sink, the DDL (numbered migrations) and saved queries."""
