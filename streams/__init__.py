"""Stream processors (Faust): windowed figures computed from the raw topics, and alerts."""
