"""The job SDK: ``TrainingTelemetry``, its validation, its bounded queue and the background sender that delivers to Kafka."""
