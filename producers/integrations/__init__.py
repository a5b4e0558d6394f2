"""Integrations with the trainers people run, one module per framework (``rlpulse.producers.integrations.trl``, ...).

Each imports its framework only when it is used: ``import rlpulse.producers.integrations.trl``
works in a venv without TRL, and the SDK never depends on a framework.
"""
