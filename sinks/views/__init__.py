"""What people look at, read from ClickHouse: ``rlpulse ui``, ``watch``, ``report``, ``export``,
``capacity`` and the Grafana dashboard."""
