"""Simulated training runs, engines and traced agents through the real SDK, with their ground truth
(``rlpulse demo``, ``rlpulse simulate`` and the tests)."""
