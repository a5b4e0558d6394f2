-- Content kept within bounds (rlpulse.sinks.write.content_bounds). What the sink removed from
-- each span it stored: content_capped = 1 for a span of a trajectory past the per-step cap
-- (RLPULSE_SPAN_CAP), stored without its content attributes; content_cut_chars, the characters of
-- attribute values the sink removed (that cap, and RLPULSE_SINK_CONTENT_MAX_CHARS). Older rows read 0.
ALTER TABLE {db}.spans
    ADD COLUMN IF NOT EXISTS content_capped UInt8 DEFAULT 0,
    ADD COLUMN IF NOT EXISTS content_cut_chars UInt64 DEFAULT 0;
