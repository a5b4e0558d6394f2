-- The characters the SDK cut from a span's content before sending it (its own cap,
-- rlpulse.producers.tracing.content), as a column of its own: `rlpulse retention` and the saved
-- query content-dropped sum it without reading the attribute maps (the content itself). A DEFAULT
-- the sink's inserts leave to ClickHouse (they name the record's fields only), so every writer's
-- rows have it; rows stored before read it from their attributes.
ALTER TABLE {db}.spans
    ADD COLUMN IF NOT EXISTS content_sdk_cut_chars UInt64 DEFAULT toUInt64OrZero(attributes['rlpulse.content.cut_chars']);
