"""rlpulse: telemetry pipeline for RL and distillation training jobs (the wiring: CLI, settings, services)."""

__version__ = "0.1.0"
