"""OTLP in: OpenTelemetry traces and metrics (the Collector's Kafka topics, `rlpulse otlp`) as rlpulse's events."""
