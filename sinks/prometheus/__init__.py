"""``rlpulse prometheus``: rlpulse's figures, read from ClickHouse at each scrape, in Prometheus's text format.

``names`` maps seed 001's OpenTelemetry names to Prometheus ones (prefix ``rlpulse``), ``buckets``
turns the stored histograms into classic cumulative ones, ``figures`` holds the queries, ``collector``
the metric families and the scrape cache, ``server`` the bounded HTTP endpoint (docs/prometheus.md).
"""
