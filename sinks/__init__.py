"""Out of Kafka and into people's hands, one room per job: ``store`` (the ClickHouse schema and
connection), ``write`` (the Kafka -> ClickHouse sink), ``read`` (read-only SQL, saved queries, the
read endpoint), ``views`` (ui, watch, report, export, Grafana) and ``alerts`` (the alert feed and
its deliveries). A room imports only the rooms below it: store < write, read < views; alerts
stands alone."""
